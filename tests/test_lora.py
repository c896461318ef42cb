"""LoRA adapters (llama.cpp's convert_lora_to_gguf.py format) against transformers + PEFT on the
goldens' tiny random bases (tests/goldens/lora, made by tools/make_lora_goldens.py): F32 and Q8_0
bases, F32 and F16 adapters, scales 1 and 0.5, on every device; an adapter for another base is a
one-line error; a KV state remembers which adapters made it."""
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

import reflex_engine
from reflex_engine.check import check_against_reference
from reflex_engine.errors import ReflexError
from reflex_engine.sampling import SamplingParams

from model_files import run_cli
from test_cli import assert_one_line_error

GOLDENS = os.path.join(os.path.dirname(__file__), "goldens")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def base(arch, qtype="F32"):
    return os.path.join(GOLDENS, arch, f"{arch}-{qtype}.gguf")


def adapter(arch, qtype="F32"):
    return os.path.join(GOLDENS, "lora", arch, f"adapter-{qtype}.gguf")


def golden(arch, base_type, scale):
    return os.path.join(GOLDENS, "lora", arch, f"goldens-{base_type}-scale{scale}.npz")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", ["1", "0.5"])
@pytest.mark.parametrize("adapter_type", ["F32", "F16"])
@pytest.mark.parametrize("base_type", ["F32", "Q8_0"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_adapted_logits_and_greedy_match_transformers_with_peft(arch, base_type, adapter_type, scale, device):
    model = reflex_engine.load(base(arch, base_type), device=device, lora=[(adapter(arch, adapter_type), float(scale))])
    report = check_against_reference(model, golden(arch, base_type, scale))
    assert report.ok, "\n".join(report.lines)
    assert report.n_prompts == 5 and sum("greedy" in line and "identical" in line for line in report.lines) == 2


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_adapter_is_what_makes_the_goldens_pass(arch):
    plain = check_against_reference(reflex_engine.load(base(arch), device="cpu"), golden(arch, "F32", "1"))
    assert not plain.ok and plain.worst > 0.05
    half = reflex_engine.load(base(arch), device="cpu", lora=[(adapter(arch), 0.5)])
    assert not check_against_reference(half, golden(arch, "F32", "1")).ok  # the scale matters too


def test_scale_zero_is_the_base_and_two_halves_make_one(tmp_path):
    rng = np.random.default_rng()
    ids = rng.integers(0, 384, 24).tolist()
    plain = reflex_engine.load(base("qwen3"), device="cpu").logits(ids)
    off = reflex_engine.load(base("qwen3"), device="cpu", lora=[(adapter("qwen3"), 0.0)]).logits(ids)
    assert np.array_equal(off, plain)  # adding exact zeros
    one = reflex_engine.load(base("qwen3"), device="cpu", lora=[adapter("qwen3")]).logits(ids)
    halves = reflex_engine.load(base("qwen3"), device="cpu", lora=[(adapter("qwen3", "F16"), 0.5), (adapter("qwen3"), 0.5)])
    np.testing.assert_allclose(halves.logits(ids), one, atol=1e-4 * np.ptp(one))
    assert np.abs(one - plain).max() > 0.05 * np.ptp(one)


def rewrite_adapter(src, dst, rename=None, drop=None, key=None):
    """Copy an adapter GGUF with gguf-py, renaming or dropping a tensor or changing one key."""
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = key[1] if key and key[0] == name else field.contents()
        if field.types[0] == 9:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, field.types[0])
    for t in reader.tensors:
        if t.name == drop:
            continue
        writer.add_tensor((rename or {}).get(t.name, t.name), np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(dst)


def test_an_adapter_for_another_base_is_refused(tmp_path):
    cases = [
        (base("qwen3"), adapter("llama"), "is a LoRA adapter for 'llama'; the base model"),
        (os.path.join(GOLDENS, "llama3", "llama3-F32.gguf"), adapter("llama"), "do not fit the base model's"),
        (base("qwen3"), base("qwen3", "Q8_0"), "is not a LoRA adapter"),
        (base("llama"), rewrite_adapter(adapter("llama"), tmp_path / "far.gguf",
                                        rename={"blk.1.attn_q.weight.lora_a": "blk.7.attn_q.weight.lora_a",
                                                "blk.1.attn_q.weight.lora_b": "blk.7.attn_q.weight.lora_b"}),
         "changes blk.7.attn_q.weight, which the base model"),
        (base("llama"), rewrite_adapter(adapter("llama"), tmp_path / "half.gguf", drop="blk.0.ffn_up.weight.lora_b"),
         "has only one of lora_a and lora_b"),
        (base("llama"), rewrite_adapter(adapter("llama"), tmp_path / "norm.gguf",
                                        rename={"blk.0.ffn_up.weight.lora_b": "blk.0.ffn_norm.weight"}),
         "is not a LoRA pair half"),
        (base("llama"), rewrite_adapter(adapter("llama"), tmp_path / "embd.gguf",
                                        rename={"blk.0.ffn_up.weight.lora_a": "token_embd.weight.lora_a",
                                                "blk.0.ffn_up.weight.lora_b": "token_embd.weight.lora_b"}),
         "token embeddings"),
    ]
    for model_path, adapter_path, message in cases:
        with pytest.raises(ReflexError, match=message):
            reflex_engine.load(model_path, device="cpu", lora=[adapter_path])
    assert_one_line_error(run_cli("generate", base("qwen3"), "hi", "--lora", adapter("llama"), "--device", "cpu"),
                          "is a LoRA adapter for 'llama'")
    assert_one_line_error(run_cli("generate", base("qwen3"), "hi", "--lora-scale", "0.5"), "--lora-scale values for 0")
    assert_one_line_error(run_cli("stdio", base("qwen3"), "--lora", str(tmp_path / "absent.gguf"), "--device", "cpu"),
                          "absent.gguf")


def test_the_cli_and_stdio_apply_adapters():
    args = ["-n", "6", "--temp", "0", "--ignore-eos", "--device", "cpu", "--json"]
    plain = run_cli("generate", base("qwen3"), "Hello there", *args)
    adapted = run_cli("generate", base("qwen3"), "Hello there", *args, "--lora", adapter("qwen3"), "--lora-scale", "0.5")
    assert plain.returncode == 0 and adapted.returncode == 0, adapted.stderr
    api = reflex_engine.load(base("qwen3"), device="cpu", lora=[(adapter("qwen3"), 0.5)])
    gen = api.generate("Hello there", max_tokens=6, sampling=SamplingParams(temperature=0), ignore_eos=True)
    list(gen)
    import json

    assert json.loads(adapted.stdout)["token_ids"] == gen.tokens != json.loads(plain.stdout)["token_ids"]
    proc = subprocess.run([sys.executable, "-m", "reflex_engine", "stdio", base("qwen3"), "--device", "cpu",
                           "--lora", adapter("qwen3"), "--lora-scale", "0.5"], capture_output=True, timeout=120,
                          input=b'{"op": "generate", "prompt": "Hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": true}\n')
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[1])["tokens"] == gen.tokens


def test_a_kv_state_remembers_the_adapters(tmp_path):
    path = str(tmp_path / "s.kv")
    adapted = reflex_engine.load(base("qwen3"), device="cpu", lora=[adapter("qwen3")])
    list(adapted.generate("Hello", max_tokens=2, export_kv=path))
    for other in (reflex_engine.load(base("qwen3"), device="cpu"),
                  reflex_engine.load(base("qwen3"), device="cpu", lora=[(adapter("qwen3"), 0.5)])):
        with pytest.raises(ReflexError, match="written for another model"):
            other.generate("", import_kv=path)
    again = reflex_engine.load(base("qwen3"), device="cpu", lora=[adapter("qwen3")])
    assert again.generate("", max_tokens=1, import_kv=path).cached_tokens > 0


@pytest.mark.gpu
def test_generate_on_cuda_with_an_adapter_loads_no_numpy():
    code = ("import sys\nfrom reflex_engine import cli\n"
            f"code = cli.main(['generate', {base('qwen3', 'Q8_0')!r}, 'Hello', '--device', 'cuda', '-n', '3', '--lora', "
            f"{adapter('qwen3', 'F16')!r}])\nprint('numpy' in sys.modules, code)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().split("\n")[-1] == "False 0"


def test_an_adapter_of_rank_zero_is_refused(tmp_path):
    # found while writing fuzz/fuzz_lora.py: alpha / r was a ZeroDivisionError
    import make_fixtures as m

    spec = m.Spec(kvs=[("general.architecture", m.T_STRING, "qwen3"), ("general.type", m.T_STRING, "adapter"),
                       ("adapter.type", m.T_STRING, "lora"), ("adapter.lora.alpha", m.T_FLOAT32, 16.0)],
                  tensors=[m.Tensor("output.weight.lora_a", (256, 0), m.F32, b""),
                           m.Tensor("output.weight.lora_b", (0, 384), m.F32, b"")])
    path = tmp_path / "rank0.gguf"
    path.write_bytes(m.raw_gguf(spec))
    with pytest.raises(ReflexError, match="have rank 0"):
        reflex_engine.load(base("qwen3"), device="cpu", lora=[str(path)])
