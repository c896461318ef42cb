"""The LoRA adapter loader (lora.py): an adapter GGUF from the fuzzer, opened and checked against
the qwen3 golden (ModelFile.add_lora), as `--lora ADAPTER.gguf` does. Opening may raise
ReflexError, nothing else; an adapter that is accepted has complete pairs whose shapes fit the
base, a finite factor each, and the sizes the backend reserves for it.
"""
from __future__ import annotations

import functools
import math
import os

import common

with common.instrumented():
    from reflex_engine import lora
    from reflex_engine.errors import ReflexError

PATH = common.scratch_path("adapter.gguf")
REACHES_NATIVE = True  # tools/fuzz.sh replays its corpus through the sanitizer build of _native.c
MAX_LEN = 1 << 17
BASE = os.path.join(common.ROOT, "tests", "goldens", "qwen3", "qwen3-F32.gguf")


@functools.lru_cache(maxsize=None)
def base():
    from reflex_engine.engine import ModelFile

    return ModelFile(BASE)


def one_input(data: bytes) -> None:
    common.write(PATH, data)
    model = base()
    model.adapters = ()
    scale = (data[-1] - 128) / 64 if data else 1.0
    try:
        model.add_lora(PATH, scale)
    except ReflexError as e:
        assert "\n" not in str(e), str(e)
        return
    (adapter,) = model.adapters
    for name, (a, b) in adapter.pairs.items():
        assert a.name == f"{name}.weight.lora_a" and b.name == f"{name}.weight.lora_b"
        assert a.shape[1] == b.shape[0] > 0 and math.isfinite(adapter.factors[name])
    assert lora.extra_width(model.adapters) > 0 and lora.device_tensors(model.adapters)
    adapter.gguf.close()


def seeds() -> dict[str, bytes]:
    folder = os.path.join(common.ROOT, "tests", "goldens", "lora", "qwen3")
    out = {}
    for name in ("adapter-F16.gguf", "adapter-F32.gguf"):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = f.read()
    from fuzz_gguf import metadata_only

    out["adapter-F16-no-tensors"] = metadata_only(os.path.join(folder, "adapter-F16.gguf"))
    return out


if __name__ == "__main__":
    common.fuzz(one_input, max_len=MAX_LEN, dictionary="gguf.dict")
