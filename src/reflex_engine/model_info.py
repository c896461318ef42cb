"""`reflex info`: a person's first look at a GGUF file, computed from the header alone."""
from __future__ import annotations

from .gguf import GGUFFile, LazyArray

# Per-architecture hyperparameters worth a glance, shown when present.
_ARCH_KEYS = (
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "expert_count",
    "expert_used_count",
    "rope.freq_base",
)


def describe(f: GGUFFile) -> dict:
    meta = f.metadata
    arch = meta.get("general.architecture")
    quant_mix: dict[str, dict[str, int]] = {}
    for t in f.tensors.values():
        entry = quant_mix.setdefault(t.ggml_type.name, {"tensors": 0, "bytes": 0})
        entry["tensors"] += 1
        entry["bytes"] += t.nbytes
    tokens = meta.get("tokenizer.ggml.tokens")
    hparams = {}
    if isinstance(arch, str):
        for key in _ARCH_KEYS:
            value = meta.get(f"{arch}.{key}")
            if value is not None and not isinstance(value, LazyArray):
                hparams[key] = value
    return {
        "path": f.path,
        "file_bytes": f.size,
        "gguf_version": f.version,
        "architecture": arch,
        "name": meta.get("general.name"),
        "parameters": sum(t.n_elements for t in f.tensors.values()),
        "tensors": len(f.tensors),
        "tensor_bytes": sum(t.nbytes for t in f.tensors.values()),
        "quant_mix": dict(sorted(quant_mix.items(), key=lambda kv: -kv[1]["bytes"])),
        "context_length": hparams.get("context_length"),
        "hparams": hparams,
        "tokenizer": {
            "model": meta.get("tokenizer.ggml.model"),
            "pre": meta.get("tokenizer.ggml.pre"),
            "vocab_size": len(tokens) if tokens is not None else 0,
            "merges": len(meta.get("tokenizer.ggml.merges") or ()),
        },
        "chat_template": "tokenizer.chat_template" in meta,
        "metadata_keys": len(meta),
    }


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def _human_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def format_description(info: dict) -> str:
    tok = info["tokenizer"]
    lines = [
        f"file          {info['path']} ({_human_bytes(info['file_bytes'])}, GGUF v{info['gguf_version']})",
        f"architecture  {info['architecture']}" + (f"  ({info['name']})" if info["name"] else ""),
        f"parameters    {_human_count(info['parameters'])} in {info['tensors']} tensors ({_human_bytes(info['tensor_bytes'])})",
        f"context       {info['context_length'] if info['context_length'] is not None else 'unknown'}",
    ]
    if info["quant_mix"]:
        mix = ", ".join(f"{name} {_human_bytes(v['bytes'])} ({v['tensors']})" for name, v in info["quant_mix"].items())
        lines.append(f"quant mix     {mix}")
    if info["hparams"]:
        lines.append("hparams       " + ", ".join(f"{k}={v}" for k, v in info["hparams"].items() if k != "context_length"))
    if tok["model"]:
        pre = f", pre={tok['pre']}" if tok["pre"] else ""
        lines.append(f"tokenizer     {tok['model']}{pre}, {tok['vocab_size']} tokens, {tok['merges']} merges")
    else:
        lines.append("tokenizer     none")
    lines.append(f"chat template {'yes' if info['chat_template'] else 'no'}")
    return "\n".join(lines)
