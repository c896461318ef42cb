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


def bind(lib: ctypes.CDLL) -> tuple:
    """(skip_strings, pack_strings) of a loaded _native library; fuzz/ binds a sanitizer build."""
    skip = lib.reflex_skip_strings
    skip.argtypes = (ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64)
    skip.restype = ctypes.c_int64
    pack = lib.reflex_pack_strings
    pack.argtypes = (ctypes.c_char_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int,
                     ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p,
                     ctypes.c_uint64, ctypes.c_void_p)
    pack.restype = ctypes.c_int
    return skip, pack


_lib = _load()
skip_strings, pack_strings = bind(_lib) if _lib is not None else (None, None)

# A mapped file that shrinks under the process (truncated or rewritten in place while a model
# loads) makes the next read of it SIGBUS, which Python cannot turn into an exception.
SIGBUS_MESSAGE = ("reflex: error: a file this process maps (the model or a KV state file) shrank while in use: "
                  "it was truncated or rewritten in place; replace a file by renaming a new one over it\n")
SIGBUS_EXIT = 2  # a GGUFError's


def exit_on_sigbus() -> bool:
    """Make SIGBUS print SIGBUS_MESSAGE and exit with SIGBUS_EXIT instead of dumping core. For the
    CLI's process only (a library does not take a process's signals); False without the build."""
    handler = getattr(_lib, "reflex_exit_on_sigbus", None) if _lib is not None else None
    if handler is None:
        return False
    handler.argtypes, handler.restype = (ctypes.c_char_p, ctypes.c_int), ctypes.c_int
    return handler(SIGBUS_MESSAGE.encode(), SIGBUS_EXIT) == 0
