"""The host's share of CUDA passes, on a machine without a GPU: the whole engine over a fake libcuda
(tools/fake_libcuda.py, every driver call answered at once), so what is timed is Python's part of
the launches, and what is recorded is every launch as the driver would be asked for it.

    PYTHONPATH=src python tools/host_pass.py MODEL [--passes 60] [--tokens 16]
    PYTHONPATH=src python tools/host_pass.py MODEL --record OUT.jsonl

Timing: the best and median of --passes generations of one token after a --tokens prompt (random
ids, seeded; greedy), printed as JSON. Interleave processes of two versions of the code to compare
them (docs/perf-notes.md, "The host's share of a launch"). --record: every launch (kernel, grid,
block, shared bytes, whether through cuLaunchKernelEx, each argument's bytes in hex) of prompts of 16 and 40 tokens with three eager
decode steps each, then a prompt of 16 with a captured decode step (graphs on), one per line, to
compare two versions byte for byte. Works on any version of the engine since run 6.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fake_libcuda  # noqa: E402
from reflex_engine.errors import ReflexError  # noqa: E402


def load(path: str, lib: fake_libcuda.FakeLibcuda, image_dir: str):
    import reflex_engine
    from reflex_engine.backends.cuda import device, driver
    from reflex_engine.backends.cuda.image import ImageChoice

    image = os.path.join(image_dir, "sm_90.cubin")
    with open(image, "wb") as fh:
        fh.write(b"\x7fELF fake")
    driver.load_library = lambda name="libcuda.so.1": lib
    device.find_image = lambda cc: ImageChoice(image, "sass", "sm_90", 12000)
    return reflex_engine.load(path, device="cuda")


def prompt(n_tokens: int, n_vocab: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(n_vocab) for _ in range(n_tokens)]


def generate(model, ids: list[int], max_tokens: int) -> None:
    from reflex_engine.sampling import SamplingParams

    list(model.generate(ids, max_tokens=max_tokens, sampling=SamplingParams(temperature=0), ignore_eos=True))


def record(model, lib, out: str) -> int:
    lib.launches = []
    model.ops.graphs = False
    for n in (16, 40):
        generate(model, prompt(n, model.config.n_vocab, seed=n), 4)
    model.ops.graphs = True
    model._forward = model.ops.replayable(model._forward)
    generate(model, prompt(16, model.config.n_vocab, seed=1), 3)
    with open(out, "w") as fh:
        for name, grid, block, smem, ex, args in lib.launches:
            fh.write(json.dumps([name, grid, block, smem, ex, [a.hex() for a in args]]) + "\n")
    return len(lib.launches)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--passes", type=int, default=60)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--record", metavar="OUT", help="write every launch there instead of timing")
    args = parser.parse_args()
    if args.passes < 1 or args.tokens < 1:
        sys.exit("host_pass: --passes and --tokens take 1 or more")
    os.environ["REFLEX_CUDA_GRAPHS"] = "0"  # a one-token generation has no decode step; --record turns them on itself
    lib = fake_libcuda.FakeLibcuda()
    if not args.record:
        lib.cuLaunchKernel = lib.cuLaunchKernelEx = lambda *a: 0  # unchecked: answered at once, as the other calls
    with tempfile.TemporaryDirectory() as tmp:
        try:
            model = load(args.model, lib, tmp)
            if args.record:
                print(f"{record(model, lib, args.record)} launches written to {args.record}")
        except ReflexError as e:
            sys.exit(f"host_pass: {e}")
        except OSError as e:
            sys.exit(f"host_pass: {args.record}: {e.strerror or e}")
        if args.record:
            return 0
        ids = prompt(args.tokens, model.config.n_vocab)
        generate(model, ids, 1)  # first launches: function lookups
        times = []
        for _ in range(args.passes):
            start = time.perf_counter()
            generate(model, ids, 1)
            times.append((time.perf_counter() - start) * 1e3)
    print(json.dumps({"best_ms": round(min(times), 3), "p50_ms": round(statistics.median(times), 3), "passes": args.passes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
