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
