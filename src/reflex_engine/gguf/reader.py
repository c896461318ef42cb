"""Memory-mapped GGUF reader: metadata, tensor directory and zero-copy tensor bytes.

Standard library only: this runs on the cold path, under CUDA init. Every count, length,
type id and offset is checked against the file before it is used, so a malformed file
raises GGUFError (naming the field and byte offset) instead of reading out of bounds.
Arrays are not decoded at open: a 151,936-entry token list is walked once to find where
it ends and materialised only when someone asks for it.
"""
from __future__ import annotations

import mmap
import os
import struct
from typing import Any, Iterator, NamedTuple

from .. import native, sidecar
from ..errors import GGUFError
from .constants import (
    DEFAULT_ALIGNMENT,
    GGML_BLOCK,
    GGUF_MAGIC,
    GGUF_VERSIONS,
    MAX_TENSOR_DIMS,
    MAX_TENSOR_NAME,
    SCALAR_FORMAT,
    GGMLType,
    ValueType,
    tensor_nbytes,
)

_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_SCALARS = {t: struct.Struct("<" + f) for t, f in SCALAR_FORMAT.items()}
_MAX_STRING = 1 << 30  # as ggml: no single string or array beyond 2^30
_MAX_ARRAY = 1 << 30
_VALUE_TYPES = frozenset(int(t) for t in ValueType)


class TensorInfo(NamedTuple):
    """One tensor-directory entry. `shape` is in ggml order: innermost extent first."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLType
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for extent in self.shape:
            n *= extent
        return n


class LazyArray:
    """A GGUF array value, decoded on demand from the mapping."""

    def __init__(self, buf: mmap.mmap, element_type: ValueType, count: int, start: int, end: int):
        self._buf = buf
        self.element_type = element_type
        self.count = count
        self.start = start
        self.end = end
        self._items: list | None = None

    def __len__(self) -> int:
        return self.count

    def tolist(self) -> list:
        if self._items is None:
            self._items = self._decode()
        return self._items

    def raw_strings(self) -> list[bytes]:
        """A string array's elements as the bytes stored, without UTF-8 decoding (half the cost)."""
        if self.element_type != ValueType.STRING:
            raise TypeError(f"{self!r} is not a string array")
        return _string_slices(self._buf, self.start, self.count)

    def __iter__(self) -> Iterator:
        return iter(self.tolist())

    def __getitem__(self, index):
        if self._items is None and self.element_type != ValueType.STRING and isinstance(index, int):
            if not -self.count <= index < self.count:
                raise IndexError(index)
            fmt = _SCALARS[self.element_type]
            return fmt.unpack_from(self._buf, self.start + (index % self.count) * fmt.size)[0]
        return self.tolist()[index]

    def __repr__(self) -> str:
        return f"LazyArray({self.element_type.name}, {self.count})"

    def _decode(self) -> list:
        if self.element_type == ValueType.STRING:
            return _decode_strings(self._buf, self.start, self.count)
        fmt = SCALAR_FORMAT[self.element_type]
        return list(struct.unpack_from(f"<{self.count}{fmt}", self._buf, self.start))


def _decode_strings(buf, offset: int, count: int) -> list[str]:
    return [str(raw, "utf-8", "replace") for raw in _string_slices(buf, offset, count)]


def _string_slices(buf, offset: int, count: int) -> list[bytes]:
    # Lengths were validated when the file was opened.
    out = []
    append = out.append
    unpack = _U64.unpack_from
    for _ in range(count):
        end = offset + 8 + unpack(buf, offset)[0]
        append(buf[offset + 8 : end])
        offset = end
    return out


