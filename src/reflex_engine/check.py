"""`reflex check`: our logits and greedy continuations against a reference file.

The reference is an .npz of goldens (tools/make_goldens.py writes them from transformers):
`prompt_<i>` token ids with `logits_<i>` float32 [T, V], and optionally `greedy_prompt_<j>`
with `greedy_<j>`, the greedy continuation. Errors are measured relative to each prompt's
logit range, so the tolerance means the same for a tiny random model and a real one.

Default tolerances per device: the numpy backend computes in float32 like the reference (1e-4).
The CUDA backend keeps the KV cache in f16 and runs prefill matmuls on f16 tensor cores
(weights and activations rounded to f16, float32 accumulation): each rounds to ~5e-4
relative, which reaches the logits at a few 1e-3 of their range.
"""
from __future__ import annotations

import numpy as np

from .errors import ReflexError
from .sampling import SamplingParams


TOLERANCE = {"cpu": 1e-4, "cuda": 5e-3}


class Report:
    def __init__(self, tolerance: float):
        self.tolerance = tolerance
        self.lines: list[str] = []
        self.worst = 0.0  # largest relative logit error over all prompts
        self.n_prompts = 0
        self.ok = True


def _load(path: str) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise ReflexError(f"cannot read reference {path}: {e}") from None


def check_against_reference(model, path: str, tolerance: float | None = None) -> Report:
    ref = _load(path)
    tolerance = TOLERANCE[model.device] if tolerance is None else tolerance
    report = Report(tolerance)
    prompts = sorted(k for k in ref if k.startswith("prompt_"))
    if not prompts:
        raise ReflexError(f"{path} holds no prompt_<i> arrays")
    for key in prompts:
        i = key.removeprefix("prompt_")
        if f"logits_{i}" not in ref:
            raise ReflexError(f"{path}: {key} has no logits_{i}")
        ids, expected = ref[key].astype(np.int64).tolist(), ref[f"logits_{i}"]
        ours = model.logits(ids)
        if ours.shape != expected.shape:
            raise ReflexError(f"{path}: logits_{i} has shape {expected.shape}, the model gives {ours.shape}")
        err = np.abs(ours.astype(np.float64) - expected)
        per_position = err.max(axis=1)
        pos = int(per_position.argmax())
        rel = float(per_position[pos] / max(float(np.ptp(expected)), 1e-30))
        report.worst = max(report.worst, rel)
        report.n_prompts += 1
        verdict = "ok" if rel <= tolerance else "MISMATCH"
        report.lines.append(f"prompt {i}: {len(ids)} tokens, worst |dlogit| {per_position[pos]:.3g} at position {pos} "
                            f"(relative {rel:.3g}) {verdict}")
        report.ok &= rel <= tolerance
    for key in sorted(k for k in ref if k.startswith("greedy_prompt_")):
        j = key.removeprefix("greedy_prompt_")
        if f"greedy_{j}" not in ref:
            raise ReflexError(f"{path}: {key} has no greedy_{j}")
        expected = ref[f"greedy_{j}"].astype(np.int64).tolist()
        gen = model.generate(ref[key].astype(np.int64).tolist(), max_tokens=len(expected),
                             sampling=SamplingParams(temperature=0), ignore_eos=True)
        for _ in gen:
            pass
        if gen.tokens == expected:
            report.lines.append(f"greedy {j}: {len(expected)} tokens identical")
            continue
        at = next((n for n, (a, b) in enumerate(zip(gen.tokens, expected)) if a != b), min(len(gen.tokens), len(expected)))
        report.ok = False
        report.lines.append(f"greedy {j}: MISMATCH at token {at}: ours {gen.tokens[at:at + 4]}, reference {expected[at:at + 4]}")
    return report
