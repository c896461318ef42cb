"""Write each harness's seed corpus from the fixtures: `python fuzz/make_corpus.py OUT [NAME ...]`
makes OUT/NAME/ (one file per seed, named by its sha1). Nothing here is committed: the seeds come
from tools/make_fixtures.py, tests/goldens/, tests/chat_templates/ and the harnesses themselves."""
from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import sys

import common

HARNESSES = ("gguf", "native", "vocab", "sidecar", "tokenizer", "chat", "ipc", "lora", "openai", "kvstate")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("names", nargs="*", default=HARNESSES)
    args = parser.parse_args(argv)
    for name in args.names:
        folder = os.path.join(args.out, name)
        os.makedirs(folder, exist_ok=True)
        seeds = importlib.import_module(f"fuzz_{name}").seeds()
        for data in seeds.values():
            common.write(os.path.join(folder, hashlib.sha1(data).hexdigest()), data)
        print(f"{folder}: {len(seeds)} seeds, {sum(map(len, seeds.values()))} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