class GGUFFile:
    """An open GGUF file. `metadata` maps key -> scalar, str or LazyArray.

    With `use_sidecar`, string arrays already walked by `reflex prepare` are skipped in one
    step once the crc32 of their bytes matches the prepared layout (see layout_section).
    """

    def __init__(self, path: str | os.PathLike, use_sidecar: bool = True):
        self.path = os.fspath(path)
        layout = sidecar.read_section(self.path, "layout") if use_sidecar else None
        self._layout = layout if isinstance(layout, dict) else {}  # anything else is a damaged sidecar
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, ValueType] = {}
        self.spans: dict[str, tuple[int, int]] = {}  # key -> (start, end) of its whole KV entry
        self.tensors: dict[str, TensorInfo] = {}
        try:
            file = open(self.path, "rb")
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot open: {e.strerror or e}") from None
        with file:
            self._fd = file.fileno()  # the compiled string walk reads through it while parsing
            st = os.fstat(self._fd)
            self.size = st.st_size
            self._identity = st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns  # for check_unchanged
            if self.size == 0:
                raise GGUFError(f"{self.path}: magic at byte 0: the file is empty, not a GGUF file")
            try:
                self._buf = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise GGUFError(f"{self.path}: cannot map: {e}") from None
            try:
                self._parse()
            except GGUFError:
                self.close()
                raise
            finally:
                self._fd = None

    # -- public ---------------------------------------------------------------------------

    def raw_bytes(self, start: int, end: int) -> bytes:
        return self._buf[start:end]

    def tensor_data(self, name: str) -> memoryview:
        """Zero-copy view of a tensor's raw bytes (quantized blocks as stored)."""
        info = self.tensors[name]
        return memoryview(self._buf)[info.offset : info.offset + info.nbytes]

    def check_unchanged(self) -> None:
        """Refuse a file rewritten in place since it was mapped: its bytes may now be another
        file's under this one's tensor directory. (One renamed over the path is no change: the
        mapping keeps the file it opened. One that shrank faults on the next read: SIGBUS.)"""
        try:
            st = os.stat(self.path)
        except OSError:
            return  # removed or renamed away: the mapping keeps the file it opened
        if (st.st_dev, st.st_ino) == self._identity[:2] and (st.st_size, st.st_mtime_ns) != self._identity[2:]:
            raise GGUFError(f"{self.path}: changed on disk while in use ({self.size} bytes when opened, {st.st_size} now): "
                            "it was rewritten in place; replace a model by renaming a new file over it")

    def close(self) -> None:
        buf, self._buf = getattr(self, "_buf", None), None
        if buf is not None:
            try:
                buf.close()
            except BufferError:
                pass  # tensor views still alive; the mapping goes when they do

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- parsing --------------------------------------------------------------------------

    def _fail(self, field: str, offset: int, problem: str) -> GGUFError:
        return GGUFError(f"{self.path}: {field} at byte {offset}: {problem}")

    def _need(self, field: str, offset: int, n: int) -> None:
        if n < 0 or offset + n > self.size:
            raise self._fail(field, offset, f"needs {n} bytes but the file ends at byte {self.size}")

    def _read(self, fmt: struct.Struct, field: str, offset: int):
        self._need(field, offset, fmt.size)
        return fmt.unpack_from(self._buf, offset)[0]

    def _read_string(self, field: str, offset: int) -> tuple[str, int]:
        n = self._read(_U64, f"{field} length", offset)
        if n > _MAX_STRING:
            raise self._fail(f"{field} length", offset, f"{n} bytes is more than the 1 GiB limit")
        self._need(field, offset + 8, n)
        raw = self._buf[offset + 8 : offset + 8 + n]
        try:
            return raw.decode("utf-8"), offset + 8 + n
        except UnicodeDecodeError:
            raise self._fail(field, offset, "is not valid UTF-8") from None

    def _parse(self) -> None:
        self._need("magic", 0, 4)
        if self._buf[0:4] != GGUF_MAGIC:
            raise self._fail("magic", 0, f"expected b'GGUF', found {self._buf[0:4]!r}")
        version = self._read(_U32, "version", 4)
        if version & 0xFFFF == 0 and version:
            raise self._fail("version", 4, "big-endian GGUF files are not supported")
        if version not in GGUF_VERSIONS:
            raise self._fail("version", 4, f"unsupported version {version} (supported: 2, 3)")
        self.version = version
        n_tensors = self._read(_I64, "tensor_count", 8)
        n_kv = self._read(_I64, "kv_count", 16)
        # Each KV needs at least 13 bytes and each tensor info at least 29: reject counts the
        # file cannot possibly hold before looping over them.
        if n_kv < 0 or n_kv * 13 > self.size - 24:
            raise self._fail("kv_count", 16, f"{n_kv} entries cannot fit in a {self.size}-byte file")
        if n_tensors < 0 or n_tensors * 29 > self.size - 24:
            raise self._fail("tensor_count", 8, f"{n_tensors} tensors cannot fit in a {self.size}-byte file")
        offset = 24
        for i in range(n_kv):
            offset = self._parse_kv(i, offset)
        self.alignment = self._alignment()
        infos = []
        for i in range(n_tensors):
            info, offset = self._parse_tensor_info(i, offset)
            infos.append(info)
        self.data_offset = -(-offset // self.alignment) * self.alignment if n_tensors else offset
        self._place_tensors(infos)

    def _parse_kv(self, i: int, offset: int) -> int:
        kv_start = offset
        key, offset = self._read_string(f"key of kv {i}", offset)
        if not key:
            raise self._fail(f"key of kv {i}", offset, "is empty")
        if key in self.metadata:
            raise self._fail(f"key {key!r}", offset, "appears twice")
        vtype = self._read(_I32, f"type of {key!r}", offset)
        if vtype not in _VALUE_TYPES:
            raise self._fail(f"type of {key!r}", offset, f"unknown value type {vtype}")
        vtype = ValueType(vtype)
        offset += 4
        if vtype == ValueType.ARRAY:
            value, offset = self._parse_array(key, offset)
        elif vtype == ValueType.STRING:
            value, offset = self._read_string(f"value of {key!r}", offset)
        else:
            fmt = _SCALARS[vtype]
            value = self._read(fmt, f"value of {key!r}", offset)
            if vtype == ValueType.BOOL and self._buf[offset] > 1:
                raise self._fail(f"value of {key!r}", offset, f"bool byte is {self._buf[offset]}")
            offset += fmt.size
        self.metadata[key] = value
        self.value_types[key] = vtype
        self.spans[key] = (kv_start, offset)
        return offset

    def _parse_array(self, key: str, offset: int) -> tuple[LazyArray, int]:
        etype = self._read(_I32, f"element type of {key!r}", offset)
        if etype not in _VALUE_TYPES or etype == ValueType.ARRAY:
            raise self._fail(f"element type of {key!r}", offset, f"invalid array element type {etype}")
        etype = ValueType(etype)
        count = self._read(_U64, f"length of {key!r}", offset + 4)
        if count > _MAX_ARRAY:
            raise self._fail(f"length of {key!r}", offset + 4, f"{count} elements is over the 2^30 limit")
        start = offset + 12
        if etype == ValueType.STRING:
            end = self._prepared_end(key, start, count) or self._skip_strings(key, start, count)
        else:
            end = start + count * _SCALARS[etype].size
            self._need(f"array {key!r}", start, end - start)
        return LazyArray(self._buf, etype, count, start, end), end

    def _prepared_end(self, key: str, start: int, count: int) -> int | None:
        entry = self._layout.get(key)
        if not isinstance(entry, tuple) or len(entry) != 4 or entry[:2] != (start, count):
            return None
        end, crc = entry[2], entry[3]
        if not isinstance(end, int) or not start <= end <= self.size:
            return None
        with memoryview(self._buf)[start:end] as region:
            return end if sidecar.fingerprint(region) == (end - start, crc) else None

    def _skip_strings(self, key: str, offset: int, count: int) -> int:
        # The hot loop of opening an unprepared model (tokens + merges, ~300k strings). The
        # compiled walk (_native.c) when the build made it; else one unpack and one add
        # per element: unpack_from bounds-checks each length field, a length past the end is
        # caught after the loop, and located only on that error path.
        if count * 8 > self.size - offset:
            raise self._fail(f"array {key!r}", offset, f"{count} strings cannot fit in the file")
        if native.skip_strings is not None and self._fd is not None:
            end = native.skip_strings(self._fd, offset, count, self.size)
            if end >= 0:
                return end
            if end != native.READ_ERROR:
                self._locate_bad_string(key, offset, count)
        start, buf, unpack = offset, self._buf, _U64.unpack_from
        try:
            for _ in range(count):
                offset += 8 + unpack(buf, offset)[0]
        except (struct.error, OverflowError):  # a length field past the end, or an absurd length
            offset = self.size + 1
        if offset > self.size:
            self._locate_bad_string(key, start, count)
        return offset

    def _locate_bad_string(self, key: str, offset: int, count: int) -> None:
        for i in range(count):
            self._need(f"length of {key!r}[{i}]", offset, 8)
            n = _U64.unpack_from(self._buf, offset)[0]
            self._need(f"{key!r}[{i}] ({n} bytes)", offset + 8, n)
            offset += 8 + n

    def _alignment(self) -> int:
        if "general.alignment" not in self.metadata:
            return DEFAULT_ALIGNMENT
        value, vtype = self.metadata["general.alignment"], self.value_types["general.alignment"]
        offset = self.spans["general.alignment"][0]
        if vtype != ValueType.UINT32:
            raise self._fail("general.alignment", offset, f"must be a uint32, found {vtype.name}")
        if value == 0 or value & (value - 1):
            raise self._fail("general.alignment", offset, f"must be a non-zero power of two, found {value}")
        return value

    def _parse_tensor_info(self, i: int, offset: int) -> tuple[TensorInfo, int]:
        field = f"name of tensor {i}"
        name, offset = self._read_string(field, offset)
        if not name or len(name.encode()) >= MAX_TENSOR_NAME:
            raise self._fail(field, offset, f"name {name!r} must be 1 to {MAX_TENSOR_NAME - 1} bytes")
        if name in self.tensors:
            raise self._fail(f"tensor {name!r}", offset, "appears twice")
        n_dims = self._read(_U32, f"n_dims of {name!r}", offset)
        if not 1 <= n_dims <= MAX_TENSOR_DIMS:
            raise self._fail(f"n_dims of {name!r}", offset, f"{n_dims} (must be 1 to {MAX_TENSOR_DIMS})")
        offset += 4
        self._need(f"shape of {name!r}", offset, 8 * n_dims)
        shape = struct.unpack_from(f"<{n_dims}q", self._buf, offset)
        if any(extent < 0 for extent in shape):
            raise self._fail(f"shape of {name!r}", offset, f"negative extent in {shape}")
        offset += 8 * n_dims
        type_id = self._read(_I32, f"type of {name!r}", offset)
        if type_id not in GGMLType._value2member_map_:
            raise self._fail(f"type of {name!r}", offset, f"unknown ggml type id {type_id}")
        ggml_type = GGMLType(type_id)
        block_size = GGML_BLOCK[ggml_type][0]
        if shape[0] % block_size:
            raise self._fail(f"shape of {name!r}", offset, f"ne[0]={shape[0]} is not a multiple of {ggml_type.name}'s block size {block_size}")
        rel = self._read(_U64, f"offset of {name!r}", offset + 4)
        if rel % self.alignment:
            raise self._fail(f"offset of {name!r}", offset + 4, f"{rel} is not a multiple of the alignment {self.alignment}")
        nbytes = tensor_nbytes(ggml_type, shape)
        if nbytes > self.size:
            raise self._fail(f"shape of {name!r}", offset, f"{shape} needs {nbytes} bytes, more than the whole file")
        info = TensorInfo(name, tuple(shape), ggml_type, rel, nbytes)
        self.tensors[name] = info  # offset made absolute in _place_tensors
        return info, offset + 12

    def _place_tensors(self, infos: list[TensorInfo]) -> None:
        placed = []
        for info in infos:
            start = self.data_offset + info.offset
            if start + info.nbytes > self.size:
                raise GGUFError(
                    f"{self.path}: data of tensor {info.name!r} at byte {start}: {info.nbytes} bytes run past the end of the file ({self.size} bytes)"
                )
            placed.append(TensorInfo(info.name, info.shape, info.ggml_type, start, info.nbytes))
        ordered = sorted(placed, key=lambda t: t.offset)
        for a, b in zip(ordered, ordered[1:]):
            if a.offset + a.nbytes > b.offset:
                raise GGUFError(f"{self.path}: data of tensor {b.name!r} at byte {b.offset}: overlaps tensor {a.name!r}")
        self.tensors = {t.name: t for t in placed}


def layout_section(gguf: GGUFFile) -> dict:
    """What `reflex prepare` records so the next open can skip walking the string arrays."""
    layout = {}
    for key, value in gguf.metadata.items():
        if isinstance(value, LazyArray) and value.element_type == ValueType.STRING:
            length, crc = sidecar.fingerprint(gguf.raw_bytes(value.start, value.end))
            layout[key] = (value.start, value.count, value.end, crc)
    return layout
