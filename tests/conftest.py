import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly where no NVIDIA driver is present."""
    import ctypes.util

    if ctypes.util.find_library("cuda"):
        return
    skip = pytest.mark.skip(reason="no CUDA driver (libcuda) on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """Install a fake driver (tools/fake_libcuda.py) and a fake sm_90 kernel image below the
    ctypes binding, so that everything above it is real; returns a function to configure them."""
    from fake_libcuda import FakeLibcuda
    from reflex_engine.backends.cuda import device as device_module
    from reflex_engine.backends.cuda import driver
    from reflex_engine.backends.cuda.image import ImageChoice

    image = tmp_path / "sm_90.cubin"
    image.write_bytes(b"\x7fELF fake")

    def install(kind="sass", min_driver=13000, **machine):
        lib = FakeLibcuda(**machine)
        monkeypatch.setattr(driver, "load_library", lambda name="libcuda.so.1": lib)
        monkeypatch.setattr(device_module, "find_image",
                            lambda cc: ImageChoice(str(image), kind, "sm_90" if kind == "sass" else "compute_120", min_driver))
        return lib

    return install
