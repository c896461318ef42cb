"""LoRA adapters as llama.cpp's convert_lora_to_gguf.py writes them, applied at load.

An adapter GGUF has `general.type` "adapter", `adapter.type` "lora", `adapter.lora.alpha`, the
base's `general.architecture`, and per adapted matrix W (ggml shape (n_in, n_out)) a pair
`W.lora_a` (n_in, r) and `W.lora_b` (r, n_out): W' = W + s·B·A with s = scale·alpha/r (scale
when alpha is 0), as llama.cpp's llama_adapter_lora_weight::get_scale.

The update is not merged into W: an adapted weight becomes a LoraWeight, and arch.blocks.linear
adds the low-rank product at run time through three more matmuls, ((x·Aᵀ)·S)·Bᵀ with S = s·I
(r, r), as PEFT computes it. So the base stays as the file stores it (quantized blocks, straight
to the device, no numpy on the CUDA cold path), the adapter is small, and every backend runs it
with the ops it has: no new kernels, no host arithmetic on the adapter.
"""
from __future__ import annotations

from array import array
from typing import Any, NamedTuple, Sequence

from .errors import ReflexError
from .gguf import GGMLType, GGUFFile


class LoraWeight(NamedTuple):
    """A base weight with the low-rank terms of its adapters: (lora_a, S, lora_b) each."""

    base: Any
    terms: tuple[tuple[Any, Any, Any], ...]


class Adapter:
    """An adapter file opened and checked against the base model it will be applied to."""

    def __init__(self, path: str, scale: float, base: GGUFFile, config, plan: dict):
        self.path, self.scale = path, float(scale)
        self.gguf = GGUFFile(path, use_sidecar=False)
        meta = self.gguf.metadata
        if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
            raise ReflexError(f"{path} is not a LoRA adapter (general.type {meta.get('general.type')!r}, "
                              f"adapter.type {meta.get('adapter.type')!r})")
        if meta.get("general.architecture") != config.arch:
            raise ReflexError(f"{path} is a LoRA adapter for {meta.get('general.architecture')!r}; the base model "
                              f"{base.path} is {config.arch!r}")
        alpha = meta.get("adapter.lora.alpha", 0.0)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise ReflexError(f"{path}: adapter.lora.alpha must be a number, found {alpha!r}")
        self.pairs = _pairs(path, self.gguf)
        for name, (a, b) in self.pairs.items():
            _check_pair(path, name, a, b, plan, base)
        self.factors = {name: self.scale * alpha / b.shape[0] if alpha else self.scale for name, (a, b) in self.pairs.items()}

    def identity(self, fingerprint) -> str:
        """What a KV state file's fingerprint takes from this adapter: its bytes and its scale."""
        return f"lora {fingerprint(self.gguf)} {self.scale!r}"


def _pairs(path: str, f: GGUFFile) -> dict:
    """{base tensor name without ".weight": (lora_a info, lora_b info)}, each pair complete."""
    pairs: dict[str, list] = {}
    for name, info in f.tensors.items():
        for i, suffix in enumerate((".weight.lora_a", ".weight.lora_b")):
            if name.endswith(suffix):
                pairs.setdefault(name[: -len(suffix)], [None, None])[i] = info
                break
        else:
            raise ReflexError(f"{path}: tensor {name!r} is not a LoRA pair half (name.weight.lora_a / .lora_b); "
                              "adapters that replace other weights are not supported")
    for name, (a, b) in pairs.items():
        if a is None or b is None:
            raise ReflexError(f"{path}: {name}.weight has only one of lora_a and lora_b")
    if not pairs:
        raise ReflexError(f"{path} holds no LoRA tensors")
    return {name: tuple(ab) for name, ab in pairs.items()}


def _check_pair(path: str, name: str, a, b, plan: dict, base: GGUFFile) -> None:
    if name == "token_embd":
        raise ReflexError(f"{path}: LoRA on the token embeddings (token_embd) is not supported")
    target = plan.get(name)
    if target is None or len(target.shape) != 2:
        raise ReflexError(f"{path}: the adapter changes {name}.weight, which the base model {base.path} has no "
                          "matrix of: an adapter for another base model?")
    n_in, n_out = target.shape
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != n_in or b.shape[1] != n_out or a.shape[1] != b.shape[0]:
        raise ReflexError(f"{path}: {name}.weight.lora_a {list(a.shape)} and lora_b {list(b.shape)} do not fit the base "
                          f"model's {name}.weight {list(target.shape)}: an adapter for another base model?")
    if b.shape[0] == 0:  # alpha / r
        raise ReflexError(f"{path}: {name}.weight.lora_a {list(a.shape)} and lora_b {list(b.shape)} have rank 0")


def open_adapters(loras: Sequence[tuple[str, float]], base: GGUFFile, config, plan: dict) -> list[Adapter]:
    return [Adapter(path, scale, base, config, plan) for path, scale in loras]


def device_tensors(adapters: Sequence[Adapter]) -> list[tuple[GGMLType, tuple[int, ...]]]:
    """The (ggml_type, shape) of everything apply() loads, for the backend's reserve()."""
    out, ranks = [], set()
    for adapter in adapters:
        for name, (a, b) in adapter.pairs.items():
            out += [(a.ggml_type, a.shape), (b.ggml_type, b.shape)]
            ranks.add((b.shape[0], adapter.factors[name]))
    return out + [(GGMLType.F32, (r, r)) for r, _ in ranks]


def extra_width(adapters: Sequence[Adapter]) -> int:
    """float32 values per token that adapted matmuls hold beyond a plain one (see Ops.reserve): per
    output width, the low-rank update and the sum beside the base product; per rank, two (T, r)."""
    outs = {b.shape[1] for adapter in adapters for _, b in adapter.pairs.values()}
    ranks = {b.shape[0] for adapter in adapters for _, b in adapter.pairs.values()}
    return 2 * sum(outs) + 2 * sum(ranks)


def apply(adapters: Sequence[Adapter], weights, ops) -> None:
    """Load every adapter's pairs on the backend and wrap each adapted weight in a LoraWeight.
    The adapters' files must stay open until the backend has committed its weights."""
    scales: dict[tuple[int, float], Any] = {}
    for adapter in adapters:
        for name, (a, b) in adapter.pairs.items():
            r, s = b.shape[0], adapter.factors[name]
            if (r, s) not in scales:
                diagonal = array("f", [0.0]) * (r * r)
                for i in range(r):
                    diagonal[i * r + i] = s
                scales[r, s] = ops.load_weight(f"lora scale {s}", GGMLType.F32, (r, r), memoryview(diagonal).cast("B"))
            term = (ops.load_weight(a.name, a.ggml_type, a.shape, adapter.gguf.tensor_data(a.name)), scales[r, s],
                    ops.load_weight(b.name, b.ggml_type, b.shape, adapter.gguf.tensor_data(b.name)))
            owner, attr = _slot(weights, name)
            current = getattr(owner, attr)
            if isinstance(current, LoraWeight):
                setattr(owner, attr, current._replace(terms=current.terms + (term,)))
            else:
                setattr(owner, attr, LoraWeight(current, (term,)))


def _slot(weights, name: str):
    """The object and attribute holding tensor `name` ("blk.3.attn_q", "output") in Weights."""
    if name.startswith("blk."):
        _, layer, attr = name.split(".", 2)
        return weights.blk[int(layer)], attr
    return weights, name
