"""The prepared sidecar: build-time work that `reflex prepare MODEL` stores beside the model.

One file, `<model>.reflex`, holds named sections (the reader's layout index, the tokenizer's
tables). Each section carries the fingerprint of the GGUF bytes it was derived
from; a consumer recomputes that fingerprint from the file it has open and ignores the
section on any mismatch, so a stale or corrupt sidecar costs time, never correctness.
marshal is used because it is built in and loads 150k-entry tables in a few ms.
"""
from __future__ import annotations

import marshal
import os
import zlib

FORMAT = 1


def sidecar_path(gguf_path: str) -> str:
    return gguf_path + ".reflex"


def fingerprint(data) -> tuple[int, int]:
    """(length, crc32) of a byte region: detects a changed or re-converted file cheaply."""
    return len(data), zlib.crc32(data)


def read_section(gguf_path: str, name: str):
    """One section of the sidecar, or None if the file or section is missing or unreadable.

    Sections are stored one marshal object after another behind a small header, so reading
    a small early section (the reader's layout) never loads the big ones behind it.
    """
    try:
        with open(sidecar_path(gguf_path), "rb") as f:
            header = marshal.load(f)
            if not isinstance(header, dict) or header.get("format") != FORMAT:
                return None
            for stored in header.get("order", ()):
                section = marshal.load(f)
                if stored == name:
                    return section
    except (OSError, EOFError, ValueError, TypeError):
        return None
    return None


def write_sections(gguf_path: str, sections: dict) -> str:
    """Write atomically (temp file + rename), so a crash never leaves half a sidecar."""
    path = sidecar_path(gguf_path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            marshal.dump({"format": FORMAT, "order": list(sections)}, f)
            for section in sections.values():
                marshal.dump(section, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
