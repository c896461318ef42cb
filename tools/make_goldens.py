#!/usr/bin/env python3
"""Make the golden test fixtures for the CPU forward pass (dev-only; CI never runs this).

For each variant (llama, qwen3, llama3: llama with Llama-3.1 RoPE scaling, qwen3moe, and deepseek3 /
deepseek2: DeepSeek-V3 / V2-Lite-style MLA models) the tool:

1. builds a tiny random Hugging Face checkpoint plus a toy byte-level BPE tokenizer;
2. converts it to GGUF with llama.cpp's own ``convert_hf_to_gguf.py`` (F32, F16, BF16, Q8_0)
   and quantizes every 2-D weight of the F32 file with ggml's reference quantizer
   (``ggml_quantize_chunk`` from a libggml-base built here) to Q4_0, Q4_1, Q4_K, Q5_K, Q6_K
   (llama3: F32 and Q8_0 only);
3. runs transformers on each GGUF file's weights to record the logits of a few fixed prompts and
   greedy continuations: ``from_pretrained(..., gguf_file=...)`` (config and weights from the file,
   dequantized through gguf-py), or for llama3, whose ``rope_freqs`` that loader ignores, the HF
   checkpoint with its weights replaced by the file's dequantized ones.

Everything here is ground truth for reflex_engine, so nothing from reflex_engine is imported.

Requirements (torch CPU build, transformers, llama.cpp's converter dependencies):

    pip install -e '.[goldens]'

plus cmake and a C/C++ compiler for libggml-base. Run from the repository root:

    python tools/make_goldens.py                # all variants
    python tools/make_goldens.py --arch llama3  # one variant; the others' files are left alone

Outputs go to tests/goldens/ (see tests/goldens/README.md, which this tool also writes).
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "tests" / "goldens"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "reflex-engine-goldens"

# llama.cpp source comes from the llama-cpp-python sdist (it vendors llama.cpp, the converter and gguf-py).
SDIST_NAME = "llama_cpp_python-0.3.36.tar.gz"
SDIST_INDEX = "https://pypi.org/simple/llama-cpp-python/"
LLAMA_CPP_COMMIT = "0c1e570"  # the commit vendored in that sdist

SEED = 1234
VOCAB_SIZE = 384  # model vocab; a bit above the toy tokenizer so the converter writes [PAD{i}] tokens
N_MERGES = 112  # BPE merges learned by the toy tokenizer (bounded by VOCAB_SIZE minus bytes and added tokens)
GREEDY_NEW_TOKENS = 32
N_GREEDY_PROMPTS = 2
N_GREEDY_CANDIDATES = 40  # random extra prompts to try when the logits prompts give near-ties
MIN_RELATIVE_MARGIN = 1e-3  # greedy top-1/top-2 gap must be at least this fraction of the step's logit range

# GGUF type name -> how it is produced. Converter outtypes come straight from convert_hf_to_gguf.py;
# the others are requantized from the F32 file with ggml_quantize_chunk.
CONVERTER_TYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0"}
GGML_QUANT_TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]
ALL_TYPES = list(CONVERTER_TYPES) + GGML_QUANT_TYPES

# general.file_type for the requantized files (LlamaFileType). A file where every matrix is Q4_K is
# closest to Q4_K_S; the key is informational only, readers must trust the per-tensor types.
FILE_TYPE_NAMES = {"Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1", "Q4_K": "MOSTLY_Q4_K_S",
                   "Q5_K": "MOSTLY_Q5_K_S", "Q6_K": "MOSTLY_Q6_K"}

# Pre-tokenizer regexes exactly as llama.cpp's llm_tokenizer_bpe spells them (src/llama-vocab.cpp).
# The HF tokenizer splits with the same regex, so HF's ids are what a GGUF tokenizer must give.
QWEN2_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A small English + code corpus for the toy BPE. Its only job is to give real, learned merges.
TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. The dog did not mind; it was asleep in the sun.
It is a truth universally acknowledged that a small model in possession of random weights
must be in want of a test. We're testing the tokenizer, and they'll see that it's working.
In the beginning there was the token, and the token was with the model, and the model was tiny.
Hello world! Hello there, how are you doing today? I'm doing well, thank you for asking.
Numbers like 3, 33, 333, 2024 and 3.14159 appear in text; so do dates such as 2025-01-31.
The engine reads the file, parses the header, maps the tensors, and then it runs the forward pass.
def forward(self, input_ids, positions):
    hidden = self.embed(input_ids)
    for layer in self.layers:
        hidden = layer(hidden, positions)
    return self.norm(hidden) @ self.output.T

class Tokenizer:
    def __init__(self, vocab, merges):
        self.vocab = vocab
        self.merges = {pair: rank for rank, pair in enumerate(merges)}

    def encode(self, text: str) -> list[int]:
        return [self.vocab[piece] for piece in self.split(text)]

for i in range(10):
    print(f"step {i}: loss = {loss:.4f}")
if __name__ == "__main__":
    main()
"""

# Strings whose HF token ids are saved to tokenizer-check.json (for checking our GGUF tokenizer later).
TOKENIZER_CHECK_STRINGS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space and  double  spaces",
    "numbers 3 33 333 3333 3.14",
    "def main():\n    return 42\n",
    "I'm sure they'll say it's fine. WE'RE LOUD",
    "tabs\tand\nnewlines\n\n",
    "unicode: café naïve 東京 🚀",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<think>reasoning</think> answer",
]
ENGLISH_PROMPT = "The engine reads the file and then it runs the forward pass."


# HF config shared by every tiny model; ArchSpec.config adds to or overrides it.
COMMON_CONFIG = dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                     rms_norm_eps=1e-6, max_position_embeddings=512, rope_theta=10000.0,
                     # a wider init than the default 0.02 so attention is not uniform and logits are O(1)
                     initializer_range=0.1,
                     bos_token_id=None, eos_token_id=None, pad_token_id=None,
                     attn_implementation="eager")  # as the GGUF references, so the F32 check is exact

# Llama-3.1-style RoPE scaling with a tiny original context, so that at head_dim 64 and theta 5e5 the
# correction bends several frequencies: pairs 0-2 keep their factor 1 (wavelength < 64/4), 3-5 are
# smoothed, 6-31 are divided by 8 (wavelength > 64). The converter writes it as rope_freqs.weight.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the tiny models (one per variant)."""

    name: str  # variant: output folder, file prefix, checkpoint and general.name
    arch: str  # GGUF architecture string (llama or qwen3; also picks the transformers model class)
    pre: str  # tokenizer.ggml.pre forced into the converter
    regex: str  # HF pre-tokenizer split regex matching that pre name
    ignore_merges: bool  # llama.cpp's llama-bpe sets ignore_merges; HF must do the same to agree
    bos_token: str | None
    add_bos: bool
    config: dict  # HF config kwargs on top of COMMON_CONFIG
    types: tuple[str, ...] = tuple(ALL_TYPES)  # GGUF types to write (F32 always: the others start from it)
    long_prompts: tuple[int, ...] = ()  # lengths of extra logits prompts, after the usual five
    long_greedy: tuple[int, ...] = ()  # lengths of extra greedy candidates, tried before the usual ones
    # Reference for each file: "gguf" = transformers on the GGUF alone (config and weights from the file);
    # "checkpoint" = the HF checkpoint (its config) with the file's dequantized weights loaded into it.
    reference: str = "gguf"
    converter_args: tuple[str, ...] = ()  # extra convert_hf_to_gguf.py flags
    # how far the F32 file's reference may be from the checkpoint built in memory: transformers'
    # grouped_mm experts give a model reloaded from disk float32-different logits for the same
    # weights (2.6e-6 measured on a one-token qwen35moe prompt)
    f32_tolerance: float = 1e-6


