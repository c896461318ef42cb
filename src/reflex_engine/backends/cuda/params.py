"""Every kernel's parameters as Device.launch packs them: a letter a parameter of its C signature in
kernels/*.cu, the struct module's: P a pointer, i an int, q an int64_t (long long), f a float, d a
double. Call sites pass plain ints and floats in that order; struct refuses a float for an int.
tests/test_launch_args.py checks this table against the kernels' source.
"""
from __future__ import annotations

# <family>_<kernel suffix> (gemm_q4_K, matvec_x16_1_q6_K): one kernel a type, by a macro
FAMILIES = {
    "gemm": "PPPPPPPPPPiiiiiiii",  # gemm.cu
    "gemm_frag": "PPPPPPPPiiiii",  # gemm_frag.cu
    "gemm_tile": "PPPPPPPPiiiii",  # gemm_tile.cu
    "gemm_tile_split": "PPPPPPPPiiiii",
    "gemm_tile_experts": "PqPPPPii",
    "gemm_tile_heads": "PqPPiii",
    "dequant_f16": "PPiii",  # gemm_f16.cu
    "get_rows": "PPPii",  # get_rows.cu
    "matvec": "PPPiii",  # matvec.cu
    "grouped_matvec": "PqPPPii",
    "matvec_x16": "PPPPPPPPPiiiii",  # matvec_x16.cu
    "matvec_x16_1": "PPPPPPPPPiiiiPfPPPPP",
    "matvec_x16_1w": "PPPPPPPPPiiiiPfPPPPP",
    "matvec_x16_mma": "PPPPPPPPPiiiiPfPPPPP",  # matvec_x16_mma.cu
    "matvec_x16_bulk": "PPPPPPPPPiiiiPfPPPPP",
    "matvec_x16_bulk16": "PPPPPPPPPiiiiPfPPPPP",
    # their rope forms (kernels/rope.cuh RopeOut): no residual, no norm share
    "matvec_x16_1_rope": "PPPPPPPPiiiiPfPPPPPPiiiiifPPPPPPP",
    "matvec_x16_bulk_rope": "PPPPPPPPiiiiPfPPPPPPiiiiifPPPPPPP",
    "stacked_matvec_x16": "PPqPPPPPiiiPf",
    "experts_down_x16": "PqPPPPPPiii",
    "stacked_matvec": "PqPPPiiiii",  # moe.cu
    "experts_down": "PqPPPPiii",
}

KERNELS = {
    # attention.cu, attention_prefill.cu
    "kv_store": "PPPPPPPiiiii",
    "attention": "PPPPPPPiiiiifPPPP",
    "attention_cluster": "PPPPPPPiiiiifPPPP",
    "attention_group": "PPPPPPPiiiiifPPPP",
    "attention_prefill": "PPPPPPPiiiiif",
    "attention_prefill_256": "PPPPPPPiiiiif",
    # delta_net.cu
    "sigmoid_gate_f32": "PPPqiii",
    "gdn_gates_f32": "PPPPPPii",
    "causal_conv1d_f32": "PPPPiiiii",
    "delta_rule_step": "PPPPPPPiiiiifi",
    "delta_rule_chunk_prep": "PPPPPPPPPiiiiiifi",
    "delta_rule_chunk_scan": "PPPPPPPPiiiiiifii",
    # elementwise.cu
    "norm_f32": "PPPifPP",
    "rope_f32": "PPPiPPPPPiiiddfiiPiPPPiPPP",
    "add_f32": "PPPq",
    "swiglu_f32": "PPPqPP",
    "take_rows_f32": "PPPi",
    "smoke": "PPi",
    # gemm_f16.cu
    "to_f16": "PPq",
    # gemm_tile.cu
    "to_f16_interleaved": "PPq",
    "gemm_f16_64": "PPPPiiii",
    "gemm_f16_128": "PPPPiiii",
    # matvec_x16.cu
    "quantize_x16": "PPPi",
    # mla.cu
    "copy_heads_f32": "PPiiiiiPPiiiii",
    "rope_yarn_f32": "PPiPPPPiiiddddddii",
    "latent_attention": "PPPPPPPiiifP",
    "latent_attention_combine": "PPii",
    "latent_attention_prefill": "PPPPPPPiiiifP",
    "latent_attention_decode": "PPPPPPPiiiifP",
    # moe.cu
    "moe_route": "PPPPiiiifii",
    "moe_group": "PiiPPPPii",
    "moe_gather": "PPPii",
    "moe_combine": "PPPPii",
    # sampling.cu
    "argmax_rows": "PiP",
    "apply_penalties": "PPiff",
    "mask_logits": "PPi",
    "top_k": "PiiPPP",
    "row_logsumexp": "PiP",
    "gather_logprobs": "PiPPPiP",
}


def param_format(name: str) -> str | None:
    """The kernel's letters; None for a name neither table knows."""
    fmt = KERNELS.get(name)
    if fmt is None:
        family = max((f for f in FAMILIES if name.startswith(f + "_")), key=len, default=None)
        fmt = FAMILIES.get(family)
    return fmt
