#!/usr/bin/env python3
"""Make the LoRA golden fixtures (dev-only; CI never runs this).

Per architecture (llama: tied output, Q/K rows permuted by the converters; qwen3: separate output,
whose lm_head the adapter also changes, and a smaller rank on o_proj):

1. the bases are tests/goldens' F32 and Q8_0 files of that architecture; the Hugging Face checkpoint
   the adapter is made on and converted against is built anew with tools/make_goldens.py's recipe
   (only its config matters: the references run on the GGUF bases' own weights);
2. a PEFT LoRA adapter on it (every attention and FFN projection; random A and B, rounded to values
   f16 holds exactly, so the F16 adapter file is as exact as the F32 one), converted by llama.cpp's
   convert_lora_to_gguf.py to F32 and F16 adapter GGUFs;
3. the references: transformers on each base GGUF's own weights (its GGUF loader) with the PEFT
   adapter on top, at adapter scales 1 and 0.5 (PEFT's set_scale, as llama.cpp's --lora-scale).

Nothing from reflex_engine is imported. Requirements: the `goldens` extra plus peft
(`pip install -e '.[goldens]' peft`). Run from the repository root with llama.cpp's source:

    python tools/make_lora_goldens.py --llama-cpp PATH/TO/llama.cpp

Outputs go to tests/goldens/lora/ (see the README written there).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_goldens as mg  # noqa: E402

OUT = mg.REPO_ROOT / "tests" / "goldens" / "lora"
RANK, ALPHA = 8, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_STD = 0.1  # of A and B: s·B·A then changes each weight by ~0.06, against the base's 0.1
SCALES = {"1": 1.0, "0.5": 0.5}
BASE_TYPES = ("F32", "Q8_0")
ADAPTER_TYPES = {"F32": "f32", "F16": "f16"}
EXTRA = {"llama": dict(targets=TARGETS, rank_pattern={}),
         "qwen3": dict(targets=TARGETS + ["lm_head"], rank_pattern={"o_proj": 4})}


def make_adapter(base_model, spec_name: str, out: Path, seed: int):
    import torch
    from peft import LoraConfig, get_peft_model

    extra = EXTRA[spec_name]
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=extra["targets"], rank_pattern=extra["rank_pattern"],
                        lora_dropout=0.0, bias="none", init_lora_weights=False)
    model = get_peft_model(base_model, config)
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_((LORA_STD * torch.randn_like(p)).half().float())
    # lm_head counts as an embedding layer to PEFT, which would also save the base's own weight and
    # load it over the GGUF base's (a Q8_0 one's dequantized) weight in the reference
    model.save_pretrained(out, safe_serialization=True, save_embedding_layers=False)
    return model


def convert_adapter(llama_cpp: Path, ckpt: Path, adapter: Path, outtype: str, outfile: Path, logdir: Path) -> None:
    cmd = [sys.executable, str(llama_cpp / "convert_lora_to_gguf.py"), "--base", str(ckpt), "--outtype", outtype,
           "--outfile", str(outfile), str(adapter)]
    mg.run_logged(cmd, logdir / f"convert-lora-{outfile.stem}.log")


def reference(base_gguf: Path, adapter_dir: Path):
    from peft import PeftModel

    return PeftModel.from_pretrained(mg.load_gguf_model(base_gguf), str(adapter_dir)).eval()


def set_scale(model, scale: float) -> None:
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.set_scale("default", scale)


def make(spec, llama_cpp: Path, cache: Path, seed: int) -> list[dict]:
    from transformers import AutoTokenizer

    name = spec.name
    out, ckpt, adapter_dir = OUT / name, cache / "checkpoints" / f"reflex-lora-{name}", cache / f"adapter-{name}"
    for d in (out, ckpt, adapter_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    mg.save_tokenizer(mg.build_tokenizer(spec), spec, ckpt)
    hf_model = mg.build_model(spec, ckpt, seed)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    bases = {t: mg.DEFAULT_OUT / name / f"{name}-{t}.gguf" for t in BASE_TYPES}
    make_adapter(hf_model, name, adapter_dir, seed)
    for t, outtype in ADAPTER_TYPES.items():
        convert_adapter(llama_cpp, ckpt, adapter_dir, outtype, out / f"adapter-{t}.gguf", cache)

    prompts, greedy_candidates = mg.make_prompts(tokenizer, spec, seed)
    summary = []
    for t, base in bases.items():
        model = reference(base, adapter_dir)
        plain = mg.load_gguf_model(base)
        for label, scale in SCALES.items():
            set_scale(model, scale)
            arrays, moved = {}, 0.0
            for i, p in enumerate(prompts):
                logits = mg.prompt_logits(model, p).astype(np.float32)
                arrays[f"prompt_{i}"] = np.asarray(p, dtype=np.int32)
                arrays[f"logits_{i}"] = logits
                moved = max(moved, float(np.abs(logits - mg.prompt_logits(plain, p)).max() / np.ptp(logits)))
            assert moved > 0.05, f"{name} {t} scale {scale}: the adapter hardly moves the logits ({moved:.3g})"
            for j, (gp, ids, _) in enumerate(mg.select_greedy(model, greedy_candidates)):
                arrays[f"greedy_prompt_{j}"] = np.asarray(gp, dtype=np.int32)
                arrays[f"greedy_{j}"] = np.asarray(ids, dtype=np.int32)
            mg.write_npz(out / f"goldens-{t}-scale{label}.npz", arrays)
            summary.append(f"{name}/{name}-{t}.gguf + adapter at scale {label}: the adapter moves the logits by up to "
                           f"{moved:.2f} of their range")
    return summary


def write_readme(summary: list[str]) -> None:
    import peft
    import torch
    import transformers

    lines = "\n".join(f"- {s}" for s in summary)
    (OUT / "README.md").write_text(f"""# LoRA golden fixtures

Generated by `tools/make_lora_goldens.py`; do not edit by hand. Per architecture (`llama`, `qwen3`,
on the tiny random models of `tests/goldens`):

- The bases are `tests/goldens/<arch>/<arch>-F32.gguf` and `<arch>-Q8_0.gguf`.
- `<arch>/adapter-F32.gguf`, `adapter-F16.gguf`: a PEFT LoRA adapter (r {RANK}, alpha {ALPHA}; qwen3: r 4 on
  o_proj, and lm_head adapted too) on every attention and FFN projection, A and B random (std {LORA_STD})
  and exactly representable in f16, written by llama.cpp's `convert_lora_to_gguf.py`.
- `<arch>/goldens-<base>-scale<s>.npz`: `prompt_i`/`logits_i` and `greedy_prompt_j`/`greedy_j` as in
  `tests/goldens`, from transformers on that base file's weights (its GGUF loader) with the PEFT
  adapter applied at scale s (PEFT's `set_scale`: the update times s, as llama.cpp's `--lora-scale`).

{lines}

Versions: torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__};
llama.cpp {mg.LLAMA_CPP_COMMIT} (converters).
""")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree (its converters and gguf-py)")
    ap.add_argument("--cache", type=Path, default=mg.DEFAULT_CACHE)
    ap.add_argument("--seed", type=int, default=mg.SEED)
    args = ap.parse_args()
    summary = []
    for name in ("llama", "qwen3"):
        summary += make(mg.ARCHS[name], args.llama_cpp.resolve(), args.cache, args.seed)
    write_readme(summary)
    print("\n".join(summary))
    print(json.dumps({"out": str(OUT)}))


if __name__ == "__main__":
    main()
