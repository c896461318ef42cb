"""`reflex bench`: every figure present and sane on the numpy backend, the bytes a decode
token reads computed from the file as gguf-py reads it, and the KV cache bytes a token takes."""
import importlib.util
import json
import os
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


# bench/warm.py: Reflex beside llama-bench, one table with the ratios. llama-bench itself runs on the GPU machine;
# here a stand-in prints its `-o json` form (llama.cpp's tools/llama-bench json_printer: one object a test with
# n_prompt, n_gen, n_depth and avg_ts among its fields), its figures random, and records how it was called.
WARM = os.path.join(os.path.dirname(__file__), "..", "bench", "warm.py")
STAND_IN = """#!{python}
import json, random, sys
args = sys.argv[1:]
opt = lambda name: [int(v) for v in args[args.index(name) + 1].split(",")] if name in args else [0]
with open({log!r}, "a") as f:
    f.write(" ".join(args) + "\\n")
if {fail}:
    sys.exit("llama-bench: no CUDA device")
rng = random.Random(" ".join(args))
tests = [dict(n_prompt=p, n_gen=n, n_depth=d) for p in opt("-p") for n in opt("-n") for d in opt("-d")]
print(json.dumps([dict(build_commit="0c1e5709", model_type="qwen3 0.6B", n_gpu_layers=99, **t, avg_ns=1,
                       stddev_ns=0, avg_ts=rng.uniform(100, 20000), stddev_ts=1.0, samples_ts=[1.0]) for t in tests], indent=2))
"""


def warm_module():
    spec = importlib.util.spec_from_file_location("warm", WARM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stand_in(tmp_path, fail=False):
    path, log = tmp_path / "llama-bench", tmp_path / "calls.txt"
    path.write_text(STAND_IN.format(python=sys.executable, log=str(log), fail=fail))
    path.chmod(0o755)
    return str(path), log


def test_warm_table_puts_llama_bench_beside_reflex_bench_with_the_ratios(tmp_path):
    llama, calls = stand_in(tmp_path)
    out = tmp_path / "warm"
    proc = subprocess.run([sys.executable, WARM, f"tiny={MODEL}", "--llama-bench", llama, "--device", "cpu", "--runs", "1",
                           "-c", "300", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert calls.read_text().splitlines() == [  # as the GPU machine's llama-bench is run: every layer on the GPU
        f"-m {MODEL} -ngl 99 -r 1 -o json -p 16,128,512,2048 -n 0",
        f"-m {MODEL} -ngl 99 -r 1 -o json -p 0 -n 64 -d 128,4096"]
    (raw,) = json.loads((out / "raw.json").read_text())
    theirs = {(e["n_prompt"], e["n_gen"], e["n_depth"]): e["avg_ts"] for e in raw["llama"]}
    ours = raw["reflex"]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| tiny |")).split(" | ")[1:]
    for i, n in enumerate((16, 128)):  # the prompts a 300-token context holds
        mine, other = ours["prefill"][str(n)]["tokens_per_s"], theirs[(n, 0, 0)]
        figures = f"{mine:,.0f} / {other:,.0f}"
        assert row[i] == f"{f'**{figures}**' if mine >= other else figures} ({mine / other:.2f}x)"
    for i, n in ((2, 512), (3, 2048)):  # prompts past the context: llama.cpp's figure alone, no ratio against nothing
        assert row[i] == f"- / {theirs[(n, 0, 0)]:,.0f}"
    assert (out / "table.md").read_text() == proc.stdout


def test_warm_table_keeps_reflex_figures_when_llama_bench_fails(tmp_path):
    llama, _ = stand_in(tmp_path, fail=True)
    proc = subprocess.run([sys.executable, WARM, MODEL, "--llama-bench", llama, "--device", "cpu", "--runs", "1",
                           "-c", "300"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    name = os.path.basename(MODEL).removesuffix(".gguf")
    row = next(line for line in proc.stdout.splitlines() if line.startswith(f"| {name} |")).split(" | ")
    ours, theirs = row[1].split(" / ")
    assert ours.replace(",", "").isdigit() and theirs == "-"  # Reflex's prefill 16 alone
    assert "no CUDA device" in proc.stdout.split("Failed:")[1]


def test_warm_table_refuses_a_missing_file_before_running_anything(tmp_path):
    proc = subprocess.run([sys.executable, WARM, str(tmp_path / "absent.gguf")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == f"warm: no such file: {tmp_path / 'absent.gguf'}"
    assert "Traceback" not in proc.stderr


def test_llama_bench_entries_become_prefill_and_decode_figures():
    warm = warm_module()
    entries = [dict(n_prompt=512, n_gen=0, n_depth=0, avg_ts=9000.5), dict(n_prompt=0, n_gen=64, n_depth=4096, avg_ts=238.4),
               dict(n_prompt=0, n_gen=64, n_depth=128, avg_ts=257.0)]
    assert warm.llama_figures(entries) == warm.Figures({512: 9000.5}, {4096: 238.4, 128: 257.0})


def test_warm_table_starts_no_file_past_its_deadline(tmp_path):
    proc = subprocess.run([sys.executable, WARM, f"a={MODEL}", f"b={MODEL}", "--device", "cpu", "--deadline-s", "0",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1  # nothing measured is a failure gpu_check's log shows, not a silent empty table
    failed = proc.stdout.split("Failed:\n")[1].splitlines()
    assert failed == ["- a: not run: past the deadline", "- b: not run: past the deadline"]
    assert (tmp_path / "table.md").read_text() == proc.stdout and json.loads((tmp_path / "raw.json").read_text())[1]["file"] == MODEL
