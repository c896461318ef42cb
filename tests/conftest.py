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