HYBRID_CONFIG = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4)
# 3 layers, attention last: the file's recurrent_layers, not full_attention_interval (4), says so
HYBRID_MOE = dict(num_hidden_layers=3, layer_types=["linear_attention", "linear_attention", "full_attention"],
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
LLAMA_TOKENIZER = dict(pre="llama-bpe", regex=LLAMA3_REGEX, ignore_merges=True, bos_token="<|begin_of_text|>",
                       add_bos=True)
ARCHS = {
    "llama": ArchSpec("llama", "llama", **LLAMA_TOKENIZER,
                      config=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                  tie_word_embeddings=True)),
    # head_dim 128: transformers' GGUF loader ignores qwen3.attention.key_length and assumes 128
    "qwen3": ArchSpec("qwen3", "qwen3", "qwen2", QWEN2_REGEX, False, None, False,
                      config=dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                                  tie_word_embeddings=False)),
    # Smaller (hidden 128, FFN 128, 2 heads / 1 KV head of 64) to keep the files small; long prompts
    # put positions well past the original context of 64, where the scaling matters most.
    # transformers' GGUF loader maps rope.freq_base only and drops rope_freqs, so the reference is
    # the checkpoint itself (see check_llama3_rope).
    "llama3": ArchSpec("llama3", "llama", **LLAMA_TOKENIZER,
                       config=dict(hidden_size=128, intermediate_size=128, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=64, tie_word_embeddings=True,
                                   rope_theta=500000.0, rope_parameters=dict(LLAMA3_ROPE)),
                       types=("F32", "Q8_0"), long_prompts=(160,), long_greedy=(300, 280, 260, 240),
                       reference="checkpoint"),
    # Qwen3-MoE: 8 experts of FFN width 32, 2 per token, on hidden 64 (2 heads / 1 KV head of 32),
    # so the files stay small; Q4_K and the other 256-value blocks do not fit rows of 32 or 64, so
    # the requantized type is Q4_0. norm_topk_prob=True: llama.cpp always renormalises the top-k
    # weights (the converter writes no key for it), so a False checkpoint would not be its model.
    # transformers' GGUF loader ignores expert_feed_forward_length (it assumes 768), so the
    # reference is the checkpoint with each file's weights.
    "qwen3moe": ArchSpec("qwen3moe", "qwen3moe", "qwen2", QWEN2_REGEX, False, None, False,
                         config=dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                     moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                     tie_word_embeddings=False),
                         types=("F32", "F16", "Q8_0", "Q4_0"), reference="checkpoint"),
    # DeepSeek-V3-style (GGUF deepseek2): MLA with q_lora_rank 32, kv_lora_rank 32, 2 heads of
    # qk_nope 32 + qk_rope 16 and v_head 32; 1 dense layer then 2 MoE layers of 8 experts in 2
    # groups (1 kept), 2 per token, sigmoid gating with a random selection bias, renormalised,
    # routed scaling 2.5, 1 shared expert. scoring_func is stored so the converter writes
    # expert_gating_func (without it llama.cpp assumes softmax and HF V3, always sigmoid, disagrees).
    # transformers has no deepseek2 GGUF loader: the reference is the checkpoint with each file's
    # weights mapped back by this tool (deepseek_state_dict).
    "deepseek3": ArchSpec("deepseek3", "deepseek_v3", "qwen2", QWEN2_REGEX, False, None, False,
                          config=dict(hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                                      num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32,
                                      qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, n_shared_experts=1,
                                      num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                                      n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                                      scoring_func="sigmoid", tie_word_embeddings=False),
                          types=("F32", "Q8_0"), reference="deepseek"),
    # DeepSeek-V2-Lite-style: no q_lora (one q projection), softmax routing over 4 experts, 2 per
    # token, not renormalised, routed scaling 2.0, 2 shared experts, YaRN as V2-Lite's (mscale =
    # mscale_all_dim = 0.707) with factor 8 over an original context of 64, and a 100-token prompt.
    # Only 2 layers: llama.cpp would want 26 or 27 to accept a file without q_lora_rank, but the
    # reference here is transformers.
    "deepseek2": ArchSpec("deepseek2", "deepseek_v2", "qwen2", QWEN2_REGEX, False, None, False,
                          config=dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=32,
                                      qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=4, n_shared_experts=2,
                                      num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                                      n_group=1, topk_group=1, topk_method="greedy", norm_topk_prob=False,
                                      routed_scaling_factor=2.0, tie_word_embeddings=False,
                                      rope_parameters=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64,
                                                           mscale=0.707, mscale_all_dim=0.707, beta_fast=32.0,
                                                           beta_slow=1.0, rope_theta=10000.0)),
                          types=("F32", "Q8_0"), long_prompts=(100,), reference="deepseek"),
    # The hybrids (Gated DeltaNet + gated attention), 4 layers of which the 4th is full attention
    # (4 heads / 2 KV heads of 32, partial RoPE: 8 of 32 dims), the others Gated DeltaNet with 2
    # key heads and 4 value heads of 16 (r = 2: the value-to-key head mapping matters). --no-mtp:
    # the tiny checkpoints have no MTP layer. transformers has no GGUF loader for them: the
    # reference is the checkpoint with each file's weights mapped back (hybrid_state_dict).
    # qwen35: dense FFN 64, tied embeddings, a 100-token prompt (two chunks of the delta rule).
    "qwen35": ArchSpec("qwen35", "qwen3_5", "qwen2", QWEN2_REGEX, False, None, False,
                       config=dict(HYBRID_CONFIG, tie_word_embeddings=True), types=("F32", "Q8_0", "Q4_0"),
                       long_prompts=(100,), reference="hybrid", converter_args=("--no-mtp",)),
    # qwen35moe / qwen3next: 3 layers, 4 experts of width 32, 2 per token, and a shared expert of
    # width 48 behind its sigmoid gate; qwen3next (tied embeddings) keeps HF's grouped value heads
    # and one ssm_ba projection.
    "qwen35moe": ArchSpec("qwen35moe", "qwen3_5_moe", "qwen2", QWEN2_REGEX, False, None, False,
                          config=dict(HYBRID_CONFIG, **HYBRID_MOE, tie_word_embeddings=False), types=("F32", "Q8_0"),
                          reference="hybrid",
                          converter_args=("--no-mtp",), f32_tolerance=1e-5),
    "qwen3next": ArchSpec("qwen3next", "qwen3_next", "qwen2", QWEN2_REGEX, False, None, False,
                          config=dict(HYBRID_CONFIG, **HYBRID_MOE, norm_topk_prob=True, tie_word_embeddings=True),
                          types=("F32", "Q8_0"),
                          reference="hybrid", converter_args=("--no-mtp",), f32_tolerance=1e-5),
}


