"""The reader's compiled helper, if the package build produced it (None otherwise)."""
from __future__ import annotations

import ctypes
import os
from importlib.machinery import EXTENSION_SUFFIXES

READ_ERROR = -(1 << 63)  # reflex_skip_strings' INT64_MIN: the caller falls back to its own walk


def _load_skip_strings():
    folder = os.path.dirname(os.path.abspath(__file__))
    for suffix in EXTENSION_SUFFIXES:
        path = os.path.join(folder, "_strings" + suffix)
        if os.path.exists(path):
            try:
                fn = ctypes.CDLL(path).reflex_skip_strings
            except (OSError, AttributeError):
                return None
            fn.argtypes = (ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64)
            fn.restype = ctypes.c_int64
            return fn
    return None


skip_strings = _load_skip_strings()
