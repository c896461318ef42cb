"""Where a pass's GPU time goes, kernel by kernel: a CUDA event pair around every launch of one
prompt's pass and of the decode steps after it (graphs off, so each kernel is its own launch),
the elapsed times summed per kernel name. Beside them the same generation unprofiled: its
prompt_eval_ms and per-token decode time. An interval also holds the GPU's wait for the launch it
brackets: where Python launches slower than the kernels run (every eager pass seen on the H200, small
models most), the sums exceed the wall time and show the host's pace, not the kernels'; serialized
kernel times are then ncu's (`ncu --clock-control none --metrics gpu__time_duration.sum`,
docs/perf-notes.md run 6). Run on the GPU machine:

    PYTHONPATH=src python tools/profile_kernels.py MODEL [--prompt-tokens 16] [--decode 32] [--json] [--once]

Prompts are random token ids (seeded); decoding is greedy with end of sequence ignored. The events
themselves add ~2 us of host time a launch: the profiled run's wall time is not reported.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import sys
from collections import defaultdict

os.environ["REFLEX_CUDA_GRAPHS"] = "0"  # before the backend exists: every kernel a launch of its own

import reflex_engine  # noqa: E402 (after the environment is set)
from reflex_engine.errors import ReflexError  # noqa: E402
from reflex_engine.sampling import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0)


class KernelTimer:
    """Wraps a Device's launch: each launch between two events on its stream, in one pool reused
    after every read."""

    def __init__(self, device):
        self.device, self.launch = device, device.launch
        self.records: list[tuple[str, str, int, int]] = []  # (phase, kernel, event before, event after)
        self.phase = "prompt"
        self._pool: list[int] = []
        device.launch = self._timed_launch

    def _event(self) -> int:
        if self._pool:
            return self._pool.pop()
        event = ctypes.c_void_p()
        self.device.drv.cuEventCreate(ctypes.byref(event), 0)
        return event.value

    def _timed_launch(self, name, grid, block, args, smem=0):
        before, after = self._event(), self._event()
        drv, stream = self.device.drv, self.device.stream
        drv.cuEventRecord(before, stream)
        self.launch(name, grid, block, args, smem)
        drv.cuEventRecord(after, stream)
        self.records.append((self.phase, name, before, after))

    def totals(self) -> dict[str, dict[str, list[float]]]:
        """phase -> kernel -> elapsed ms of each launch; the events go back to the pool."""
        self.device.synchronize()
        out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        ms = ctypes.c_float()
        for phase, name, before, after in self.records:
            self.device.drv.cuEventElapsedTime(ctypes.byref(ms), before, after)
            out[phase][name].append(ms.value)
            self._pool += [before, after]
        self.records = []
        return out


def generate(model, ids: list[int], n_decode: int, timer: KernelTimer | None = None):
    gen = model.generate(ids, max_tokens=n_decode + 1, sampling=GREEDY, ignore_eos=True)
    for i, _ in enumerate(gen):
        if timer is not None and i == 0:
            timer.phase = "decode"  # the first token has been chosen: the prompt's pass is over
    return gen


def table(totals: dict[str, list[float]], per: int, wall_ms: float) -> tuple[list[str], dict]:
    """Markdown rows, longest total first, per `per` passes; and the same as data."""
    kernels = sorted(totals.items(), key=lambda kv: -sum(kv[1]))
    gpu_ms = sum(sum(v) for _, v in kernels) / per
    rows = ["| kernel | launches a pass | ms a pass | share | mean us a launch |", "|---|---|---|---|---|"]
    data = []
    for name, times in kernels:
        ms = sum(times) / per
        rows.append(f"| {name} | {len(times) / per:g} | {ms:.3f} | {ms / gpu_ms:.1%} | {1e3 * sum(times) / len(times):.1f} |")
        data.append({"kernel": name, "launches": len(times) / per, "ms": ms})
    rows.append(f"| all kernels | {sum(len(t) for _, t in kernels) / per:g} | {gpu_ms:.3f} | | |")
    rows.append(f"| the pass unprofiled (wall) | | {wall_ms:.3f} | outside kernels: {max(0.0, wall_ms - gpu_ms):.3f} ms | |")
    return rows, {"kernels": data, "gpu_ms": gpu_ms, "wall_ms": wall_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--decode", type=int, default=32, help="decode steps profiled after the prompt")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--once", action="store_true",
                    help="one generation, no events: the launches for ncu (tools/ncu_table.py) to time")
    args = ap.parse_args()
    try:
        model = reflex_engine.load(args.model, device="cuda", n_ctx=args.prompt_tokens + args.decode + 256)
    except ReflexError as e:
        sys.exit(f"profile_kernels: {e}")
    rng = random.Random(0)
    ids = [rng.randrange(model.config.n_vocab) for _ in range(args.prompt_tokens)]
    if args.once:
        generate(model, ids, args.decode)
        return
    generate(model, ids, args.decode)  # warm-up: the kernels' first loads, the weights on the device
    plain = generate(model, ids, args.decode)
    decode_wall = plain.timings["decode_ms"] / max(1, args.decode)
    timer = KernelTimer(model.ops.device)
    generate(model, ids, args.decode, timer)
    totals = timer.totals()
    prompt_rows, prompt_data = table(totals["prompt"], 1, plain.timings["prompt_eval_ms"])
    decode_rows, decode_data = table(totals["decode"], args.decode, decode_wall)
    if args.json:
        print(json.dumps({"model": args.model, "prompt_tokens": args.prompt_tokens, "prompt": prompt_data,
                          "decode": decode_data}))
        return
    print(f"## {os.path.basename(args.model)} on {model.ops.description}: a {args.prompt_tokens}-token prompt\n")
    print("\n".join(prompt_rows))
    print(f"\n## the same, a decode step (mean of {args.decode}, eager launches)\n")
    print("\n".join(decode_rows))


if __name__ == "__main__":
    sys.exit(main())
