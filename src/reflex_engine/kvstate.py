"""KV state files: a model's cache after some tokens, written so a later process resumes there.

`reflex generate --export-kv FILE` writes one at the end of a generation, `--import-kv FILE`
continues it (`Model.generate(import_kv=..., export_kv=...)`; the same on system1 and in the
IPC); `reflex prepare MODEL --system-prompt FILE` bakes one beside the model
(`baked_state_path`), which every request whose prompt starts with its tokens reuses.

Layout (little-endian): a 32-byte prefix, the arrays, then a JSON header.

    0   8  magic b"REFLEXKV"
    8   4  format version (u32)
    12  4  crc32 of the header bytes
    16  8  header offset (u64): the header ends the file
    24  8  header length (u64)
    32     the arrays, each at a 64-byte aligned offset the header gives; then the header

The header says which model wrote the file (a fingerprint of its tensor directory and a sample
of every tensor's bytes, and its architecture), the tokens whose keys and values fill cache slots
0..n-1, the `pending` tokens that follow them but were not evaluated yet (a generation's last
choice), the sampler's random state, and the cache as a list of named arrays with dtype and
shape (`blk.{i}.k` (n, k_width), `blk.{i}.v` (n, v_width)). A latent (MLA) or recurrent cache
is other names in the same list (`blk.{i}.conv`, `blk.{i}.ssm`: a recurrent layer's state after
all n tokens, which serves only a request that continues after all of them). An array is f32 or
f16, the per-token ones all one of them; a recurrent state may differ (the CUDA backend writes
its f16 K and V beside f32 states). The header is
written last, so a file cut short anywhere lacks it or fails its size check; the arrays carry no
checksum (as GGUF weights carry none), since hashing them would cost more than a cold start saves.

Standard library only: on the CUDA cold path the arrays go from the file mapping to the device.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, NamedTuple

from .errors import ContextExceeded, ReflexError
from .ops import StateArray

FORMAT = 1
MAGIC = b"REFLEXKV"
_PREFIX = struct.Struct("<8sIIQQ")
ALIGN = 64
DTYPES = {"f32": 4, "f16": 2}
SAMPLE_BYTES = 4096  # of each tensor, into the fingerprint: fine-tunes of one base share a directory
MAX_HEADER = 1 << 30
SEAM_TOKENS = 4  # a baked prompt still serves a prompt that differs from it in its last few tokens


class StateHeader(NamedTuple):
    """A KV state file's header, checked against the model that reads it."""

    path: str
    tokens: list[int]  # in cache slots 0..n-1
    pending: list[int]  # follow `tokens`, not yet evaluated
    sampler: dict | None  # a backend sampler's state() (None: from system1 or a baked prompt)
    arrays: list[tuple[str, str, tuple[int, ...], int]]  # (name, dtype, shape, offset)
    identity: tuple  # of the file read: mapped_arrays refuses a file replaced since


def model_fingerprint(gguf, extra: Iterable[str] = ()) -> str:
    """sha256 over the tensor directory (names, types, shapes, offsets) and the first bytes of
    every tensor; `extra` adds what changes the weights after load (e.g. adapters)."""
    import hashlib  # only a request that reads or writes a state file pays for it

    h = hashlib.sha256()
    for t in gguf.tensors.values():
        h.update(f"{t.name}\0{int(t.ggml_type)}\0{t.shape}\0{t.offset}\0{t.nbytes}\n".encode())
    for t in gguf.tensors.values():
        h.update(gguf.tensor_data(t.name)[:SAMPLE_BYTES])
    for item in extra:
        h.update(b"\0" + item.encode())
    return h.hexdigest()


def cache_layout(config, n_tokens: int) -> list[tuple[str, tuple[int, ...]]]:
    """The named arrays of a cache holding n_tokens slots (see ops.StateArray), layer by layer."""
    shape = config.cache_shape(n_tokens)
    kinds = (("kv", shape.k_width),) if shape.latent else (("k", shape.k_width), ("v", shape.v_width))
    r = shape.recurrent
    layout = []
    for i in range(config.n_layers):
        if i in shape.kv_layers:
            layout += [(f"blk.{i}.{kind}", (n_tokens, width)) for kind, width in kinds]
        else:
            layout += [(f"blk.{i}.conv", (r.conv_rows, r.channels)), (f"blk.{i}.ssm", (r.n_v_heads, r.k_dim, r.v_dim))]
    return layout


def _per_token(name: str) -> bool:
    """Whether an array holds a row a token (K, V, latent) rather than a recurrent state."""
    return name.rsplit(".", 1)[-1] in ("k", "v", "kv")


def baked_state_path(gguf_path: str) -> str:
    """Where `reflex prepare MODEL --system-prompt FILE` stores that prompt's state."""
    return gguf_path + ".reflex-kv"


# -- writing ---------------------------------------------------------------------------------------


