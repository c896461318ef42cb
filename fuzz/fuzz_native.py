"""The C helpers (_native.c) called directly, with arguments the reader and the packer could pass,
against Python models of their contracts: reflex_skip_strings over a file, reflex_pack_strings
over a region. Their results must equal the models'; tools/fuzz.sh replays the corpus through an
AddressSanitizer build of the same file to catch a read outside the buffers.

Input: 1 byte of mode, then (skip) a u16 count, a u16 start offset and a u16 cut from the end,
or (pack) a u16 count; the rest is the file or region.
"""
from __future__ import annotations

import ctypes
import struct
from array import array

import common

with common.instrumented():
    from reflex_engine import native
    from reflex_engine.tokenizer import strings

PATH = common.scratch_path("strings.bin")
REACHES_NATIVE = True  # tools/fuzz.sh replays its corpus through the sanitizer build of _native.c
MAX_LEN = 1 << 14


def one_input(data: bytes) -> None:
    if native.skip_strings is None or len(data) < 7:
        return
    if data[0] & 1:
        _skip(data)
    else:
        _pack(data, check_pairs=bool(data[0] & 2))


def _skip(data: bytes) -> None:
    count, start, cut = struct.unpack_from("<HHH", data, 1)
    body = data[7:]
    size = max(len(body) - cut, 0)  # the reader passes the file's size; a shorter one bounds the walk
    start = start % (size + 9)
    common.write(PATH, body)
    with open(PATH, "rb") as f:
        got = native.skip_strings(f.fileno(), start, count, size)
    assert got == _skip_model(body, start, count, size), (got, start, count, size)


def _skip_model(body: bytes, offset: int, count: int, size: int) -> int:
    for i in range(count):
        if offset > size or size - offset < 8:
            return -(i + 1)
        (length,) = struct.unpack_from("<Q", body, offset)
        if length > size - offset - 8:
            return -(i + 1)
        offset += 8 + length
    return offset


def _pack(data: bytes, check_pairs: bool) -> None:
    (count,) = struct.unpack_from("<H", data, 1)
    region = data[3:]
    if 8 * count > len(region):
        return  # Strings.from_gguf_array cannot size a blob for it: the reader rejected the array
    blob = bytearray(len(region) - 8 * count)
    offsets = array("I", [0]) * (count + 1)
    slots = array("i", [-1]) * strings._slot_count(count)
    status = array("q", [0]) * 4
    address = ctypes.addressof(ctypes.c_char.from_buffer(blob)) if blob else None
    failed = native.pack_strings(region, len(region), count, check_pairs, address, len(blob), offsets.buffer_info()[0],
                                 slots.buffer_info()[0], len(slots), status.buffer_info()[0])
    keys = _strings_model(region, count)
    if keys is None:
        assert failed == -1, "packed a region that does not hold its strings"
        return
    assert failed == 0, "refused a region that holds its strings"
    expected = strings._packed_in_python(keys, check_pairs)
    table = strings.Strings(bytes(blob), offsets, slots, status[0])
    assert table.to_tuple() == expected.table.to_tuple()
    assert (status[1], status[2], status[3]) == (expected.repeats, _minus(expected.first_empty),
                                                 _minus(expected.first_bad_pair) if check_pairs else -1)


def _strings_model(region: bytes, count: int) -> list[bytes] | None:
    """The `count` strings that exactly fill `region`, or None."""
    keys, at = [], 0
    for _ in range(count):
        if len(region) - at < 8:
            return None
        (length,) = struct.unpack_from("<Q", region, at)
        if length > len(region) - at - 8:
            return None
        keys.append(region[at + 8 : at + 8 + length])
        at += 8 + length
    return keys if at == len(region) else None


def _minus(i: int | None) -> int:
    return -1 if i is None else i


def _strings(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<Q", len(s)) + s for s in items)


def seeds() -> dict[str, bytes]:
    words = [b"a b", b"a b", b"", b"ab", b" x", b"x ", "\u00e9 \u00e9".encode(), b"c d"] + [b"k%d v%d" % (i, i) for i in range(40)]
    tokens = [b"<unk>", b"<s>", b"</s>"] + [bytes([b]) for b in range(32, 127)]
    out = {}
    for name, items in (("merges", words), ("tokens", tokens), ("empty", []), ("one", [b"x"])):
        region = _strings(items)
        out[f"pack-{name}"] = b"\x00" + struct.pack("<H", len(items)) + region
        out[f"pack-pairs-{name}"] = b"\x02" + struct.pack("<H", len(items)) + region
        out[f"skip-{name}"] = b"\x01" + struct.pack("<HHH", len(items), 0, 0) + region
        out[f"skip-offset-{name}"] = b"\x01" + struct.pack("<HHH", len(items), 4, 0) + b"GGUF" + region
    out["skip-huge-length"] = b"\x01" + struct.pack("<HHH", 2, 0, 0) + struct.pack("<QQ", 1, 1 << 63)
    return out


if __name__ == "__main__":
    common.fuzz(one_input, max_len=MAX_LEN)
