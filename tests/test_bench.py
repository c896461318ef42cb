"""`reflex bench`: every figure present and sane on the numpy backend, the bytes a decode
token reads computed from the file as gguf-py reads it, and the KV cache bytes a token takes."""
import json
import subprocess
import sys

import pytest
from gguf import GGUFReader

import reflex_engine
from reflex_engine.bench import decode_weight_bytes, kv_bytes_per_token, run_bench
from test_goldens import paths

MODEL = paths("qwen3", "Q4_K")[0]


def test_decode_reads_every_matrix_once_as_gguf_py_sizes_them():
    reader = GGUFReader(MODEL)
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    want = sum(int(t.n_bytes) for t in reader.tensors
               if len(t.shape) > 1 and t.tensor_type.name != "F32" and (tied or t.name != "token_embd.weight"))
    assert decode_weight_bytes(reflex_engine.load(MODEL, device="cpu", n_ctx=64)) == want > 0


def test_decode_reads_only_the_chosen_share_of_stacked_experts():
    path = paths("qwen3moe", "Q8_0")[0]
    model = reflex_engine.load(path, device="cpu", n_ctx=64)
    share = model.config.routing.n_used / model.config.n_expert
    tensors = GGUFReader(path).tensors
    tied = "output.weight" not in {t.name for t in tensors}
    tensors = [t for t in tensors if len(t.shape) > 1 and t.tensor_type.name != "F32" and (tied or t.name != "token_embd.weight")]
    want = sum(int(t.n_bytes) * (share if t.name.endswith("_exps.weight") else 1) for t in tensors)
    assert any(t.name.endswith("_exps.weight") for t in tensors) and share < 1
    assert decode_weight_bytes(model) == want


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe", "deepseek2", "deepseek3"])
def test_kv_cache_bytes_per_token(arch):
    """K and V rows per layer; MLA's one latent row, (kv_lora_rank + RoPE dims) x layers x 4 bytes
    (float32 on the CPU). Both as the backend's cache really holds them."""
    n_ctx = 64
    model = reflex_engine.load(paths(arch, "F32")[0], device="cpu", n_ctx=n_ctx)
    cfg = model.config
    row = cfg.kv_lora_rank + cfg.rope.n_rot if cfg.kv_lora_rank else cfg.n_kv_heads * (cfg.head_dim + cfg.v_head_dim)
    assert kv_bytes_per_token(model) == row * cfg.n_layers * 4
    assert kv_bytes_per_token(model) == sum(a.nbytes for a in model.cache.k + model.cache.v) // n_ctx
    if arch == "deepseek3":
        assert kv_bytes_per_token(model) == (32 + 16) * 3 * 4  # the fixture: kv_lora_rank 32, 16 RoPE dims, 3 layers


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
    assert report["kv_bytes_per_token"] == kv_bytes_per_token(reflex_engine.load(MODEL, device="cpu", n_ctx=64)) > 0
