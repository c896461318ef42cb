"""`reflex bench`: every figure present and sane on the numpy backend, and the bytes a decode
token reads computed from the file as gguf-py reads it."""
import json
import subprocess
import sys

import pytest
from gguf import GGUFReader

import reflex_engine
from reflex_engine.bench import decode_weight_bytes, run_bench
from test_goldens import paths

MODEL = paths("qwen3", "Q4_K")[0]


def test_decode_reads_every_matrix_once_as_gguf_py_sizes_them():
    reader = GGUFReader(MODEL)
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    want = sum(int(t.n_bytes) for t in reader.tensors
               if len(t.shape) > 1 and t.tensor_type.name != "F32" and (tied or t.name != "token_embd.weight"))
    assert decode_weight_bytes(reflex_engine.load(MODEL, device="cpu", n_ctx=64)) == want > 0


def test_bench_reports_prefill_and_decode_at_each_size_that_fits():
    model = reflex_engine.load(MODEL, device="cpu", n_ctx=200)
    r = run_bench(model, runs=1, decode_tokens=8, prefill_tokens=(16, 128, 512), contexts=(32, 4096))
    assert sorted(r.prefill) == [16, 128]  # 512 does not fit a 200-token context
    assert all(ms > 0 for ms in r.prefill.values())
    assert list(r.decode) == [32]
    d = r.decode[32]
    assert d["tokens_per_s"] > 0 and 0 < d["p50_ms"] <= d["p99_ms"]
    assert r.copy_bytes_per_s is None and r.bandwidth_fraction(d["tokens_per_s"]) is None


def test_bench_json_is_one_object():
    proc = subprocess.run([sys.executable, "-m", "reflex_engine", "bench", MODEL, "--device", "cpu", "--runs", "1",
                           "-c", "300", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert set(report["prefill"]) == {"16", "128"} and report["device"] == "cpu"
    assert report["prefill"]["16"]["tokens_per_s"] > 0