def check_writable(path: str) -> None:
    """Refuse, before any work is done, a path the state could never be written to."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ReflexError(f"cannot write the KV state to {path!r}: not a file path")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ReflexError(f"cannot write the KV state to {path}: it is a folder")
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ReflexError(f"cannot write the KV state to {path}: {folder} is not a writable folder")


def write_state(path: str, *, fingerprint: str, architecture: str, tokens: list[int], pending: list[int],
                sampler: dict | None, arrays: Iterable[StateArray]) -> None:
    """Write atomically: a temporary file in the same folder, fsync, rename. A failure leaves
    nothing behind and is one ReflexError."""
    check_writable(path)
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(b"\0" * _PREFIX.size)
            entries, at = [], _PREFIX.size
            for a in arrays:
                at = _pad_to(f, at)
                data = memoryview(a.data).cast("B")
                if data.nbytes != DTYPES[a.dtype] * _count(a.shape):
                    raise ReflexError(f"internal error: state array {a.name} has {data.nbytes} bytes for {a.dtype} {a.shape}")
                f.write(data)
                entries.append({"name": a.name, "dtype": a.dtype, "shape": list(a.shape), "offset": at})
                at += data.nbytes
            header = json.dumps({"format": FORMAT, "model": {"fingerprint": fingerprint, "architecture": architecture},
                                 "tokens": tokens, "pending": pending, "sampler": sampler, "arrays": entries},
                                separators=(",", ":")).encode()
            f.write(header)
            f.seek(0)
            f.write(_PREFIX.pack(MAGIC, FORMAT, zlib.crc32(header), at, len(header)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_folder(folder)
    except OSError as e:
        raise ReflexError(f"cannot write the KV state to {path}: {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _pad_to(f, at: int) -> int:
    pad = -at % ALIGN
    f.write(b"\0" * pad)
    return at + pad


def _count(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _fsync_folder(folder: str) -> None:
    """So that the rename itself survives a crash."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- reading ---------------------------------------------------------------------------------------


def read_header(path: str, *, fingerprint: str, architecture: str, config) -> StateHeader:
    """The header of a state file for this model, every field checked; one-line errors."""
    header, data_end, identity = _load_header(path)
    try:
        model, arrays = header["model"], header["arrays"]
        state = StateHeader(path, _ids(header["tokens"]), _ids(header["pending"]), header["sampler"],
                            [(a["name"], a["dtype"], tuple(_ids(a["shape"])), a["offset"]) for a in arrays], identity)
        written_by = (model["fingerprint"], model["architecture"])
    except (KeyError, TypeError):
        raise ReflexError(f"{path} is damaged: its header is not a KV state header") from None
    if written_by != (fingerprint, architecture):
        # escaped: the header's strings may hold a newline, and an error is one line
        shown = [str(v).encode("unicode_escape").decode("ascii") for v in written_by]
        raise ReflexError(f"{path} was written for another model ({shown[1]}, fingerprint {shown[0][:12]}), "
                          f"not this {architecture} model ({fingerprint[:12]})")
    _check_arrays(state, config, data_end)
    if not state.tokens:
        raise ReflexError(f"{path} holds no tokens")
    bad = [t for t in state.tokens + state.pending if not 0 <= t < config.n_vocab]
    if bad:
        raise ReflexError(f"{path} holds token id {bad[0]}, outside the vocabulary")
    return state


def count_tokens(path: str) -> int:
    """The tokens a state file continues from, unchecked (0 if it cannot be read): for sizing a
    context before the model is loaded; read_header checks the file later."""
    try:
        header = _load_header(path)[0]
        return len(header["tokens"]) + len(header["pending"])
    except (ReflexError, KeyError, TypeError):
        return 0


