"""A list of strings packed for a cold start, with a text -> position index.

Token texts and BPE merges are 150k-300k strings; as str objects plus a dict they cost tens of
ms to unmarshal and build. Here they are one UTF-8 blob, an offsets array and an
open-addressing hash table (crc32 of the UTF-8 key, linear probing), all loaded from the
sidecar without a copy (`memoryview.cast`). A first lookup costs ~0.5 µs instead of a dict's
~0.05 µs, which a prompt does not notice; repeated lookups hit a small dict of recent answers.

A lookup compares the stored bytes with the key, so a damaged index can only miss, never
return a wrong position; probing stops after the longest run seen at build time, so a damaged
index cannot loop either.
"""
from __future__ import annotations

from array import array
from itertools import accumulate
from typing import NamedTuple
from zlib import crc32

from .. import native
from ..errors import ReflexError

_UNSEEN = object()
_MAX_BLOB = (1 << 32) - 1
_SEEN_LIMIT = 1 << 16


class Strings:
    __slots__ = ("_blob", "_offsets", "_slots", "_probes", "_n", "_seen")

    def __init__(self, blob: bytes, offsets, slots, probes: int):
        """offsets ('I', len + 1 entries) and slots ('i', a power of two) are arrays or views."""
        if not (
            len(offsets) >= 1 and offsets[0] == 0 and offsets[-1] == len(blob)
            and len(slots) > 0 and len(slots) & (len(slots) - 1) == 0
            and isinstance(probes, int) and 1 <= probes <= len(slots)
        ):
            raise ValueError("inconsistent string table")
        self._blob, self._offsets, self._slots, self._probes = blob, offsets, slots, probes
        self._n = len(offsets) - 1
        self._seen: dict[str, int | None] = {}  # SPM and BPE ask for the same pairs again and again

    @classmethod
    def build(cls, keys: list[bytes]) -> tuple[Strings, int]:
        """The table of UTF-8 `keys` (as a GGUF stores them) and the number of duplicates; only
        a key's first position is indexed."""
        hashes = list(map(crc32, keys))
        size = _slot_count(len(keys))
        mask, slots = size - 1, array("i", [-1]) * size
        longest, duplicates = 1, 0
        # The hot loop of an unprepared load (~0.2 µs a key): most keys take their home slot.
        for i, h in enumerate(hashes):
            s = h & mask
            if slots[s] < 0:
                slots[s] = i
                continue
            probe = 1
            while (j := slots[s]) >= 0:
                if hashes[j] == h and keys[j] == keys[i]:
                    duplicates += 1
                    break
                s = (s + 1) & mask
                probe += 1
            else:
                slots[s] = i
                if probe > longest:
                    longest = probe
        offsets = array("I", accumulate(map(len, keys), initial=0))
        return cls(b"".join(keys), offsets, slots, longest), duplicates

    @classmethod
    def from_gguf_array(cls, gguf_file, arr, check_pairs: bool = False) -> Packed:
        """The table of a GGUF string array, packed by _native.c when the build made it."""
        if arr.end - arr.start > _MAX_BLOB:  # offsets are uint32
            raise ReflexError(f"tokenizer: a string array of {arr.end - arr.start:,} bytes is over the 4 GiB limit")
        if native.pack_strings is None:
            return _packed_in_python(arr.raw_strings(), check_pairs)
        region = gguf_file.raw_bytes(arr.start, arr.end)
        count = len(arr)
        size = len(region) - 8 * count
        blob = bytearray(size or 1)  # ctypes takes no address of an empty buffer (all strings empty)
        offsets = array("I", [0]) * (count + 1)
        slots = array("i", [-1]) * _slot_count(count)
        status = array("q", [0]) * 4
        if native.pack_strings(region, len(region), count, check_pairs, _address(blob), size,
                               offsets.buffer_info()[0], slots.buffer_info()[0], len(slots), status.buffer_info()[0]):
            raise ValueError("the string array does not match its bytes")  # the reader checked it
        probes, repeats, first_empty, first_bad_pair = status
        table = cls(bytes(blob) if size else b"", offsets, slots, probes)
        return Packed(table, repeats, _none_if_negative(first_empty), _none_if_negative(first_bad_pair))

    def to_tuple(self) -> tuple:
        """marshal-friendly form (native byte order: the sidecar is machine-local)."""
        return self._blob, self._offsets.tobytes(), self._slots.tobytes(), self._probes

    @classmethod
    def from_tuple(cls, stored) -> Strings:
        """Raises TypeError/ValueError unless the sizes fit together (checks are O(1))."""
        blob, offsets, slots, probes = stored
        if not (isinstance(blob, bytes) and isinstance(offsets, bytes) and isinstance(slots, bytes)):
            raise TypeError("string table parts must be bytes")
        # views, not copies: a copy of the 2-4 MB of tables costs ~1 ms of page faults
        return cls(blob, memoryview(offsets).cast("I"), memoryview(slots).cast("i"), probes)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> str:
        if not 0 <= i < self._n:
            raise IndexError(i)
        return self._blob[self._offsets[i] : self._offsets[i + 1]].decode("utf-8", "replace")

    def get(self, text: str) -> int | None:
        """The first position of `text`, or None."""
        found = self._seen.get(text, _UNSEEN)
        if found is _UNSEEN:
            if len(self._seen) >= _SEEN_LIMIT:
                self._seen.clear()
            found = self._seen[text] = self._find(text.encode("utf-8", "surrogatepass"))
        return found

    def _find(self, key: bytes) -> int | None:
        blob, offsets, slots, n = self._blob, self._offsets, self._slots, self._n
        mask = len(slots) - 1
        s = crc32(key) & mask
        for _ in range(self._probes):
            i = slots[s]
            if not 0 <= i < n:
                return None  # an empty slot (or a damaged one)
            if blob[offsets[i] : offsets[i + 1]] == key:
                return i
            s = (s + 1) & mask
        return None

    def index(self, text: str) -> int:
        i = self.get(text)
        if i is None:
            raise ValueError(f"{text!r} is not in the table")
        return i


class Packed(NamedTuple):
    table: Strings
    repeats: int  # strings equal to an earlier one (not indexed)
    first_empty: int | None
    first_bad_pair: int | None  # with check_pairs: first entry that is not "left right"


def _slot_count(n: int) -> int:
    return 1 << (n * 3 // 2).bit_length()  # load factor under 2/3


def _packed_in_python(keys: list[bytes], check_pairs: bool) -> Packed:
    table, repeats = Strings.build(keys)
    first_empty = keys.index(b"") if b"" in keys else None
    first_bad_pair = next((i for i, k in enumerate(keys) if not _is_pair(k)), None) if check_pairs else None
    return Packed(table, repeats, first_empty, first_bad_pair)


def _is_pair(entry: bytes) -> bool:
    # llama.cpp splits a merge at its first space after position 0
    cut = entry.find(b" ", 1)
    return 0 < cut < len(entry) - 1


def _address(buffer: bytearray) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def _none_if_negative(i: int) -> int | None:
    return None if i < 0 else i
