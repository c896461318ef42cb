"""Tensor declarations with shapes, checked against the file before any op runs.

A declaration names the tensor as the GGUF does (`blk.{i}.attn_q`) and gives its ggml-order
shape as expressions over ArchConfig fields ("n_heads*head_dim"). Loaded weights are reached
by the same names: `w.token_embd`, `w.blk[i].attn_q`, so a KeyError names the file's tensor.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, NamedTuple

from ..errors import ReflexError
from ..gguf import GGUFFile, TensorInfo
from .config import ArchConfig


class TensorDecl(NamedTuple):
    name: str  # without the ".weight" suffix; "blk.{i}." is implied for layer tensors
    shape: tuple[str, ...]
    optional: bool = False
    suffix: str = "weight"  # DeepSeek-V3's `exp_probs_b.bias`; "": none (qwen35's `ssm_a`)
    when: Callable[[ArchConfig, int], bool] | None = None  # the layers (cfg, i) that have it; None: all
    unless: str | None = None  # not needed where the layer has this tensor instead (a legacy fused form)


def _extent(expr: str, cfg: ArchConfig) -> int:
    value = 1
    for factor in expr.split("*"):
        value *= int(factor) if factor.isdigit() else getattr(cfg, factor)
    return value


class Weights(SimpleNamespace):
    """`w.token_embd`, `w.output`, ..., and `w.blk[i].<name>` per layer."""


def plan_weights(f: GGUFFile, cfg: ArchConfig, model: list[TensorDecl], layer: list[TensorDecl]) -> dict[str, TensorInfo | None]:
    """Every declared tensor's directory entry by GGUF name (None: an absent optional one), each
    checked against its declaration before anything is loaded."""

    def find(name: str, decl: TensorDecl) -> TensorInfo | None:
        full = f"{name}.{decl.suffix}" if decl.suffix else name
        info = f.tensors.get(full)
        if info is None:
            if decl.optional or (decl.unless and f"{name[: -len(decl.name)]}{decl.unless}.weight" in f.tensors):
                return None
            raise ReflexError(f"{f.path}: model file lacks tensor {full!r} ({cfg.arch})")
        expected = tuple(_extent(e, cfg) for e in decl.shape)
        if info.shape != expected:
            raise ReflexError(f"{f.path}: tensor {info.name!r} has shape {list(info.shape)}, {cfg.arch} expects {list(expected)}")
        return info

    plan = {d.name: find(d.name, d) for d in model}
    for i in range(cfg.n_layers):
        plan.update({f"blk.{i}.{d.name}": find(f"blk.{i}.{d.name}", d) if d.when is None or d.when(cfg, i) else None
                     for d in layer})
    return plan


def load_weights(f: GGUFFile, cfg: ArchConfig, plan: dict[str, TensorInfo | None], model: list[TensorDecl],
                 layer: list[TensorDecl], ops) -> Weights:
    def load(name: str):
        info = plan[name]
        return None if info is None else ops.load_weight(info.name, info.ggml_type, info.shape, f.tensor_data(info.name))

    # in the order a pass reads them, layers first: a device backend may start a pass while the
    # later weights are still being copied in load order (the embedding's few rows it needs at
    # first can come from the host)
    blk = [SimpleNamespace(**{d.name: load(f"blk.{i}.{d.name}") for d in layer}) for i in range(cfg.n_layers)]
    w = Weights(**{d.name: load(d.name) for d in model})
    w.blk = blk
    return w