# --------------------------------------------------------------------------------------------
# llama.cpp source and libggml-base
# --------------------------------------------------------------------------------------------

def locate_llama_cpp(arg: Path | None, cache: Path) -> Path:
    """Return a llama.cpp source tree: --llama-cpp, or the sdist unpacked into the cache."""
    def has_converter(d: Path) -> bool:
        return (d / "convert_hf_to_gguf.py").is_file()

    if arg:
        if not has_converter(arg):
            sys.exit(f"--llama-cpp {arg}: no convert_hf_to_gguf.py there")
        return arg.resolve()
    unpacked = cache / SDIST_NAME.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    return unpacked.resolve() if has_converter(unpacked) else download_sdist(cache)


def download_sdist(cache: Path) -> Path:
    """Fetch llama-cpp-python's sdist from PyPI (JSON simple API), check its sha256, unpack it."""
    cache.mkdir(parents=True, exist_ok=True)
    req = urllib.request.Request(SDIST_INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        index = json.load(resp)
    entry = next(f for f in index["files"] if f["filename"] == SDIST_NAME)
    tarball = cache / SDIST_NAME
    print(f"downloading {entry['url']}")
    with urllib.request.urlopen(entry["url"], timeout=600) as resp:
        data = resp.read()
    if "sha256" in entry.get("hashes", {}) and hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
        sys.exit(f"{SDIST_NAME}: sha256 mismatch")
    tarball.write_bytes(data)
    with tarfile.open(tarball) as tf:
        tf.extractall(cache, filter="data")
    return (cache / SDIST_NAME.removesuffix(".tar.gz") / "vendor" / "llama.cpp").resolve()


def build_libggml_base(llama_cpp: Path, cache: Path) -> Path:
    """Build only the ggml-base target (CPU, shared) into the cache; it holds the reference quantizers.

    ggml's own CMakeLists wants ggml.pc.in when it is the top-level project, and the sdist lacks that
    file, so a two-line wrapper project pulls ggml in as a subdirectory instead.
    """
    build = cache / "ggml-build"
    lib = build / "ggml" / "src" / "libggml-base.so"
    if lib.is_file():
        return lib
    wrapper = cache / "ggml-wrapper"
    wrapper.mkdir(parents=True, exist_ok=True)
    (wrapper / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.14)\nproject(ggml_base_only C CXX)\n"
        f'add_subdirectory("{llama_cpp / "ggml"}" ggml)\n')
    print("building libggml-base (cmake) ...")
    run_logged(["cmake", "-S", str(wrapper), "-B", str(build), "-DBUILD_SHARED_LIBS=ON",
                "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_OPENMP=OFF",
                "-DGGML_BACKEND_DL=OFF", "-DGGML_CCACHE=OFF"], cache / "ggml-cmake.log")
    run_logged(["cmake", "--build", str(build), "--target", "ggml-base", f"-j{os.cpu_count() or 2}"],
               cache / "ggml-build.log")
    return lib


def run_logged(cmd: list[str], log: Path) -> None:
    """Run a command with its output in a log file; show the log's tail if it fails."""
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        sys.exit(f"command failed ({rc}): {' '.join(cmd)}\n--- {log} ---\n{log.read_text()[-4000:]}")


class GgmlQuantizer:
    """ggml's reference quantizer and dequantizer through ctypes (what llama-quantize calls, no imatrix)."""

    class _TypeTraits(ctypes.Structure):
        _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                    ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                    ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                    ("from_float_ref", ctypes.c_void_p)]

    _ToFloat = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)

    def __init__(self, lib_path: Path):
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p,
                                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                                 ctypes.POINTER(ctypes.c_float)]
        self.lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        self.lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        self.lib.ggml_row_size.restype = ctypes.c_size_t
        self.lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
        self.lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
        self.lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
        self.lib.ggml_get_type_traits.restype = ctypes.POINTER(self._TypeTraits)

    def quantize(self, rows: np.ndarray, qtype: int) -> np.ndarray:
        """Quantize float32 [n_rows, n_per_row] to uint8 [n_rows, row_bytes]."""
        assert not self.lib.ggml_quantize_requires_imatrix(qtype)
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        n_rows, n_per_row = rows.shape
        row_bytes = self.lib.ggml_row_size(qtype, n_per_row)
        out = np.zeros((n_rows, row_bytes), dtype=np.uint8)
        written = self.lib.ggml_quantize_chunk(qtype, rows.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                               out.ctypes.data, 0, n_rows, n_per_row, None)
        assert written == out.nbytes, (written, out.nbytes)
        return out

    def dequantize(self, blocks: np.ndarray, qtype: int, n_per_row: int) -> np.ndarray:
        """ggml's C dequantizer (type_traits.to_float), used to cross-check gguf-py's."""
        blocks = np.ascontiguousarray(blocks)
        out = np.zeros((blocks.shape[0], n_per_row), dtype=np.float32)
        to_float = self._ToFloat(self.lib.ggml_get_type_traits(qtype).contents.to_float)
        to_float(blocks.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.size)
        return out


# --------------------------------------------------------------------------------------------
# Tiny checkpoint: tokenizer + random model
# --------------------------------------------------------------------------------------------

