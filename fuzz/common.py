"""What the harnesses share: the atheris entry point and its limits, the deterministic replay that
tests/test_fuzz.py runs without atheris, and a seeded mutator for that replay.

A harness is a file `fuzz_NAME.py` with `one_input(data: bytes)`, which raises (anything but a
clean return) when the code under test breaks its contract, and `seeds()`, the starting inputs.
Run as a script it is an atheris fuzzer (libFuzzer's flags and a corpus folder as arguments);
tools/fuzz.sh NAME SECONDS runs one with its corpus, limits and, where the harness reaches
_native.c, an AddressSanitizer build of it.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import random
import resource
import struct
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _folder in ("tests", "tools"):  # the fixtures: model_files, make_fixtures, reference_files
    if os.path.join(ROOT, _folder) not in sys.path:
        sys.path.append(os.path.join(ROOT, _folder))

TIMEOUT_S = 10  # libFuzzer's per-input limit: an input slower than this is reported as a hang
RSS_LIMIT_MB = 3072  # libFuzzer's whole-process limit
MEMORY_HEADROOM = 2 << 30  # address space one input may add (without ASan, which reserves terabytes)
INSTRUMENTED = ("reflex_engine", "reflex_openai", "jinja2")


def fuzzing() -> bool:
    """Whether this process is a harness run as a script (atheris), not a test importing it."""
    main = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    return os.path.basename(main).startswith("fuzz_")


def instrumented():
    """Around a harness's imports of the code under test: atheris adds coverage counters to them
    when fuzzing; in tests a no-op."""
    if not fuzzing():
        return contextlib.nullcontext()
    import atheris

    return atheris.instrument_imports(include=list(INSTRUMENTED))


def scratch_path(name: str) -> str:
    """A per-process file for inputs that must be on disk: in $REFLEX_FUZZ_SCRATCH, else tmpfs where
    there is one. (libFuzzer ends a run without Python's atexit, so callers clean that folder.)"""
    folder = os.environ.get("REFLEX_FUZZ_SCRATCH")
    if not folder:
        import tempfile

        folder = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    path = os.path.join(folder, f"reflex-fuzz-{os.getpid()}-{name}")
    atexit.register(_remove, path, path + ".reflex")
    return path


def _remove(*paths: str) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


# -- atheris ------------------------------------------------------------------------------------


def fuzz(one_input, *, max_len: int, dictionary: str | None = None) -> None:
    """The atheris main of a harness: libFuzzer's flags from the command line, with these defaults."""
    import atheris

    flags = {a.split("=", 1)[0] for a in sys.argv[1:] if a.startswith("-")}
    defaults = {"-max_len": max_len, "-timeout": TIMEOUT_S, "-rss_limit_mb": RSS_LIMIT_MB}
    if dictionary is not None:
        defaults["-dict"] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dicts", dictionary)
    argv = sys.argv[:1] + [f"{k}={v}" for k, v in defaults.items() if k not in flags] + sys.argv[1:]
    _limit_address_space()
    atheris.Setup(argv, one_input)
    atheris.Fuzz()


def bind_native_build() -> None:
    """$REFLEX_FUZZ_NATIVE: a build of _native.c to use instead of the package's (tools/fuzz.sh
    replays each corpus through one built with AddressSanitizer and UBSan)."""
    path = os.environ.get("REFLEX_FUZZ_NATIVE")
    if path:
        import ctypes

        from reflex_engine import native

        native.skip_strings, native.pack_strings = native.bind(ctypes.CDLL(path))
        print(f"fuzz: _native.c from {path}", file=sys.stderr)


def _limit_address_space() -> None:
    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = size + MEMORY_HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


# -- the deterministic replay (tests/test_fuzz.py) -------------------------------------------------


class Slow(AssertionError):
    pass


def replay(one_input, inputs, time_limit_s: float = TIMEOUT_S) -> int:
    """Run every input; raise on the first that fails or takes longer than the limit."""
    n = 0
    for data in inputs:
        start = time.perf_counter()
        try:
            one_input(data)
        except BaseException as e:
            if hasattr(e, "add_note"):  # Python 3.11+
                e.add_note(f"fuzz input ({len(data)} bytes): {data[:400]!r}")
            raise
        if time.perf_counter() - start > time_limit_s:
            raise Slow(f"an input took {time.perf_counter() - start:.1f} s: {data[:400]!r}")
        n += 1
    return n


_INTERESTING = [0, 1, 2, 7, 8, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0xFFFF, 1 << 31, (1 << 32) - 1, 1 << 32,
                1 << 40, 1 << 60, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


def mutants(seeds: list[bytes], count: int, seed: int = 0):
    """`count` seeded mutations of the seeds, libFuzzer's kinds without its feedback: byte flips,
    interesting integers, insertions, deletions, duplicated spans, splices and truncations."""
    rng = random.Random(seed)
    for _ in range(count):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.choice((1, 1, 1, 2, 3, 8))):
            kind = rng.randrange(7)
            at = rng.randrange(len(data) + 1)
            if kind == 0 and data:
                data[min(at, len(data) - 1)] ^= 1 << rng.randrange(8)
            elif kind == 1:
                width = rng.choice((1, 2, 4, 8))
                value = rng.choice(_INTERESTING) & ((1 << 8 * width) - 1)
                data[at : at + width] = value.to_bytes(width, "little")
            elif kind == 2:
                data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
            elif kind == 3:
                del data[at : at + rng.randint(1, 16)]
            elif kind == 4 and data:
                start = rng.randrange(len(data))
                data[at:at] = data[start : start + rng.randint(1, 64)]
            elif kind == 5:
                other = rng.choice(seeds)
                data[at:] = other[rng.randrange(len(other) + 1) :]
            else:
                del data[at:]
        yield bytes(data)


def u32s(data: bytes) -> list[int]:
    """`data` read as little-endian uint32s (a tail of under 4 bytes dropped)."""
    return list(struct.unpack_from(f"<{len(data) // 4}I", data))
