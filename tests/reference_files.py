"""Reference files from the llama-cpp-python 0.3.36 sdist (llama.cpp's vocab GGUFs and test
vectors, its converter and gguf-py), fetched from PyPI once into a cache directory.

Cache: $REFLEX_TEST_CACHE, default ~/.cache/reflex-test. The sdist's sha256 is taken from
PyPI's JSON simple index and checked before anything is extracted; only the members below
are extracted. None of these files are committed to this repository.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import urllib.request
from pathlib import Path

PROJECT = "llama-cpp-python"
SDIST = "llama_cpp_python-0.3.36.tar.gz"
_TREE = "llama_cpp_python-0.3.36/vendor/llama.cpp"
_MEMBERS = ("models/ggml-vocab-", "convert_hf_to_gguf.py", "conversion/", "gguf-py/")
_DONE = ".extracted"


def cache_dir() -> Path:
    return Path(os.environ.get("REFLEX_TEST_CACHE") or Path.home() / ".cache" / "reflex-test")


def llama_cpp_tree() -> Path:
    """The extracted llama.cpp tree (models/, convert_hf_to_gguf.py, conversion/, gguf-py/)."""
    root = cache_dir()
    tree = root / _TREE
    if (tree / _DONE).exists():
        return tree
    root.mkdir(parents=True, exist_ok=True)
    url, sha256 = _sdist_url()
    archive = root / SDIST
    if not archive.exists() or _sha256(archive) != sha256:
        tmp = archive.with_suffix(f".part{os.getpid()}")
        with urllib.request.urlopen(url, timeout=120) as resp, open(tmp, "wb") as f:
            shutil.copyfileobj(resp, f)
        if _sha256(tmp) != sha256:
            tmp.unlink()
            raise RuntimeError(f"{SDIST}: sha256 does not match PyPI's")
        os.replace(tmp, archive)
    with tarfile.open(archive) as tar:
        wanted = [m for m in tar.getmembers() if _wanted(m.name) and (m.isfile() or m.isdir())]
        tar.extractall(root, members=wanted)
    (tree / _DONE).touch()
    return tree


def _wanted(name: str) -> bool:
    if not name.startswith(_TREE + "/") or ".." in name.split("/"):
        return False
    rel = name[len(_TREE) + 1 :]
    return any(rel.startswith(m) for m in _MEMBERS)


def _sdist_url() -> tuple[str, str]:
    req = urllib.request.Request(
        f"https://pypi.org/simple/{PROJECT}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        index = json.load(resp)
    for entry in index["files"]:
        if entry["filename"] == SDIST:
            return entry["url"], entry["hashes"]["sha256"]
    raise RuntimeError(f"{SDIST} is not in PyPI's index for {PROJECT}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def vocab_path(name: str) -> Path:
    return llama_cpp_tree() / "models" / f"ggml-vocab-{name}.gguf"


def vocab_tests(name: str) -> list[tuple[str, list[int]]]:
    """The (text, expected ids) pairs of a vocab's .inp/.out files (as test-tokenizer-0.cpp reads them)."""
    base = vocab_path(name)
    raw = base.with_name(base.name + ".inp").read_bytes().decode("utf-8")
    texts = raw.split("\n__ggml_vocab_test__\n")
    if texts and texts[-1] == "":
        texts.pop()
    lines = base.with_name(base.name + ".out").read_bytes().decode("utf-8").split("\n")
    if len(lines) < len(texts):
        raise RuntimeError(f"{base}.out has {len(lines)} lines for {len(texts)} inputs")
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]
