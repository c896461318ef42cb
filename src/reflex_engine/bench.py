"""`reflex bench MODEL`: warm prefill and decode speed of one loaded model, the figures
llama-bench gives, plus per-token latency, device memory and decode's achieved bandwidth.

Prompts are random token ids (seeded), decoding is greedy with end of sequence ignored, each
figure the median of `runs` after a warm-up. Prefill time is prompt_eval_ms: the forward pass
over the prompt and the first token's choice, which waits for the device. Decode at context C
generates `decode_tokens` tokens after a C-token prompt; tokens/s counts those after the first.
Bandwidth: the weight bytes one decode token reads (every matrix, of stacked experts the share
its chosen ones hold; the embedding table only when it is also the LM head) over the time per
token, as a fraction of a device-to-device copy. The KV cache grows by kv_bytes_per_token a token;
recurrent layers (Gated DeltaNet) hold state_bytes per sequence instead, whatever its length.
"""
from __future__ import annotations

import random
import statistics
import time
from typing import NamedTuple

from .gguf import GGMLType

PREFILL_TOKENS = (16, 128, 512, 2048)
DECODE_CONTEXTS = (128, 4096)
KV_ELEMENT_BYTES = {"cpu": 4, "cuda": 2}  # the numpy backend caches float32, the CUDA one f16


class BenchReport(NamedTuple):
    device: str
    prefill: dict[int, float]  # prompt tokens -> ms
    decode: dict[int, dict[str, float]]  # context -> tokens_per_s, p50_ms, p99_ms
    weight_bytes_per_token: int
    kv_bytes_per_token: int
    state_bytes: int  # the recurrent layers' fixed state a sequence holds (0 without any)
    copy_bytes_per_s: float | None  # None off the GPU
    device_bytes_reserved: int | None  # what the engine allocated on the device
    device_bytes_used: int | None  # the whole GPU's use, the driver's context included

    def as_dict(self) -> dict:
        d = self._asdict()
        d["prefill"] = {str(n): {"ms": ms, "tokens_per_s": n / ms * 1e3} for n, ms in self.prefill.items()}
        d["decode"] = {str(c): {**v, "bandwidth_fraction": self.bandwidth_fraction(v["tokens_per_s"])}
                       for c, v in self.decode.items()}
        return d

    def bandwidth_fraction(self, tokens_per_s: float) -> float | None:
        return self.weight_bytes_per_token * tokens_per_s / self.copy_bytes_per_s if self.copy_bytes_per_s else None


def decode_weight_bytes(model) -> int:
    """Bytes of the weights one decode token reads as the file stores them."""
    tensors, cfg = model.file.gguf.tensors, model.config
    untied = "output.weight" in tensors

    def read(name: str, nbytes: int) -> int:  # a token reads n_used of the n_expert stacked experts
        return nbytes * cfg.routing.n_used // cfg.n_expert if name.endswith("_exps.weight") else nbytes

    return sum(read(name, t.nbytes) for name, t in tensors.items()
               if len(t.shape) > 1 and not (untied and name == "token_embd.weight") and t.ggml_type != GGMLType.F32)


def kv_bytes_per_token(model) -> int:
    """KV cache bytes a token takes: per layer its K and V rows, or MLA's one latent row of
    kv_lora_rank + RoPE dims values; recurrent layers (Gated DeltaNet) take none."""
    shape = model.config.cache_shape(1)
    return len(shape.kv_layers) * (shape.k_width + (0 if shape.latent else shape.v_width)) * KV_ELEMENT_BYTES[model.device]


def recurrent_state_bytes(model) -> int:
    r = model.config.cache_shape(1).recurrent
    return r.nbytes if r else 0


def run_bench(model, runs: int = 5, decode_tokens: int = 64, prefill_tokens=PREFILL_TOKENS,
              contexts=DECODE_CONTEXTS) -> BenchReport:
    from .sampling import SamplingParams

    rng, greedy = random.Random(0), SamplingParams(temperature=0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(model.config.n_vocab) for _ in range(n)]

    def generate(n_prompt: int, n_gen: int):
        gen = model.generate(prompt(n_prompt), max_tokens=n_gen, sampling=greedy, ignore_eos=True)
        stamps = []
        for event in gen:
            if event.id is not None:
                stamps.append(time.perf_counter())
        return gen, stamps

    generate(16, 8)  # warm-up: first launches, the decode graph's capture
    prefill = {}
    for n in prefill_tokens:
        if n + 1 <= model.n_ctx:
            generate(n, 1)
            prefill[n] = statistics.median(generate(n, 1)[0].timings["prompt_eval_ms"] for _ in range(runs))
    decode = {}
    for c in contexts:
        if c + decode_tokens > model.n_ctx:
            continue
        rates, gaps = [], []
        # warm-up, twice: this context's prompt and the decode step of its bucket of slots (backends/cuda/ops.py
        # decode_slots) are each captured the second time their shape comes (backends/cuda/graph.py), where that
        # destroys no graph used since; the prompts before may have held every graph kept. After one warm-up a
        # timed run captured one (an eager pass and an instantiation: 9.5 ms of 8B's 64-token run on the H200,
        # docs/perf-notes.md run 22; since run 23 every decode step has one shape, and the prompt's remains)
        for _ in range(2):
            generate(c, 4)
        for _ in range(max(1, runs // 2)):
            gen, stamps = generate(c, decode_tokens)
            rates.append(gen.tokens_per_s)
            gaps += [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
        gaps.sort()
        decode[c] = {"tokens_per_s": statistics.median(rates), "p50_ms": statistics.median(gaps),
                     "p99_ms": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]}
    copy = reserved = used = None
    if model.device == "cuda":
        dev = model.ops.device
        reserved = model.ops.reserved_bytes
        free, total = dev.drv.mem_info()
        used = total - free
        copy = dev.copy_bandwidth()
    return BenchReport(model.device, prefill, decode, decode_weight_bytes(model), kv_bytes_per_token(model),
                       recurrent_state_bytes(model), copy, reserved,
                       used)


def format_report(r: BenchReport, description: str) -> str:
    lines = [f"| {description} | |", "|---|---|"]
    for n, ms in r.prefill.items():
        lines.append(f"| prefill {n} tokens | {ms:.2f} ms ({n / ms * 1e3:,.0f} tok/s) |")
    for c, d in r.decode.items():
        frac = r.bandwidth_fraction(d["tokens_per_s"])
        bw = f", {frac:.0%} of the copy bandwidth" if frac is not None else ""
        lines.append(f"| decode at context {c} | {d['tokens_per_s']:.1f} tok/s (per token p50 {d['p50_ms']:.2f} ms, "
                     f"p99 {d['p99_ms']:.2f} ms{bw}) |")
    lines.append(f"| weights read per decode token | {r.weight_bytes_per_token / 1e9:.3f} GB |")
    lines.append(f"| KV cache per token | {r.kv_bytes_per_token:,} bytes |")
    if r.state_bytes:
        lines.append(f"| recurrent state per sequence (any context) | {r.state_bytes:,} bytes |")
    if r.copy_bytes_per_s:
        lines.append(f"| device-to-device copy | {r.copy_bytes_per_s / 1e12:.2f} TB/s (read + written) |")
    if r.device_bytes_reserved is not None:
        lines.append(f"| device memory: Reflex's allocations / whole GPU in use | {r.device_bytes_reserved / 1e9:.2f} GB / "
                     f"{r.device_bytes_used / 1e9:.2f} GB |")
    return "\n".join(lines)
