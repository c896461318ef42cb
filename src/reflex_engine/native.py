"""The compiled helpers (_native.c), if the package build produced them; None otherwise."""
from __future__ import annotations

import ctypes
import os
from importlib.machinery import EXTENSION_SUFFIXES

READ_ERROR = -(1 << 63)  # reflex_skip_strings' INT64_MIN: the caller falls back to its own walk


def _load():
    folder = os.path.dirname(os.path.abspath(__file__))
    for suffix in EXTENSION_SUFFIXES:
        path = os.path.join(folder, "_native" + suffix)
        if os.path.exists(path):
            try:
                return ctypes.CDLL(path)
            except OSError:
                return None
    return None


_lib = _load()
skip_strings = pack_strings = None
if _lib is not None:
    skip_strings = _lib.reflex_skip_strings
    skip_strings.argtypes = (ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64)
    skip_strings.restype = ctypes.c_int64
    pack_strings = _lib.reflex_pack_strings
    pack_strings.argtypes = (ctypes.c_char_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int,
                             ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_uint64, ctypes.c_void_p)
    pack_strings.restype = ctypes.c_int