def build_tokenizer(spec: ArchSpec):
    """Train a toy byte-level BPE whose pre-tokenizer is the regex llama.cpp uses for spec.pre."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(ignore_merges=spec.ignore_merges))
    # Split with the llama.cpp regex, then map bytes to GPT-2 unicode without a second regex
    # (the layout of Qwen2's and Llama-3's tokenizer.json).
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(spec.regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256 + N_MERGES, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TRAINING_TEXT], trainer)
    assert len(json.loads(tok.to_str())["model"]["merges"]) >= 1, "the GGUF needs tokenizer.ggml.merges"

    # Added tokens go after the learned vocab, as in real Qwen/Llama tokenizers. Special ones become
    # CONTROL in the GGUF; <think>/</think> are non-special (USER_DEFINED), like Qwen3's.
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + ([spec.bos_token] if spec.bos_token else [])
    tok.add_special_tokens(specials)
    tok.add_tokens(["<think>", "</think>"])
    if spec.add_bos:
        bos = spec.bos_token
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    assert tok.get_vocab_size() < VOCAB_SIZE
    return tok


def save_tokenizer(tok, spec: ArchSpec, ckpt: Path) -> None:
    """Save as a HF fast tokenizer with a ChatML template in tokenizer_config.json."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=spec.bos_token, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>")
    hf.save_pretrained(ckpt)
    # transformers 5 writes the template to chat_template.jinja; keep it in tokenizer_config.json
    # instead (the classic place, read by older transformers and by gguf-py's SpecialVocab alike).
    (ckpt / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = ckpt / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "add_bos_token": spec.add_bos,
        "add_eos_token": False,
        # llama.cpp cleans spaces on decode for llama-bpe but not for qwen2
        "clean_up_tokenization_spaces": spec.arch == "llama",
    })
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def build_model(spec: ArchSpec, ckpt: Path, seed: int):
    """Random tiny model with O(1) logits and non-trivial norm weights; saved next to the tokenizer."""
    import torch
    from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM,
                              LlamaConfig, LlamaForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM,
                              Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM)

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                             "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                             "qwen3moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
                             "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
                             "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
                             "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
                             "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM),
                             "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM)}[spec.arch]
    cfg = config_cls(**{**COMMON_CONFIG, **copy.deepcopy(spec.config)})  # the config may edit its dicts
    torch.manual_seed(seed)
    model = model_cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # RMSNorm weights: random around 1 so they are exercised
                p.copy_(1.0 + 0.25 * torch.randn_like(p))
            if name.endswith("dt_bias"):  # Gated DeltaNet's, ones at init: per head, so the head order shows
                p.copy_(torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's selection bias, zeros at init
                b.copy_(0.05 * (2 * torch.rand_like(b) - 1))
        # Halve the embeddings (std 0.05) relative to the blocks (std 0.1): when the token's own
        # embedding dominates the residual stream, a tied LM head makes greedy decoding repeat the
        # input token forever, which would test the KV cache poorly.
        model.get_input_embeddings().weight.mul_(0.5)
        if not cfg.tie_word_embeddings:
            model.get_output_embeddings().weight.mul_(0.5)
    model.save_pretrained(ckpt, safe_serialization=True)
    return model


# --------------------------------------------------------------------------------------------
# GGUF files
# --------------------------------------------------------------------------------------------

# Run llama.cpp's converter as __main__ with get_vocab_base_pre pinned to a fixed name: the toy
# BPE's hash of the check string matches no known model, so the converter would otherwise refuse.
CONVERTER_WRAPPER = """
import runpy, sys
llama_cpp, pre = sys.argv[1], sys.argv[2]
sys.path.insert(0, llama_cpp)
sys.path.insert(1, llama_cpp + "/gguf-py")  # the converter's own gguf-py, as it would use itself
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [llama_cpp + "/convert_hf_to_gguf.py"] + sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(llama_cpp: Path, ckpt: Path, spec: ArchSpec, outtype: str, outfile: Path, logdir: Path) -> None:
    cmd = [sys.executable, "-c", CONVERTER_WRAPPER, str(llama_cpp), spec.pre, str(ckpt),
           "--outtype", outtype, "--outfile", str(outfile), "--model-name", f"reflex-tiny-{spec.name}", *spec.converter_args]
    run_logged(cmd, logdir / f"convert-{spec.name}-{outtype}.log")


def requantize(src: Path, dst: Path, type_name: str, quantizer: GgmlQuantizer) -> None:
    """Copy src (an F32 GGUF) with every 2-D weight quantized to type_name; 1-D norms stay F32."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    reader = gguf.GGUFReader(src)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        # GGUF.* are the reader's virtual header fields; the writer adds general.architecture itself
        if field.name.startswith("GGUF.") or field.name == gguf.Keys.General.ARCHITECTURE:
            continue
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType[FILE_TYPE_NAMES[type_name]])
        vtype = field.types[0]
        writer.add_key_value(field.name, value, vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    for t in reader.tensors:
        data = np.asarray(t.data)
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        # matrices and stacked experts (3-D, quantized row by row); the MoE router and the
        # Gated DeltaNet conv (rows of 4) stay F32 as llama-quantize leaves them
        if data.ndim >= 2 and not t.name.endswith("ffn_gate_inp.weight") and "ssm_conv1d" not in t.name:
            assert data.shape[-1] % block_size == 0, (t.name, data.shape)
            rows = data.reshape(-1, data.shape[-1])
            blocks = quantizer.quantize(rows, qtype)
            # gguf-py is what transformers dequantizes with; it must agree bit for bit with ggml's C
            via_py = gguf.dequantize(blocks, qtype)
            via_c = quantizer.dequantize(blocks, qtype, data.shape[-1])
            assert np.array_equal(via_py.view(np.uint32), via_c.view(np.uint32)), f"{t.name}: gguf-py != ggml"
            if type_name in ("Q4_0", "Q4_1"):  # gguf-py's quantizer is documented byte-identical for these
                assert np.array_equal(gguf.quantize(rows, qtype), blocks), f"{t.name}: gguf-py quantize differs"
            writer.add_tensor(t.name, blocks.reshape(*data.shape[:-1], -1), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def check_readable(path: Path) -> dict:
    """Read a file back with gguf-py and dequantize every tensor; return a small description."""
    import gguf

    reader = gguf.GGUFReader(path)
    types = {}
    for t in reader.tensors:
        values = gguf.dequantize(t.data, t.tensor_type)
        assert np.isfinite(values).all(), f"{path.name}:{t.name} has non-finite values"
        types.setdefault(t.tensor_type.name, 0)
        types[t.tensor_type.name] += 1
    return {"tensors": len(reader.tensors), "types": types}


# --------------------------------------------------------------------------------------------
# References from transformers
# --------------------------------------------------------------------------------------------

def load_gguf_model(path: Path, **config_overrides):
    """transformers on the GGUF alone (config and weights from the file), float32, eager attention."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                attn_implementation="eager", **config_overrides).eval()


def load_checkpoint_with_gguf_weights(ckpt: Path, path: Path):
    """The HF checkpoint (its own config) with every weight replaced by the GGUF file's, dequantized by
    gguf-py and mapped back exactly as transformers' GGUF loader does (names, Q/K row un-permutation).
    Only tensors without an HF parameter may be left over (rope_freqs: the config computes those)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert not unexpected and set(missing) == tied, (path.name, missing, unexpected)
    return model


def _dequantized(reader) -> tuple[dict, Callable[[str], np.ndarray], set]:
    """A GGUF's tensors dequantized by gguf-py, in torch's axis order; take(name), which marks a
    tensor as mapped back; and the set of those taken, so the caller can check none is left."""
    import gguf

    t = {x.name: np.asarray(gguf.dequantize(x.data, x.tensor_type), np.float32).reshape([int(d) for d in reversed(x.shape)])
         for x in reader.tensors}
    used = set()

    def take(name):
        used.add(name)
        return t[name]

    return t, take, used


def deepseek_state_dict(path: Path, config) -> dict:
    """A deepseek2 GGUF's weights (gguf-py dequantization) under the names and layouts of
    transformers' DeepseekV2/V3 models: the converter's steps undone (kv_b_proj rebuilt from
    attn_k_b, stored transposed, and attn_v_b; stacked experts as fused gate_up_proj / down_proj)."""
    import gguf
    import torch

    t, take, used = _dequantized(gguf.GGUFReader(path))
    sd = {"model.embed_tokens.weight": take("token_embd.weight"), "model.norm.weight": take("output_norm.weight")}
    if "output.weight" in t:
        sd["lm_head.weight"] = take("output.weight")
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
             "attn_q_b": "self_attn.q_b_proj", "attn_q": "self_attn.q_proj",
             "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
             "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj"}
    for i in range(config.num_hidden_layers):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        for g, h in names.items():
            if b + g + ".weight" in t:
                sd[p + h + ".weight"] = take(b + g + ".weight")
        k_b, v_b = take(b + "attn_k_b.weight"), take(b + "attn_v_b.weight")  # (H, kv_lora, nope), (H, v, kv_lora)
        sd[p + "self_attn.kv_b_proj.weight"] = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])
        if b + "ffn_gate_exps.weight" in t:
            sd[p + "mlp.experts.gate_up_proj"] = np.concatenate([take(b + "ffn_gate_exps.weight"), take(b + "ffn_up_exps.weight")], axis=1)
            sd[p + "mlp.experts.down_proj"] = take(b + "ffn_down_exps.weight")
        if b + "exp_probs_b.bias" in t:
            sd[p + "mlp.gate.e_score_correction_bias"] = take(b + "exp_probs_b.bias")
    assert used == set(t), f"{path.name}: tensors not mapped back: {sorted(set(t) - used)}"
    return {k: torch.from_numpy(np.array(v)) for k, v in sd.items()}


