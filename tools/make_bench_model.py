"""A Qwen3-0.6B-, 8B- or Qwen3-30B-A3B-shaped (MoE) GGUF of random weights, for timing only.

    python tools/make_bench_model.py VOCAB.gguf OUT.gguf [--shape 0.6b|8b|30b-a3b] [--quant q4_k_m|q8_0]

The tokenizer (and its metadata) is copied from VOCAB.gguf, a real Qwen vocabulary such as
llama.cpp's models/ggml-vocab-qwen2.gguf, so prompts tokenize as they would. Weights are
random blocks in a Q4_K_M-like mix (Q6_K for the tied embeddings or the LM head and for
attn_v/ffn_down in a third of the layers, Q4_K elsewhere), or Q8_0 for every matrix, with small
valid f16 scales so activations stay finite; no quantizer is needed. Needs numpy and gguf-py
(not the engine).
"""
from __future__ import annotations

import argparse

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter

SHAPES = {  # layers, embedding, FFN (an expert's, for MoE), heads, KV heads, head width, own LM head (not tied)
    "0.6b": (28, 1024, 3072, 16, 8, 128, False),
    "8b": (36, 4096, 12288, 32, 8, 128, True),
    "30b-a3b": (48, 2048, 768, 32, 4, 128, True),
}
EXPERTS = {"30b-a3b": (128, 8)}  # experts, chosen per token
BLOCK = {T.Q4_K: (256, 144, (0, 2)), T.Q6_K: (256, 210, (208,)), T.Q8_0: (32, 34, (0,))}  # elements, bytes, f16 scale offsets


def random_blocks(rng, qtype, n_rows: int, n_cols: int) -> np.ndarray:
    block, size, scales = BLOCK[qtype]
    blocks = rng.integers(0, 256, (n_rows * n_cols // block, size), dtype=np.uint8)
    for at in scales:
        blocks[:, at : at + 2] = rng.uniform(2e-4, 1e-3, len(blocks)).astype("<f2").view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n_rows, n_cols // block * size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("vocab")
    ap.add_argument("out")
    ap.add_argument("--shape", choices=SHAPES, default="0.6b")
    ap.add_argument("--quant", choices=("q4_k_m", "q8_0"), default="q4_k_m")
    args = ap.parse_args()
    n_layers, e, f, h, hkv, d, lm_head = SHAPES[args.shape]
    n_expert, n_used = EXPERTS.get(args.shape, (0, 0))
    arch = "qwen3moe" if n_expert else "qwen3"
    vocab = GGUFReader(args.vocab)
    n_vocab = len(vocab.fields["tokenizer.ggml.tokens"].data)
    w = GGUFWriter(args.out, arch)
    for key, field in vocab.fields.items():
        if key.startswith("tokenizer."):
            value = field.contents()
            if field.types[0] == 9:
                w.add_array(key, value)
            else:
                w.add_key_value(key, value, field.types[0])
    w.add_name(f"random Qwen3-{args.shape} shape {args.quant.upper()}")
    w.add_block_count(n_layers)
    w.add_context_length(40960)
    w.add_embedding_length(e)
    if n_expert:
        w.add_feed_forward_length(6144)  # the dense FFN Qwen3-30B-A3B declares; no layer has one
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_used)
        w.add_expert_feed_forward_length(f)
    else:
        w.add_feed_forward_length(f)
    w.add_head_count(h)
    w.add_head_count_kv(hkv)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    rng = np.random.default_rng(0)

    def quant(name, qtype, n_rows, n_cols, n_stacked=1):
        qtype = T.Q8_0 if args.quant == "q8_0" else qtype  # llama.cpp's Q8_0: every matrix
        blocks = random_blocks(rng, qtype, n_stacked * n_rows, n_cols)
        w.add_tensor(name, blocks.reshape(n_stacked, n_rows, -1) if n_stacked > 1 else blocks, raw_dtype=qtype)

    def norm(name, n):
        w.add_tensor(name, rng.uniform(0.8, 1.2, n).astype(np.float32))

    quant("token_embd.weight", T.Q4_K if lm_head else T.Q6_K, n_vocab, e)  # as llama.cpp's Q4_K_M
    if lm_head:
        quant("output.weight", T.Q6_K, n_vocab, e)
    norm("output_norm.weight", e)
    for i in range(n_layers):
        more_bits = i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2  # as llama.cpp's Q4_K_M
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", e)
        norm(p + "ffn_norm.weight", e)
        norm(p + "attn_q_norm.weight", d)
        norm(p + "attn_k_norm.weight", d)
        quant(p + "attn_q.weight", T.Q4_K, h * d, e)
        quant(p + "attn_k.weight", T.Q4_K, hkv * d, e)
        quant(p + "attn_v.weight", T.Q6_K if more_bits else T.Q4_K, hkv * d, e)
        quant(p + "attn_output.weight", T.Q4_K, e, h * d)
        if n_expert:
            w.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((n_expert, e)).astype(np.float32))
            quant(p + "ffn_gate_exps.weight", T.Q4_K, f, e, n_expert)
            quant(p + "ffn_up_exps.weight", T.Q4_K, f, e, n_expert)
            quant(p + "ffn_down_exps.weight", T.Q6_K if more_bits else T.Q4_K, e, f, n_expert)
        else:
            quant(p + "ffn_gate.weight", T.Q4_K, f, e)
            quant(p + "ffn_up.weight", T.Q4_K, f, e)
            quant(p + "ffn_down.weight", T.Q6_K if more_bits else T.Q4_K, e, f)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {args.out}: {arch} {args.shape} shape, {args.quant.upper()}, {n_vocab} tokens")


if __name__ == "__main__":
    main()
