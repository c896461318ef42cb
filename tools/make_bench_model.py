"""A GGUF of random weights shaped like a real model, for timing only: Qwen3-0.6B or 8B (qwen3),
Qwen3-30B-A3B (qwen3moe), DeepSeek-V2-Lite (deepseek2: MLA, 64 experts) or Qwen3.5-0.8B (qwen35:
Gated DeltaNet layers with gated full attention every 4th).

    python tools/make_bench_model.py VOCAB.gguf OUT.gguf [--shape 0.6b|8b|30b-a3b|dsv2-lite|qwen35-0.8b]
        [--quant q4_k_m|q8_0] [--layers N]

The tokenizer (and its metadata) is copied from VOCAB.gguf, a real Qwen vocabulary such as
llama.cpp's models/ggml-vocab-qwen2.gguf, so prompts tokenize as they would; qwen35-0.8b pads it
to Qwen3.5's 248,320 rows with inert "[PADn]" tokens, dsv2-lite keeps its 151,936 (DeepSeek's is
102,400). Weights are random blocks in llama-quantize's Q4_K_M mix (Q6_K for tied embeddings or
the LM head and for attn_v / attn_qkv / ffn_down in a third of the layers, Q4_K elsewhere, Q5_0 and
Q8_0 where a row is not a multiple of 256), or Q8_0 for every matrix, with small valid f16 scales
so activations stay finite; no quantizer is needed. Tensors are written one at a time, so memory
stays small. --layers N keeps the shape's widths with fewer layers, for quick load tests. Needs
numpy and gguf-py (not the engine).

Shapes: Qwen3 from the Qwen/Qwen3-* config.json files; DeepSeek-V2-Lite from
deepseek-ai/DeepSeek-V2-Lite's config.json (27 layers, q_lora none, kv_lora 512, qk 128 + 64 RoPE,
v 128, 64 experts of 1408 with 6 chosen by softmax, 2 shared, 1 leading dense layer of 10944,
YaRN factor 40 over 4096 with mscale_all_dim 0.707), keys as llama.cpp's convert_hf_to_gguf.py
writes them (attn_k_b / attn_v_b split); Qwen3.5-0.8B from Qwen/Qwen3.5-0.8B's config.json
(text_config: 24 layers, 1024 wide, FFN 3584, 8 heads of 256 over 2 KV heads, 25% RoPE of base
1e7 in sections [11, 11, 10], 16 key and 16 value heads of 128, conv 4, tied embeddings), as the
converter writes it with --no-mtp.
"""
from __future__ import annotations

import argparse

import numpy as np
from gguf import ExpertGatingFuncType, GGUFReader, GGUFWriter, RopeScalingType
from gguf import GGMLQuantizationType as T

SHAPES = {  # layers, embedding, FFN (an expert's, for MoE), heads, KV heads, head width, own LM head (not tied)
    "0.6b": (28, 1024, 3072, 16, 8, 128, False),
    "8b": (36, 4096, 12288, 32, 8, 128, True),
    "30b-a3b": (48, 2048, 768, 32, 4, 128, True),
}
EXPERTS = {"30b-a3b": (128, 8)}  # experts, chosen per token
DSV2_LITE = dict(n_layers=27, n_embd=2048, n_ff=10944, n_heads=16, kv_lora=512, qk_nope=128, qk_rope=64, v_head=128,
                 n_expert=64, n_used=6, n_shared=2, n_ff_exp=1408, n_dense=1, n_ctx=163840, rope_base=10000.0,
                 yarn_factor=40.0, yarn_ctx=4096, mscale_all_dim=0.707)
QWEN35_0_8B = dict(n_layers=24, n_embd=1024, n_ff=3584, n_heads=8, n_kv_heads=2, head_dim=256, n_rot=64,
                   sections=[11, 11, 10, 0], rope_base=1e7, n_ctx=262144, interval=4, k_heads=16, v_heads=16,
                   k_dim=128, v_dim=128, conv=4, n_vocab=248320)
BLOCK = {T.Q4_K: (256, 144, (0, 2)), T.Q6_K: (256, 210, (208,)), T.Q5_0: (32, 22, (0,)),
         T.Q8_0: (32, 34, (0,))}  # elements, bytes, f16 scale offsets
FALLBACK = {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0}  # llama-quantize's type where a row is not a multiple of 256


