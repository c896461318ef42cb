"""Replay a harness's inputs without atheris: `python fuzz/replay.py NAME [FILE|FOLDER ...]
[--mutants N]`. With no paths, the harness's seeds. tools/fuzz.sh runs it under AddressSanitizer
(with $REFLEX_FUZZ_NATIVE naming the sanitizer build of _native.c) over the corpus a run left."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import common


def inputs(paths: list[str]) -> list[bytes]:
    out = []
    for path in paths:
        names = sorted(os.path.join(path, n) for n in os.listdir(path)) if os.path.isdir(path) else [path]
        for name in names:
            with open(name, "rb") as f:
                out.append(f.read())
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("name")
    parser.add_argument("paths", nargs="*")
    parser.add_argument("--mutants", type=int, default=0, help="also this many seeded mutations of the inputs")
    args = parser.parse_args(argv)
    harness = importlib.import_module(f"fuzz_{args.name}")
    common.bind_native_build()
    data = inputs(args.paths) if args.paths else list(harness.seeds().values())
    start = time.perf_counter()
    n = common.replay(harness.one_input, data)
    if args.mutants:
        n += common.replay(harness.one_input, common.mutants(data, args.mutants, seed=1))
    elapsed = time.perf_counter() - start
    print(f"replay {args.name}: {n} inputs in {elapsed:.1f} s ({n / max(elapsed, 1e-9):.0f}/s), no failure")
    return 0


if __name__ == "__main__":
    sys.exit(main())
