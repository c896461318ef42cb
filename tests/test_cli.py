"""The command line: tokenize/info/prepare on vocabulary-only files, and bad input as one
line on stderr with a non-zero exit, never a traceback."""
import json
import os
import shutil

import numpy as np
import pytest
from gguf import GGUFReader

from model_files import GOLDEN_QWEN3, rewrite, run_cli
from reference_files import vocab_path
from reflex_engine.gguf import GGUFFile
from reflex_engine.tokenizer import Tokenizer



def assert_one_line_error(proc, *needles):
    assert proc.returncode != 0
    assert proc.stderr.startswith("reflex: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr


@pytest.fixture(scope="module")
def qwen2_vocab(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "qwen2.gguf"
    shutil.copy(vocab_path("qwen2"), path)
    return str(path)


def test_tokenize_vocab_only_file(qwen2_vocab, tmp_path):
    with GGUFFile(qwen2_vocab) as f:
        tok = Tokenizer.from_gguf(f)
    text = "Hello <|im_end|> 世界 12345"
    out = run_cli("tokenize", qwen2_vocab, text)
    assert out.returncode == 0, out.stderr
    assert out.stdout == " ".join(map(str, tok.encode(text))) + "\n"
    as_json = json.loads(run_cli("tokenize", qwen2_vocab, text, "--json").stdout)
    assert as_json == tok.encode(text)
    plain = json.loads(run_cli("tokenize", qwen2_vocab, text, "--json", "--no-parse-special").stdout)
    assert plain == tok.encode(text, parse_special=False) and 151645 not in plain
    raw = tmp_path / "bytes.txt"
    raw.write_bytes(b"caf\xc3\xa9 \xff\xfe end")
    from_file = json.loads(run_cli("tokenize", qwen2_vocab, "--file", str(raw), "--json").stdout)
    assert from_file == tok.encode("café \ufffd\ufffd end")


def test_no_bos_flag():
    llama_spm = str(vocab_path("llama-spm"))
    with_bos = json.loads(run_cli("tokenize", llama_spm, "hi", "--json").stdout)
    without = json.loads(run_cli("tokenize", llama_spm, "hi", "--json", "--no-bos").stdout)
    assert with_bos[0] == 1 and with_bos[1:] == without


def test_info_vocab_only_file(qwen2_vocab):
    out = run_cli("info", qwen2_vocab, "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["tokenizer"] == {"model": "gpt2", "pre": "qwen2", "vocab_size": 151936, "merges": 151387}
    assert info["tensors"] == 0 and info["parameters"] == 0 and info["context_length"] == 32768
    text = run_cli("info", qwen2_vocab).stdout
    assert "tokenizer     gpt2, pre=qwen2, 151936 tokens" in text


def test_info_model_file_counts_parameters_and_quant_mix():
    ref = GGUFReader(GOLDEN_QWEN3)
    info = json.loads(run_cli("info", GOLDEN_QWEN3, "--json").stdout)
    assert info["architecture"] == "qwen3"
    assert info["parameters"] == sum(int(np.prod(t.shape)) for t in ref.tensors)
    assert info["quant_mix"] == {"F32": {"tensors": len(ref.tensors), "bytes": sum(int(t.n_bytes) for t in ref.tensors)}}
    assert info["chat_template"] is True


def test_prepare_writes_sidecar_that_later_runs_use(qwen2_vocab):
    before = run_cli("tokenize", qwen2_vocab, "a b c").stdout
    out = run_cli("prepare", qwen2_vocab)
    assert out.returncode == 0 and os.path.exists(qwen2_vocab + ".reflex")
    assert run_cli("tokenize", qwen2_vocab, "a b c").stdout == before


def test_unknown_architecture(tmp_path):
    path = rewrite(GOLDEN_QWEN3, str(tmp_path / "gptj.gguf"), arch="gptj")
    assert_one_line_error(run_cli("generate", path, "hi"), "unsupported architecture 'gptj'")


def test_missing_tensor(tmp_path):
    path = rewrite(GOLDEN_QWEN3, str(tmp_path / "missing.gguf"), drop="blk.1.ffn_up.weight")
    assert_one_line_error(run_cli("generate", path, "hi"), "lacks tensor 'blk.1.ffn_up.weight'")


def test_wrong_shape(tmp_path):
    path = rewrite(GOLDEN_QWEN3, str(tmp_path / "shape.gguf"), reshape="blk.0.attn_q_norm.weight")
    assert_one_line_error(run_cli("system1", path, "hi", "--candidate", "a"), "'blk.0.attn_q_norm.weight' has shape [64]", "expects [128]")


def test_prompt_longer_than_the_context():
    assert_one_line_error(run_cli("generate", GOLDEN_QWEN3, "a b c d e f g h i j", "-c", "4"), "the prompt is", "longer than the context (4)")


def test_prompt_filling_the_context_leaves_no_room():
    assert_one_line_error(run_cli("generate", GOLDEN_QWEN3, "a", "-c", "1"), "leaves no room")


def test_empty_candidate_list():
    assert_one_line_error(run_cli("system1", GOLDEN_QWEN3, "hi"), "at least one candidate")


def test_candidate_that_tokenizes_to_nothing():
    assert_one_line_error(run_cli("system1", GOLDEN_QWEN3, "hi", "--candidate", "a", "--candidate", ""), "candidate 1 ('') tokenizes to no tokens")


def test_bad_sampling_parameter():
    assert_one_line_error(run_cli("generate", GOLDEN_QWEN3, "hi", "--top-p", "0"), "top-p")


def test_negative_seed_means_random_and_context_size_must_be_positive():
    assert run_cli("generate", GOLDEN_QWEN3, "hi", "--seed", "-1", "-n", "2").returncode == 0
    assert_one_line_error(run_cli("generate", GOLDEN_QWEN3, "hi", "-c", "0"), "context size must be at least 1")


def test_missing_prompt():
    assert_one_line_error(run_cli("generate", GOLDEN_QWEN3), "MODEL and PROMPT")


def test_prepare_that_cannot_write_its_sidecar(tmp_path):
    model = tmp_path / "m.gguf"
    shutil.copy(GOLDEN_QWEN3, model)
    (tmp_path / "m.gguf.reflex").mkdir()  # the sidecar's name is taken by a folder (fails even as root)
    assert_one_line_error(run_cli("prepare", str(model)), "cannot write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "m.gguf.reflex"]  # no temp file left


def test_check_with_an_incomplete_reference(tmp_path):
    bad = str(tmp_path / "bad.npz")
    np.savez(bad, prompt_0=np.array([1, 2], np.int32), greedy_prompt_0=np.array([1], np.int32))
    assert_one_line_error(run_cli("check", GOLDEN_QWEN3, "--reference", bad), "prompt_0 has no logits_0")
    np.savez(bad, greedy_prompt_0=np.array([1], np.int32))
    assert_one_line_error(run_cli("check", GOLDEN_QWEN3, "--reference", bad), "holds no prompt_")
    assert_one_line_error(run_cli("check", GOLDEN_QWEN3, "--reference", str(tmp_path / "absent.npz")), "cannot read reference")


def test_result_lines_carry_the_original_reflex_field_names():
    """Scripts written for the original Reflex parse idx, token_ids, num_candidates, best_idx and
    process_start_to_result_ms; every result line has the last."""
    s1 = run_cli("system1", GOLDEN_QWEN3, "Hello", "--candidate", "a", "--candidate", "bc", "--device", "cpu")
    assert s1.returncode == 0, s1.stderr
    lines = [dict(kv.split("=", 1) for kv in line.split()[1:]) for line in s1.stdout.strip().split("\n")]
    assert list(lines[0])[:5] == ["idx", "text", "token_ids", "score", "probability"]
    assert lines[1]["text"] == '"bc"' and json.loads(lines[1]["token_ids"]) == Tokenizer.from_gguf(GGUFFile(GOLDEN_QWEN3)).encode("bc", add_bos=False)
    summary = lines[-1]
    assert list(summary)[:5] == ["process_start_to_result_ms", "num_candidates", "best_idx", "best_text", "entropy"]
    assert summary["num_candidates"] == "2" and float(summary["process_start_to_result_ms"]) > 0
    gen = run_cli("generate", GOLDEN_QWEN3, "Hello", "-n", "2", "--temp", "0", "--device", "cpu")
    assert float(dict(kv.split("=", 1) for kv in gen.stdout.strip().split("\n")[-1].split()[1:])["process_start_to_result_ms"]) > 0