def hybrid_state_dict(path: Path, config) -> dict:
    """A qwen35 / qwen35moe / qwen3next GGUF's weights (gguf-py dequantization) under the names and
    layouts of transformers' Qwen3_5 / Qwen3_5Moe / Qwen3Next models: the converter's steps undone
    (1 taken off the norm weights but the gated one's, A_log = log(-ssm_a), the conv's middle axis,
    qwen35's tiled value heads back to grouped order, qwen3next's qkvz fused per key head again)."""
    import gguf
    import torch

    reader = gguf.GGUFReader(path)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    t, take, used = _dequantized(reader)

    h_k, h_v = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv, r = config.linear_key_head_dim, config.linear_value_head_dim, h_v // h_k

    def grouped(x, axis, width):  # the converter's _reorder_v_heads inverted: (r, h_k, width) -> (h_k, r, width)
        if arch == "qwen3next":
            return x
        x = np.moveaxis(x, axis, 0)
        x = x.reshape(r, h_k, width, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
        return np.moveaxis(x, 0, axis)

    sd = {"model.embed_tokens.weight": take("token_embd.weight"), "model.norm.weight": take("output_norm.weight") - 1}
    if "output.weight" in t:
        sd["lm_head.weight"] = take("output.weight")
    for i in range(config.num_hidden_layers):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = take(b + "attn_norm.weight") - 1
        sd[p + "post_attention_layernorm.weight"] = take(b + "post_attention_norm.weight") - 1
        if config.layer_types[i] == "full_attention":
            for g, h in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
                sd[p + f"self_attn.{h}.weight"] = take(b + g + ".weight")
            sd[p + "self_attn.q_norm.weight"] = take(b + "attn_q_norm.weight") - 1
            sd[p + "self_attn.k_norm.weight"] = take(b + "attn_k_norm.weight") - 1
        else:
            la, n_qk = p + "linear_attn.", 2 * h_k * dk
            qkv, z = take(b + "attn_qkv.weight"), grouped(take(b + "attn_gate.weight"), 0, dv)
            v = grouped(qkv[n_qk:], 0, dv)
            conv = take(b + "ssm_conv1d.weight")  # (C, K)
            sd[la + "conv1d.weight"] = np.concatenate([conv[:n_qk], grouped(conv[n_qk:], 0, dv)])[:, None, :]
            sd[la + "A_log"] = np.log(-grouped(take(b + "ssm_a"), 0, 1))
            sd[la + "dt_bias"] = grouped(take(b + "ssm_dt.bias"), 0, 1)
            sd[la + "norm.weight"] = take(b + "ssm_norm.weight")
            sd[la + "out_proj.weight"] = grouped(take(b + "ssm_out.weight"), 1, dv)
            if arch == "qwen3next":  # per key head [q, k, v (r heads), z (r heads)]
                q, k = qkv[: h_k * dk].reshape(h_k, dk, -1), qkv[h_k * dk : n_qk].reshape(h_k, dk, -1)
                per_head = [q, k, v.reshape(h_k, r * dv, -1), z.reshape(h_k, r * dv, -1)]
                sd[la + "in_proj_qkvz.weight"] = np.concatenate(per_head, axis=1).reshape(-1, qkv.shape[1])
                sd[la + "in_proj_ba.weight"] = take(b + "ssm_ba.weight")
            else:
                sd[la + "in_proj_qkv.weight"] = np.concatenate([qkv[:n_qk], v])
                sd[la + "in_proj_z.weight"] = z
                sd[la + "in_proj_b.weight"] = grouped(take(b + "ssm_beta.weight"), 0, 1)
                sd[la + "in_proj_a.weight"] = grouped(take(b + "ssm_alpha.weight"), 0, 1)
        if b + "ffn_gate_exps.weight" in t:
            sd[p + "mlp.gate.weight"] = take(b + "ffn_gate_inp.weight")
            sd[p + "mlp.experts.gate_up_proj"] = np.concatenate([take(b + "ffn_gate_exps.weight"), take(b + "ffn_up_exps.weight")], axis=1)
            sd[p + "mlp.experts.down_proj"] = take(b + "ffn_down_exps.weight")
            for g in ("gate", "up", "down"):
                sd[p + f"mlp.shared_expert.{g}_proj.weight"] = take(b + f"ffn_{g}_shexp.weight")
            sd[p + "mlp.shared_expert_gate.weight"] = take(b + "ffn_gate_inp_shexp.weight")
        else:
            for g in ("gate", "up", "down"):
                sd[p + f"mlp.{g}_proj.weight"] = take(b + f"ffn_{g}.weight")
    assert used == set(t), f"{path.name}: tensors not mapped back: {sorted(set(t) - used)}"
    return {k: torch.from_numpy(np.array(v, np.float32)) for k, v in sd.items()}


def load_checkpoint_with_mapped_weights(ckpt: Path, path: Path, state_dict):
    """The HF checkpoint (its own config) with every weight replaced by the GGUF's, as
    state_dict(path, config) maps them back."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    missing, unexpected = model.load_state_dict(state_dict(path, model.config), strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert not unexpected and set(missing) == tied, (path.name, missing, unexpected)
    return model


def load_reference(spec: ArchSpec, path: Path, ckpt: Path):
    """The model whose outputs are the goldens for one GGUF file (see ArchSpec.reference)."""
    if spec.reference == "gguf":
        return load_gguf_model(path)
    if spec.reference == "deepseek":
        return load_checkpoint_with_mapped_weights(ckpt, path, deepseek_state_dict)
    if spec.reference == "hybrid":
        return load_checkpoint_with_mapped_weights(ckpt, path, hybrid_state_dict)
    assert spec.reference == "checkpoint", spec.reference
    return load_checkpoint_with_gguf_weights(ckpt, path)


def prompt_logits(model, prompt: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0].float().numpy()


def greedy(model, prompt: list[int], n_new: int) -> tuple[list[int], float]:
    """Greedy continuation with the HF KV cache; returns the ids and the smallest relative top-2 gap."""
    import torch

    new_ids: list[int] = []
    min_margin = float("inf")
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        for step in range(n_new):
            logits = out.logits[0, -1]
            top2 = torch.topk(logits, 2)
            gap = float(top2.values[0] - top2.values[1])
            min_margin = min(min_margin, gap / float(logits.max() - logits.min()))
            new_ids.append(int(top2.indices[0]))
            if step + 1 < n_new:
                out = model(input_ids=torch.tensor([[new_ids[-1]]]), cache=out.cache,
                            use_cache=True)
    # The cached loop must agree with one uncached pass over prompt + continuation.
    full = prompt_logits(model, prompt + new_ids[:-1])[len(prompt) - 1:]
    assert full.argmax(-1).tolist() == new_ids, "cached and uncached greedy disagree"
    return new_ids, min_margin


def select_greedy(model, candidates: list[list[int]]) -> list[tuple[list[int], list[int], float]]:
    """(prompt, continuation, min relative margin) for the first N_GREEDY_PROMPTS robust candidates."""
    chosen = []
    for cand in candidates:
        ids, margin = greedy(model, cand, GREEDY_NEW_TOKENS)
        if margin >= MIN_RELATIVE_MARGIN:
            chosen.append((cand, ids, margin))
            if len(chosen) == N_GREEDY_PROMPTS:
                return chosen
    sys.exit("not enough greedy candidates with a clear top-1 at every step; add candidates")


def check_llama3_rope(spec: ArchSpec, paths: dict[str, Path], models: dict, hf_model,
                      prompts: list[list[int]]) -> None:
    """Llama-3.1 RoPE scaling in the GGUF files against the HF checkpoint.

    1. The converter writes it as rope_freqs.weight (n_rot/2 factors; llama.cpp divides theta_i by
       them) and no rope.scaling keys; the factors must be HF's default inv_freq over its llama3
       inv_freq, and must bend the spectrum (some 1, some `factor`, some in between).
    2. transformers' GGUF loader is a second path to each file's weights. It maps rope.freq_base but
       not rope_freqs, so as loaded it runs unscaled RoPE (reported, on F32); given the checkpoint's
       rope_parameters it must reproduce each file's reference exactly.
    """
    import gguf
    import torch

    path = paths["F32"]
    reader = gguf.GGUFReader(path)
    rope = hf_model.config.rope_parameters
    head_dim = hf_model.config.head_dim
    factors = np.asarray(next(t.data for t in reader.tensors if t.name == "rope_freqs.weight"))
    assert factors.dtype == np.float32 and factors.shape == (head_dim // 2,), (factors.dtype, factors.shape)
    assert reader.get_field(f"{spec.arch}.rope.freq_base").contents() == rope["rope_theta"]
    assert reader.get_field(f"{spec.arch}.rope.dimension_count").contents() == head_dim
    assert not any(".rope.scaling." in name for name in reader.fields), "llama3 scaling should be rope_freqs only"
    # HF's default inv_freq exactly as modeling_rope_utils computes it, and the llama3 one in the model
    default = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    expected = (default / hf_model.model.rotary_emb.inv_freq).numpy()
    rel = float(np.abs(factors / expected - 1).max())
    assert rel <= 1e-6, f"rope_freqs != HF default/llama3 inv_freq (max rel diff {rel})"
    factor = rope["factor"]
    bent = (factors > 1) & (factors < factor)
    assert (factors == 1).any() and (factors == factor).any() and bent.any(), factors
    np.set_printoptions(precision=6, suppress=True, linewidth=120)
    print(f"rope_freqs.weight ({factors.size} factors; max rel diff to HF default/llama3 inv_freq {rel:.2g}): "
          f"{int((factors == 1).sum())} x 1, {int(bent.sum())} smoothed {factors[bent]}, "
          f"{int((factors == factor).sum())} x {factor:g}\n{factors}")

    plain = load_gguf_model(path)
    long = max(prompts, key=len)
    n_orig = rope["original_max_position_embeddings"]
    diff = np.abs(prompt_logits(plain, long) - prompt_logits(hf_model, long)).max(-1)
    print(f"transformers' GGUF loader: rope_parameters {plain.config.rope_parameters}; vs the checkpoint on a "
          f"{len(long)}-token prompt: max |logit diff| {diff[:n_orig].max():.3g} at positions < {n_orig}, "
          f"{diff[n_orig:].max():.3g} at positions >= {n_orig}")
    if plain.config.rope_parameters.get("rope_type") != "llama3":
        assert diff[n_orig:].max() > 0.01, "unscaled RoPE should give clearly different logits"
    for t, p in paths.items():
        fixed = load_gguf_model(p, rope_parameters=copy.deepcopy(rope))
        max_diff = max(float(np.abs(prompt_logits(fixed, q) - prompt_logits(models[t], q)).max()) for q in prompts)
        assert max_diff <= 1e-6, f"{p.name}: GGUF loader with the checkpoint's rope_parameters differs by {max_diff}"
        print(f"{p.name}: transformers' GGUF loader given the checkpoint's rope_parameters vs the reference: "
              f"max |logit diff| = {max_diff:.3g}")


def make_prompts(tokenizer, spec: ArchSpec, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Logits prompts (lengths 1..40, one from the real tokenizer, then spec.long_prompts) and greedy
    candidates in order of preference (spec.long_greedy, the logits prompts but the first, random ones)."""
    rng = np.random.default_rng(seed)
    n_tok = len(tokenizer)  # real token ids only; [PAD] rows are random too but never come from text

    def rand(n: int) -> list[int]:
        return rng.integers(0, n_tok, size=n).tolist()

    english = tokenizer.encode(ENGLISH_PROMPT)  # adds BOS where the tokenizer does (llama-bpe)
    prompts = [rand(1), english, rand(7), rand(16), rand(40)]
    extra_greedy = [rand(n) for n in rng.integers(2, 21, size=N_GREEDY_CANDIDATES)]
    # drawn last, so the variants without them keep the prompts above
    prompts += [rand(n) for n in spec.long_prompts]
    long_greedy = [rand(n) for n in spec.long_greedy]
    return prompts, long_greedy + prompts[1:] + extra_greedy


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez_compressed with fixed zip timestamps, so reruns produce identical bytes."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, arr in arrays.items():
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            with zf.open(info, "w") as f:
                np.lib.format.write_array(f, np.ascontiguousarray(arr), allow_pickle=False)


# --------------------------------------------------------------------------------------------
# Per-architecture pipeline
# --------------------------------------------------------------------------------------------

def make_arch(spec: ArchSpec, args, llama_cpp: Path, quantizer: GgmlQuantizer) -> list[dict]:
    from transformers import AutoTokenizer

    out_dir = args.out / spec.name
    ckpt = args.cache / "checkpoints" / f"reflex-tiny-{spec.name}"
    for d in (out_dir, ckpt):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)

    # 1-2. tokenizer + random model
    save_tokenizer(build_tokenizer(spec), spec, ckpt)
    hf_model = build_model(spec, ckpt, args.seed)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)

    # 3. GGUF files
    assert "F32" in spec.types and set(spec.types) <= set(ALL_TYPES), spec.types
    paths = {t: out_dir / f"{spec.name}-{t}.gguf" for t in ALL_TYPES if t in spec.types}
    for type_name, outtype in CONVERTER_TYPES.items():
        if type_name in paths:
            convert(llama_cpp, ckpt, spec, outtype, paths[type_name], args.cache)
    for type_name in GGML_QUANT_TYPES:
        if type_name in paths:
            requantize(paths["F32"], paths[type_name], type_name, quantizer)
    readable = {t: check_readable(p) for t, p in paths.items()}

    # 4. references
    prompts, greedy_candidates = make_prompts(tokenizer, spec, args.seed)
    models = {t: load_reference(spec, p, ckpt) for t, p in paths.items()}
    if hf_model.config.rope_parameters.get("rope_type") == "llama3":
        check_llama3_rope(spec, paths, models, hf_model, prompts)

    # The F32 GGUF must reproduce the HF checkpoint (conversion is lossless; the llama Q/K row
    # permutation is undone by transformers' loader).
    max_diff = 0.0
    for p in prompts:
        ref = prompt_logits(hf_model, p)
        max_diff = max(max_diff, float(np.abs(prompt_logits(models["F32"], p) - ref).max()))
        assert ref.max() - ref.min() > 1.0, f"{spec.name}: logits too flat ({ref.min()}..{ref.max()})"
    assert max_diff <= spec.f32_tolerance, f"{spec.name}: F32 GGUF differs from the HF checkpoint by {max_diff}"
    print(f"F32 GGUF vs HF checkpoint: max |logit diff| = {max_diff:.3g}")

    # Greedy prompts, chosen per file: the first candidates whose continuation has a clear top-1 at
    # every step in that file. (A random model's top-2 gaps are often tiny; asking one prompt to be
    # robust in all nine files at once rejects almost every candidate for qwen3.)
    greedy_out = {t: select_greedy(m, greedy_candidates) for t, m in models.items()}

    summary = []
    for t, model in models.items():
        arrays = {}
        lo, hi = np.inf, -np.inf
        for i, p in enumerate(prompts):
            logits = prompt_logits(model, p).astype(np.float32)
            arrays[f"prompt_{i}"] = np.asarray(p, dtype=np.int32)
            arrays[f"logits_{i}"] = logits
            lo, hi = min(lo, logits.min()), max(hi, logits.max())
        for j, (gp, ids, _) in enumerate(greedy_out[t]):
            arrays[f"greedy_prompt_{j}"] = np.asarray(gp, dtype=np.int32)
            arrays[f"greedy_{j}"] = np.asarray(ids, dtype=np.int32)
        write_npz(out_dir / f"goldens-{t}.npz", arrays)
        summary.append({"file": f"{spec.name}/{paths[t].name}", "bytes": paths[t].stat().st_size,
                        "logit_min": float(lo), "logit_max": float(hi),
                        "min_greedy_margin": min(m for _, _, m in greedy_out[t]), **readable[t]})

    # Tokenizer ids from HF, for checking a GGUF tokenizer built from the same vocab.
    cases = [{"text": s, "ids": tokenizer.encode(s, add_special_tokens=False),
              "ids_with_special": tokenizer.encode(s, add_special_tokens=True)} for s in TOKENIZER_CHECK_STRINGS]
    header = {"pre": spec.pre, "add_bos": spec.add_bos,
              "note": "ids: HF encode(add_special_tokens=False), special tokens in the text are parsed; "
                      "ids_with_special: plus what the tokenizer adds itself (BOS for llama-bpe)"}
    body = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in cases)  # one case per line
    (out_dir / "tokenizer-check.json").write_text(json.dumps(header, ensure_ascii=False)[:-1]
                                                  + ', "cases": [\n' + body + "\n]}\n")
    return summary


