"""Model files for tests: the committed tiny goldens, and rewriting a GGUF with gguf-py."""
import os
import subprocess
import sys

import numpy as np
from gguf import GGUFReader, GGUFWriter

GOLDEN_QWEN3 = os.path.join(os.path.dirname(__file__), "goldens", "qwen3", "qwen3-F32.gguf")


def rewrite(src, dst, *, arch=None, drop=None, reshape=None, drop_key=None, values=None):
    """Copy a GGUF with gguf-py, changing the architecture, dropping or reshaping a tensor,
    dropping a metadata key, or setting scalar keys to new `values` (same type)."""
    reader = GGUFReader(src)
    old_arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch or old_arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", drop_key):
            continue
        value = (values or {}).get(key, field.contents())
        new_key = key.replace(f"{old_arch}.", f"{arch}.", 1) if arch else key
        vtype = field.types[0]
        if vtype == 9:  # array
            writer.add_array(new_key, value)
        else:
            writer.add_key_value(new_key, value, vtype)
    for key, value in (values or {}).items():
        if key not in reader.fields:
            writer.add_uint32(key, value)
    for t in reader.tensors:
        if t.name == drop:
            continue
        data = np.array(t.data)
        if t.name == reshape:
            data = data.reshape(-1)[: data.size // 2]
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def run_cli(*args):
    """`reflex ARGS` in a fresh process, as a user would run it."""
    return subprocess.run([sys.executable, "-m", "reflex_engine", *args], capture_output=True, text=True, timeout=300)
