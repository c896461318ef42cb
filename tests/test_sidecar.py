"""The prepared sidecar: sections come back as written, and damage means 'no sidecar'."""
import os

import pytest

from reflex_engine import sidecar


@pytest.fixture
def model(tmp_path):
    path = str(tmp_path / "m.gguf")
    open(path, "wb").close()
    sidecar.write_sections(path, {"small": {"a": (1, 2)}, "big": {"blob": os.urandom(50_000), "n": 7}})
    return path


def test_sections_round_trip_and_unknown_names_are_none(model):
    assert sidecar.read_section(model, "small") == {"a": (1, 2)}
    big = sidecar.read_section(model, "big")
    assert big["n"] == 7 and len(big["blob"]) == 50_000
    assert sidecar.read_section(model, "missing") is None


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty"])
def test_damaged_sidecar_is_ignored(model, damage):
    path = sidecar.sidecar_path(model)
    data = bytearray(open(path, "rb").read())
    if damage == "flip":
        data[-100] ^= 0x40  # inside the big section's payload
    elif damage == "truncate":
        data = data[:-10]
    elif damage == "garbage":
        data = bytearray(b"\x00not a sidecar")
    else:
        data = bytearray()
    open(path, "wb").write(bytes(data))
    assert sidecar.read_section(model, "big") is None


def test_no_sidecar_is_none(tmp_path):
    assert sidecar.read_section(str(tmp_path / "absent.gguf"), "layout") is None


@pytest.mark.parametrize("damage", ["bomb", "bomb-in-header", "header-flip", "huge-header"])
def test_damage_never_reaches_marshal(model, damage):
    # Found by fuzzing (fuzz/fuzz_sidecar.py): the header was unmarshalled unchecked, and marshal is
    # not safe on damaged data: these 5 bytes (a tuple claiming 2^31-1 items) took ~40 s and 16 GB.
    # The header is now behind a prefix that gives its length and crc32.
    import time

    path = sidecar.sidecar_path(model)
    data = bytearray(open(path, "rb").read())
    bomb = b"(\xff\xff\xff\x7f"
    prefix = sidecar._PREFIX.size
    if damage == "bomb":
        data = bytearray(bomb)
    elif damage == "bomb-in-header":
        data[prefix : prefix + len(bomb)] = bomb
    elif damage == "header-flip":
        data[prefix + 3] ^= 0x80
    else:
        data[prefix - 8 : prefix - 4] = (0xFFFFFFFF).to_bytes(4, "little")
    open(path, "wb").write(bytes(data))
    start = time.perf_counter()
    assert sidecar.read_section(model, "small") is None
    assert time.perf_counter() - start < 0.5