def _load_header(path: str) -> tuple[Any, int, tuple]:
    """(the parsed header JSON, where the arrays end, the file's identity) after the prefix checks."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ReflexError(f"cannot read the KV state {path!r}: not a file path")
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            prefix = f.read(_PREFIX.size)
            if len(prefix) < _PREFIX.size or prefix[:8] != MAGIC:
                raise ReflexError(f"{path} is not a Reflex KV state file")
            _, version, crc, offset, length = _PREFIX.unpack(prefix)
            if version != FORMAT:
                raise ReflexError(f"{path} is a KV state file of format {version}; this Reflex reads format {FORMAT}")
            if offset + length != st.st_size or length > MAX_HEADER or offset < _PREFIX.size:
                raise ReflexError(f"{path} is truncated or damaged: {st.st_size} bytes, its header says {offset + length}")
            f.seek(offset)
            raw = f.read(length)
    except OSError as e:
        raise ReflexError(f"cannot read the KV state {path}: {e.strerror or e}") from None
    if zlib.crc32(raw) != crc:
        raise ReflexError(f"{path} is damaged: its header fails its checksum")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise ReflexError(f"{path} is damaged: its header is not JSON") from None
    return header, offset, _identity(st)


def _identity(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _ids(value) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise TypeError
    return value


def _check_arrays(state: StateHeader, config, data_end: int) -> None:
    expected = cache_layout(config, len(state.tokens))
    found = [(name, shape) for name, _, shape, _ in state.arrays]
    if found != expected:
        raise ReflexError(f"{state.path}: its cache ({len(found)} arrays) does not fit this model's "
                          f"({len(expected)} arrays of {len(state.tokens)} tokens)")
    dtypes = [dtype for name, dtype, _, _ in state.arrays if _per_token(name)]  # recurrent states may differ (f32 beside f16 K, V)
    if any(not isinstance(d, str) or d not in DTYPES for _, d, _, _ in state.arrays) or len(set(dtypes)) > 1:
        raise ReflexError(f"{state.path} is damaged: its arrays' dtypes are {sorted(set(str(d) for _, d, _, _ in state.arrays))}, "
                          f"not one of {list(DTYPES)}")
    for name, dtype, shape, offset in state.arrays:
        if not isinstance(offset, int) or offset < _PREFIX.size or offset + DTYPES[dtype] * _count(shape) > data_end:
            raise ReflexError(f"{state.path} is damaged: array {name} lies outside the file")


@contextmanager
def mapped_arrays(state: StateHeader, n_tokens: int) -> Iterator[dict[str, StateArray]]:
    """The arrays' first n_tokens rows as zero-copy views of the file mapping, for a backend's
    import_cache (a slot's keys and values depend only on the tokens up to it: a prefix of the
    rows is the cache of a prefix of the tokens); recurrent states whole."""
    try:
        with open(state.path, "rb") as f:
            if _identity(os.fstat(f.fileno())) != state.identity:
                raise ReflexError(f"{state.path} changed while it was being read")
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise ReflexError(f"cannot read the KV state {state.path}: {e}") from None
    views = []
    try:
        arrays = {}
        for name, dtype, shape, offset in state.arrays:
            if _per_token(name):
                shape = (n_tokens, *shape[1:])
            view = memoryview(mapped)[offset : offset + DTYPES[dtype] * _count(shape)]
            views.append(view)
            arrays[name] = StateArray(name, dtype, shape, view)
        yield arrays
    finally:
        arrays = None
        for view in views:
            view.release()
        try:
            mapped.close()
        except BufferError:
            pass  # a backend still holds a view; the mapping goes when it does


# -- what a request starts from ----------------------------------------------------------------------


class Start(NamedTuple):
    """A request's context and how much of it the cache already holds."""

    ids: list[int]  # the whole context: imported tokens, pending ones, the new prompt
    cached: int  # slots 0..cached-1 take ids[:cached] from the state; the pass starts there
    state: StateHeader | None  # None: nothing to import (cached is 0)


def resume(state: StateHeader, new_ids: list[int], n_ctx: int, whole: bool = False) -> Start:
    """An imported conversation continued by new_ids (which may be empty). whole: the cache holds
    recurrent states, usable only after all the state's tokens."""
    ids = state.tokens + state.pending + new_ids
    if len(ids) > n_ctx:
        raise ContextExceeded(f"the imported state ({len(state.tokens) + len(state.pending)} tokens) plus the prompt "
                              f"({len(new_ids)}) is {len(ids)} tokens, longer than the context ({n_ctx})")
    return Start(ids, _cached(state, ids, whole), state)


def prefix(state: StateHeader | None, ids: list[int], whole: bool = False) -> Start:
    """A baked prompt reused when ids start with its tokens, or with all but its last SEAM_TOKENS
    (the prompt's text continued the baked text's last word or whitespace, and the tokenizer
    merged across the seam): then the tokens they share are not evaluated again. whole: as for
    resume, so only ids that continue past all the baked tokens reuse them."""
    shared = 0
    if state is not None:
        for a, b in zip(state.tokens, ids):
            if a != b:
                break
            shared += 1
    if state is None or shared < len(state.tokens) - SEAM_TOKENS:
        return Start(ids, 0, None)
    cached = _cached(state, ids, whole) if whole else min(shared, len(ids) - 1)
    return Start(ids, cached, state if cached else None)


def _cached(state: StateHeader, ids: list[int], whole: bool) -> int:
    # the pass must hold at least one token, for the logits that choose the next one: with
    # nothing new, the last cached token is evaluated again (its slot rewritten); a recurrent
    # state cannot be taken back a token, so then everything is evaluated again
    n = len(state.tokens)
    if len(ids) > n and ids[:n] == state.tokens:
        return n
    return 0 if whole else n - 1


def sampler_state(kind: str, seed: int | None, state: Any) -> dict | None:
    """What a state file keeps of a sampler: its random state, for a seeded run only (an unseeded
    one has no stream another run could be asked to continue)."""
    return None if seed is None else {"rng": kind, "seed": seed, "state": state}


def restorable(saved: dict | None, kind: str, seed: int | None):
    """The saved random state if it continues this sampler's stream (same kind, same seed)."""
    if not isinstance(saved, dict) or seed is None or saved.get("rng") != kind or saved.get("seed") != seed:
        return None
    return saved.get("state")