def write_readme(out: Path) -> None:
    import gguf
    import tokenizers
    import torch
    import transformers

    gguf_version = getattr(gguf, "__version__", None)
    if gguf_version is None:
        from importlib.metadata import version
        gguf_version = version("gguf")
    (out / "README.md").write_text(f"""\
# Golden fixtures for the CPU forward pass

Generated by `tools/make_goldens.py`; do not edit by hand. Regenerate (needs torch, so not in CI) with:

    pip install -e '.[goldens]'
    python tools/make_goldens.py                # all variants
    python tools/make_goldens.py --arch llama3  # one variant; the others' files are left alone

Per architecture (`llama`: tied output, 4 heads / 2 KV heads, head_dim 64; `qwen3`: separate
`output.weight`, 2 heads / 1 KV head, head_dim 128, q/k norms), a tiny random model (hidden 256,
FFN 256, 2 layers, vocab {VOCAB_SIZE}, rope_theta 10000, rms eps 1e-6, block weights std 0.1, embeddings
std 0.05, random RMSNorm weights around 1)
with a toy byte-level BPE tokenizer (tokenizer.ggml.pre `llama-bpe` / `qwen2`):

- `<arch>/<arch>-<TYPE>.gguf`, TYPE in {", ".join(ALL_TYPES)}. F32/F16/BF16/Q8_0 are written by
  llama.cpp's `convert_hf_to_gguf.py`; the others quantize every 2-D weight of the F32 file with
  ggml's reference quantizer (`ggml_quantize_chunk`, no imatrix), norms stay F32.
- `<arch>/goldens-<TYPE>.npz`: `prompt_i` (int32 ids) and `logits_i` (float32 [T, vocab], every
  position); `greedy_prompt_j` and `greedy_j` ({GREEDY_NEW_TOKENS} greedy new ids; EOS and [PAD] ids are
  not special-cased). The reference is transformers run on that file's own weights (dequantized by
  gguf-py, checked bit-identical to ggml's C dequantizers), float32, eager attention. Greedy prompts
  are chosen per file, so read them from each npz: the first candidates whose every step has a
  top-1/top-2 gap of at least {MIN_RELATIVE_MARGIN:g} of that step's logit range.
- `<arch>/tokenizer-check.json`: strings and the ids HF's tokenizer gives for them.

Variant `llama3` (GGUF architecture `llama`, same tokenizer as `llama`): Llama-3.1 RoPE scaling,
HF `rope_parameters` {json.dumps(LLAMA3_ROPE)} with rope_theta 500000 and
max_position_embeddings 512. The small original context makes the correction bend the head's
frequencies: of the 32 pairs (head_dim 64), 0-2 keep factor 1, 3-5 are smoothed, 6-31 get 8.
llama.cpp's converter writes this as the F32 tensor `rope_freqs.weight` (32 values; llama.cpp divides
theta_i by rope_freqs[i]) and no `rope.scaling.*` keys; the tool checks the factors equal HF's default
inv_freq over its llama3 inv_freq. Smaller model: hidden 128, FFN 128, 2 heads / 1 KV head of head_dim
64, tied output, 2 layers. Only `llama3-F32.gguf` and `llama3-Q8_0.gguf` (converter outputs). Logits
prompts are the usual five plus a {ARCHS["llama3"].long_prompts[0]}-token one (prompt_5); random greedy candidates
of {min(ARCHS["llama3"].long_greedy)} to {max(ARCHS["llama3"].long_greedy)} tokens are tried first, so greedy runs far past position 64. Reference:
transformers' GGUF loader ignores `rope_freqs` (it would run unscaled RoPE), so the reference is the
HF checkpoint itself with its weights replaced by the file's (gguf-py dequantization, Q/K rows
un-permuted as that loader does); for F32 these are exactly the checkpoint's weights.

Variant `qwen3moe` (GGUF architecture `qwen3moe`, tokenizer as `qwen3`): Qwen3-MoE, hidden 64,
2 heads / 1 KV head of head_dim 32 with q/k norms, 2 layers, every FFN a router over 8 experts of
width 32 with 2 chosen per token, `norm_topk_prob=True` (llama.cpp always renormalises the chosen
weights; the converter writes no key for it), separate `output.weight`. The converter stacks the
experts into `ffn_{{gate,up,down}}_exps` (3-D). Files: F32, F16, Q8_0 (converter) and Q4_0
(every matrix and stacked expert quantized row by row, the router `ffn_gate_inp` left F32 as
llama-quantize leaves it); the rows of 32 and 64 fit no 256-value K-quant block. Reference: the
checkpoint with each file's weights (transformers' GGUF loader assumes an expert width of 768).

Variants `deepseek3` and `deepseek2` (GGUF architecture `deepseek2`, tokenizer as `qwen3`):
multi-head latent attention, hidden 64, 2 heads of qk_nope 32 + qk_rope 16 and v_head 32,
kv_lora_rank 32, separate `output.weight`; the converter splits `kv_b_proj` into `attn_k_b`
(transposed) and `attn_v_b`. `deepseek3` (DeepseekV3ForCausalLM): q_lora_rank 32, 3 layers (1
dense, 2 MoE), 8 experts in 2 groups of which 1 is kept, 2 per token, sigmoid gating with a
random selection bias (`exp_probs_b.bias`), renormalised, routed scaling 2.5, 1 shared expert;
F32, Q8_0. `deepseek2` (DeepseekV2ForCausalLM, V2-Lite-style): no q_lora (one `attn_q`),
2 layers (1 dense, 1 MoE), 4 experts, 2 per token, softmax, not renormalised, routed scaling 2.0,
2 shared experts, YaRN factor 8 over an original context of 64 with mscale = mscale_all_dim =
0.707, and a 100-token logits prompt (prompt_5); F32, Q8_0. transformers has no deepseek2 GGUF
loader, so the reference is the checkpoint with each file's weights mapped back by the tool
(gguf-py dequantization; `kv_b_proj` rebuilt from `attn_k_b` and `attn_v_b`, experts restacked);
for F32 that reproduces the checkpoint exactly.

Variants `qwen35`, `qwen35moe` and `qwen3next` (the GGUF architectures of those names; tokenizer
as `qwen3`): the Gated DeltaNet / gated attention hybrids (Qwen3_5ForCausalLM,
Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM), converted with `--no-mtp`. Hidden 64, qwen35 4 layers:
layers 0-2 Gated DeltaNet (2 key heads and 4 value heads of 16, conv kernel 4, random dt_bias),
layer 3 gated full attention (4 heads / 2 KV heads of 32, q/k norms, RoPE on 8 of the 32 dims,
sigmoid output gate). `qwen35`: dense FFN 64, tied embeddings, F32, Q8_0 and Q4_0 (the conv
`ssm_conv1d` stays F32 as llama-quantize leaves it), a 100-token logits prompt (prompt_5: two
chunks of the chunked delta rule). `qwen35moe` and `qwen3next`: 4 experts of width 32, 2 per
token, renormalised, a shared expert of width 48 behind its sigmoid gate, 3 layers (2 Gated
DeltaNet, then attention, as `attention.recurrent_layers` says); qwen3next's embeddings tied;
F32 and Q8_0.
The converter writes qwen35's value heads in tiled order (value head h reads key head h mod 2)
and keeps qwen3next's grouped (h // 2), with one `ssm_ba` projection. transformers has no GGUF
loader for these, so the reference is the checkpoint with each file's weights mapped back by the
tool (hybrid_state_dict: 1 off the norm weights but `ssm_norm`, A_log = log(-ssm_a), value heads
regrouped, qwen3next's in_proj_qkvz fused per key head again); for F32 every weight comes back
bit for bit, the norms' 1 + w too (w itself within an ulp). This model's float32 logits are noisier than the others': both
transformers and Reflex are 3e-7 to 2e-5 of the range from a float64 run of the checkpoint.

Versions: torch {torch.__version__}, transformers {transformers.__version__}, tokenizers
{tokenizers.__version__}, gguf (gguf-py) {gguf_version}, numpy {np.__version__}; llama.cpp {LLAMA_CPP_COMMIT}
as vendored in the `{SDIST_NAME}` sdist (converter, ggml).
""")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output dir (default: tests/goldens)")
    ap.add_argument("--llama-cpp", type=Path, default=None,
                    help="llama.cpp source tree (default: the llama-cpp-python sdist from PyPI, unpacked into the cache)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                    help="work dir for checkpoints, logs, the sdist and libggml-base (outside the repo)")
    ap.add_argument("--arch", choices=list(ARCHS), action="append", help="only these (default: all)")
    ap.add_argument("--seed", type=int, default=SEED)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    args.out, args.cache = args.out.resolve(), args.cache.resolve()
    args.cache.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loader has its own tqdm bars
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.use_deterministic_algorithms(True)

    llama_cpp = locate_llama_cpp(args.llama_cpp, args.cache)
    quantizer = GgmlQuantizer(build_libggml_base(llama_cpp, args.cache))
    print(f"llama.cpp: {llama_cpp}\ntorch {torch.__version__}, transformers {transformers.__version__}")

    summary = []
    for name in args.arch or list(ARCHS):
        print(f"== {name}")
        summary += make_arch(ARCHS[name], args, llama_cpp, quantizer)
    write_readme(args.out)

    print(f"\n{'file':28} {'bytes':>9} {'logit range':>18} {'min greedy margin':>18}  tensor types")
    for s in summary:
        print(f"{s['file']:28} {s['bytes']:9d} {s['logit_min']:8.3f}..{s['logit_max']:<8.3f} "
              f"{s['min_greedy_margin']:18.4f}  {s['types']}")
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"total under {args.out}: {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
