"""The prepared sidecar: build-time work that `reflex prepare MODEL` stores beside the model.

One file, `<model>.reflex`, holds named sections (the reader's layout index, the tokenizer's
tables). Each section carries the fingerprint of the GGUF bytes it was derived from; a
consumer recomputes that fingerprint from the file it has open and ignores the section on any
mismatch, and the sidecar checks each section's own crc32, so a stale or corrupt sidecar costs
time, never correctness.
marshal is used because it is built in and loads 150k-entry tables in a few ms. It is not safe
on damaged data (5 bytes can make it allocate 16 GB for half a minute), so no byte reaches it
before its crc32 matches: the header's too, from the fixed-size prefix before it. A file crafted
with matching crcs is trusted as the model file beside it is.
"""
from __future__ import annotations

import marshal
import mmap
import os
import struct
import zlib

from .errors import ReflexError

FORMAT = 3
_PREFIX = struct.Struct("<8sIII")  # magic, FORMAT, the header's length and crc32
_MAGIC = b"REFLEX\x00\x01"
_MAX_HEADER = 1 << 20


def sidecar_path(gguf_path: str) -> str:
    return gguf_path + ".reflex"


def fingerprint(data) -> tuple[int, int]:
    """(length, crc32) of a byte region: detects a changed or re-converted file cheaply."""
    return len(data), zlib.crc32(data)


def read_section(gguf_path: str, name: str):
    """One section of the sidecar, or None if the file or section is missing, damaged or unreadable.

    A prefix gives the header's length and crc32; the header lists each section's (name, length,
    crc32); the sections' marshal bytes follow in that order. Reading one section seeks past the
    others and checks its crc, so a truncated or bit-flipped sidecar is ignored rather than trusted.
    """
    try:
        with open(sidecar_path(gguf_path), "rb") as f:
            prefix = f.read(_PREFIX.size)
            if len(prefix) != _PREFIX.size:
                return None
            magic, version, length, crc = _PREFIX.unpack(prefix)
            if magic != _MAGIC or version != FORMAT or length > _MAX_HEADER:
                return None
            raw = f.read(length)
            if fingerprint(raw) != (length, crc):
                return None
            header = marshal.loads(raw)
            if not isinstance(header, dict):
                return None
            offset = _PREFIX.size + length
            for stored, length, crc in header["sections"]:
                if stored == name:
                    # mapped, not read: one copy fewer of a multi-MB section
                    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped, \
                            memoryview(mapped)[offset : offset + length] as payload:
                        if fingerprint(payload) != (length, crc):
                            return None
                        return marshal.loads(payload)
                offset += length
    except (OSError, EOFError, ValueError, TypeError, KeyError):
        return None
    return None


def write_sections(gguf_path: str, sections: dict) -> str:
    """Write atomically (temp file + rename), so a crash never leaves half a sidecar."""
    path = sidecar_path(gguf_path)
    tmp = f"{path}.tmp{os.getpid()}"
    payloads = {name: marshal.dumps(section) for name, section in sections.items()}
    header = marshal.dumps({"sections": [(name, *fingerprint(p)) for name, p in payloads.items()]})
    try:
        with open(tmp, "wb") as f:
            f.write(_PREFIX.pack(_MAGIC, FORMAT, *fingerprint(header)))
            f.write(header)
            for payload in payloads.values():
                f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise ReflexError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