def random_blocks(rng, qtype, n_rows: int, n_cols: int) -> np.ndarray:
    block, size, scales = BLOCK[qtype]
    blocks = rng.integers(0, 256, (n_rows * n_cols // block, size), dtype=np.uint8)
    for at in scales:
        blocks[:, at : at + 2] = rng.uniform(2e-4, 1e-3, len(blocks)).astype("<f2").view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n_rows, n_cols // block * size)


def more_bits(i: int, n_layers: int) -> bool:  # llama-quantize's use_more_bits: Q6_K layers of Q4_K_M
    return i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2


class Tensors:
    """Tensors declared in order (name, type, shape), then made and written one at a time."""

    def __init__(self, q8_0: bool):
        self.q8_0 = q8_0
        self.todo = []  # (name, byte shape, numpy dtype, ggml type or None, make(rng))

    def quant(self, name, qtype, n_rows, n_cols, n_stacked=1):
        """n_stacked matrices of n_rows x n_cols (ggml ne {n_cols, n_rows, n_stacked})."""
        qtype = T.Q8_0 if self.q8_0 else FALLBACK.get(qtype, qtype) if n_cols % 256 else qtype
        block, size, _ = BLOCK[qtype]
        shape = (n_stacked, n_rows, n_cols // block * size) if n_stacked > 1 else (n_rows, n_cols // block * size)
        self.todo.append((name, shape, np.uint8, qtype,
                          lambda rng: random_blocks(rng, qtype, n_stacked * n_rows, n_cols).reshape(shape)))

    def f32(self, name, shape, make):
        self.todo.append((name, shape, np.float32, None, lambda rng: make(rng).astype(np.float32)))

    def norm(self, name, n):
        self.f32(name, (n,), lambda rng: rng.uniform(0.8, 1.2, n))

    def model_tensors(self, n_vocab, e, lm_head: bool):
        """The embedding table, the LM head where it is not tied to it, the final norm: as llama.cpp's
        Q4_K_M makes them (a tied table is the head, Q6_K)."""
        self.quant("token_embd.weight", T.Q4_K if lm_head else T.Q6_K, n_vocab, e)
        if lm_head:
            self.quant("output.weight", T.Q6_K, n_vocab, e)
        self.norm("output_norm.weight", e)

    def write(self, w: GGUFWriter, rng) -> None:
        for name, shape, dtype, qtype, _ in self.todo:
            w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for _, shape, _, _, make in self.todo:
            w.write_tensor_data(make(rng))


def qwen3(w, t, shape, n_layers, n_vocab):
    _, e, f, h, hkv, d, lm_head = SHAPES[shape]
    n_expert, n_used = EXPERTS.get(shape, (0, 0))
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
    t.model_tensors(n_vocab, e, lm_head)
    for i in range(n_layers):
        more = more_bits(i, n_layers)
        p = f"blk.{i}."
        t.norm(p + "attn_norm.weight", e)
        t.norm(p + "ffn_norm.weight", e)
        t.norm(p + "attn_q_norm.weight", d)
        t.norm(p + "attn_k_norm.weight", d)
        t.quant(p + "attn_q.weight", T.Q4_K, h * d, e)
        t.quant(p + "attn_k.weight", T.Q4_K, hkv * d, e)
        t.quant(p + "attn_v.weight", T.Q6_K if more else T.Q4_K, hkv * d, e)
        t.quant(p + "attn_output.weight", T.Q4_K, e, h * d)
        if n_expert:
            t.f32(p + "ffn_gate_inp.weight", (n_expert, e), lambda rng: rng.standard_normal((n_expert, e)))
            t.quant(p + "ffn_gate_exps.weight", T.Q4_K, f, e, n_expert)
            t.quant(p + "ffn_up_exps.weight", T.Q4_K, f, e, n_expert)
            t.quant(p + "ffn_down_exps.weight", T.Q6_K if more else T.Q4_K, e, f, n_expert)
        else:
            t.quant(p + "ffn_gate.weight", T.Q4_K, f, e)
            t.quant(p + "ffn_up.weight", T.Q4_K, f, e)
            t.quant(p + "ffn_down.weight", T.Q6_K if more else T.Q4_K, e, f)


def deepseek2(w, t, shape, n_layers, n_vocab):
    c = DSV2_LITE
    e, h, kv, nope, rope, v = c["n_embd"], c["n_heads"], c["kv_lora"], c["qk_nope"], c["qk_rope"], c["v_head"]
    n_expert, f_exp, f_sh, n_dense = c["n_expert"], c["n_ff_exp"], c["n_ff_exp"] * c["n_shared"], min(c["n_dense"], n_layers)
    w.add_block_count(n_layers)
    w.add_context_length(c["n_ctx"])
    w.add_embedding_length(e)
    w.add_feed_forward_length(c["n_ff"])
    w.add_head_count(h)
    w.add_head_count_kv(1)  # MLA as MQA over the latent
    w.add_rope_freq_base(c["rope_base"])
    w.add_rope_scaling_type(RopeScalingType.YARN)
    w.add_rope_scaling_factor(c["yarn_factor"])
    w.add_rope_scaling_orig_ctx_len(c["yarn_ctx"])
    w.add_rope_scaling_yarn_beta_fast(32.0)
    w.add_rope_scaling_yarn_beta_slow(1.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(c["n_used"])
    w.add_expert_group_count(1)
    w.add_expert_group_used_count(1)
    w.add_expert_gating_func(ExpertGatingFuncType.SOFTMAX)
    w.add_leading_dense_block_count(n_dense)
    w.add_vocab_size(n_vocab)
    if n_layers not in (26, 27):  # llama.cpp reads q_lora_rank as optional only at V2-Lite's depths; 0: one attn_q
        w.add_q_lora_rank(0)
    w.add_kv_lora_rank(kv)
    w.add_key_length(kv + rope)
    w.add_value_length(kv)
    w.add_key_length_mla(nope + rope)
    w.add_value_length_mla(v)
    w.add_expert_feed_forward_length(f_exp)
    w.add_expert_shared_count(c["n_shared"])
    w.add_expert_weights_scale(1.0)  # routed_scaling_factor; norm_topk_prob false: no expert_weights_norm
    w.add_rope_dimension_count(rope)
    w.add_rope_scaling_yarn_log_mul(0.1 * c["mscale_all_dim"])  # the converter's 0.1 x, undone by the loaders
    t.model_tensors(n_vocab, e, lm_head=True)
    for i in range(n_layers):
        more = more_bits(i, n_layers)
        p = f"blk.{i}."
        t.norm(p + "attn_norm.weight", e)
        t.quant(p + "attn_q.weight", T.Q4_K, h * (nope + rope), e)
        t.quant(p + "attn_kv_a_mqa.weight", T.Q4_K, kv + rope, e)
        t.norm(p + "attn_kv_a_norm.weight", kv)
        t.quant(p + "attn_k_b.weight", T.Q4_K, kv, nope, h)  # {qk_nope, kv_lora, H}: Q5_0 in Q4_K_M
        t.quant(p + "attn_v_b.weight", T.Q4_K, v, kv, h)  # {kv_lora, v_head, H}
        t.quant(p + "attn_output.weight", T.Q4_K, e, h * v)
        t.norm(p + "ffn_norm.weight", e)
        if i < n_dense:
            t.quant(p + "ffn_gate.weight", T.Q4_K, c["n_ff"], e)
            t.quant(p + "ffn_up.weight", T.Q4_K, c["n_ff"], e)
            t.quant(p + "ffn_down.weight", T.Q6_K if more else T.Q4_K, e, c["n_ff"])  # 10944 columns: Q8_0 / Q5_0
            continue
        t.f32(p + "ffn_gate_inp.weight", (n_expert, e), lambda rng: rng.standard_normal((n_expert, e)))
        t.quant(p + "ffn_gate_exps.weight", T.Q4_K, f_exp, e, n_expert)
        t.quant(p + "ffn_up_exps.weight", T.Q4_K, f_exp, e, n_expert)
        t.quant(p + "ffn_down_exps.weight", T.Q6_K if more else T.Q4_K, e, f_exp, n_expert)  # 1408 columns: Q8_0 / Q5_0
        t.quant(p + "ffn_gate_shexp.weight", T.Q4_K, f_sh, e)
        t.quant(p + "ffn_up_shexp.weight", T.Q4_K, f_sh, e)
        t.quant(p + "ffn_down_shexp.weight", T.Q6_K if more else T.Q4_K, e, f_sh)


def qwen35(w, t, shape, n_layers, n_vocab):
    c = QWEN35_0_8B
    e, f, h, hkv, d = c["n_embd"], c["n_ff"], c["n_heads"], c["n_kv_heads"], c["head_dim"]
    hk, hv, dk, dv, conv = c["k_heads"], c["v_heads"], c["k_dim"], c["v_dim"], c["conv"]
    channels = 2 * hk * dk + hv * dv  # q, k and v of every head
    recurrent = [(i + 1) % c["interval"] != 0 for i in range(n_layers)]
    w.add_block_count(n_layers)
    w.add_context_length(c["n_ctx"])
    w.add_embedding_length(e)
    w.add_feed_forward_length(f)
    w.add_head_count(h)
    w.add_head_count_kv(hkv)
    w.add_rope_freq_base(c["rope_base"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_ssm_conv_kernel(conv)
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(hk)
    w.add_ssm_time_step_rank(hv)
    w.add_ssm_inner_size(hv * dv)
    w.add_array("qwen35.attention.recurrent_layers", recurrent)  # the converter's, from layer_types (no gguf 0.19 helper)
    w.add_full_attention_interval(c["interval"])
    w.add_rope_dimension_count(c["n_rot"])
    w.add_rope_dimension_sections(c["sections"])
    t.model_tensors(n_vocab, e, lm_head=False)
    for i in range(n_layers):
        more = more_bits(i, n_layers)
        p = f"blk.{i}."
        t.norm(p + "attn_norm.weight", e)
        if recurrent[i]:
            t.quant(p + "attn_qkv.weight", T.Q6_K if more else T.Q4_K, channels, e)  # attn_v-like in Q4_K_M
            t.quant(p + "attn_gate.weight", T.Q4_K, hv * dv, e)
            t.quant(p + "ssm_beta.weight", T.Q4_K, hv, e)
            t.quant(p + "ssm_alpha.weight", T.Q4_K, hv, e)
            t.f32(p + "ssm_conv1d.weight", (channels, conv), lambda rng: rng.uniform(-0.5, 0.5, (channels, conv)))
            t.f32(p + "ssm_dt.bias", (hv,), lambda rng: rng.uniform(-1.0, 1.0, hv))
            t.f32(p + "ssm_a", (hv,), lambda rng: -rng.uniform(0.5, 8.0, hv))  # -exp(A_log)
            t.norm(p + "ssm_norm.weight", dv)
            t.quant(p + "ssm_out.weight", T.Q4_K, e, hv * dv)
        else:
            t.quant(p + "attn_q.weight", T.Q4_K, 2 * h * d, e)  # per head: d query rows, d gate rows
            t.quant(p + "attn_k.weight", T.Q4_K, hkv * d, e)
            t.quant(p + "attn_v.weight", T.Q6_K if more else T.Q4_K, hkv * d, e)
            t.norm(p + "attn_q_norm.weight", d)
            t.norm(p + "attn_k_norm.weight", d)
            t.quant(p + "attn_output.weight", T.Q4_K, e, h * d)
        t.norm(p + "post_attention_norm.weight", e)
        t.quant(p + "ffn_gate.weight", T.Q4_K, f, e)
        t.quant(p + "ffn_up.weight", T.Q4_K, f, e)
        t.quant(p + "ffn_down.weight", T.Q6_K if more else T.Q4_K, e, f)


MODELS = {  # shape: architecture, what the file is named after, its writer, layers, vocabulary rows at least
    **{shape: ("qwen3moe" if shape in EXPERTS else "qwen3", f"Qwen3-{shape}", qwen3, SHAPES[shape][0], 0) for shape in SHAPES},
    "dsv2-lite": ("deepseek2", "DeepSeek-V2-Lite", deepseek2, DSV2_LITE["n_layers"], 0),
    "qwen35-0.8b": ("qwen35", "Qwen3.5-0.8B", qwen35, QWEN35_0_8B["n_layers"], QWEN35_0_8B["n_vocab"]),
}


def copy_vocab(w: GGUFWriter, vocab: GGUFReader, n_vocab: int) -> None:
    """The tokenizer.* keys, the token list padded to n_vocab with inert NORMAL tokens (no merge makes them)."""
    for key, field in vocab.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = value + [f"[PAD{i}]" for i in range(len(value), n_vocab)]
        elif key == "tokenizer.ggml.token_type":
            value = value + [1] * (n_vocab - len(value))
        if field.types[0] == 9:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, field.types[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("vocab")
    ap.add_argument("out")
    ap.add_argument("--shape", choices=MODELS, default="0.6b")
    ap.add_argument("--quant", choices=("q4_k_m", "q8_0"), default="q4_k_m")
    ap.add_argument("--layers", type=int, help="fewer layers than the shape has, same widths")
    args = ap.parse_args()
    arch, family, write, full, min_vocab = MODELS[args.shape]
    n_layers = args.layers or full
    if not 0 < n_layers <= full:
        ap.error(f"--layers must be 1..{full} for {args.shape}")
    vocab = GGUFReader(args.vocab)
    n_vocab = max(len(vocab.fields["tokenizer.ggml.tokens"].data), min_vocab)
    layers = "" if n_layers == full else f", {n_layers} layers"
    w = GGUFWriter(args.out, arch)
    copy_vocab(w, vocab, n_vocab)
    w.add_name(f"random {family} shape {args.quant.upper()}{layers}")
    t = Tensors(q8_0=args.quant == "q8_0")
    write(w, t, args.shape, n_layers, n_vocab)
    t.write(w, np.random.default_rng(0))
    w.close()
    print(f"wrote {args.out}: {arch} {args.shape} shape{layers}, {args.quant.upper()}, {n_vocab} tokens")


if __name__ == "__main__":
    main()
