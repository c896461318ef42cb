"""What a baked system prompt (`reflex prepare MODEL --system-prompt FILE`) saves a cold run.

    python tools/bench_baked_prompt.py MODEL.gguf [--tokens 1000] [--runs 5] [--device cpu]

On a copy of MODEL in a temp dir: writes a system prompt of about --tokens tokens, bakes it, then
runs `reflex generate COPY "SYSTEM + question" -n 8 --temp 0` in fresh processes, alternately
with and without the baked file. Prints the medians of the result line's phases and whether the
tokens agree; the figures go to docs/perf-notes.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SENTENCES = [
    "You are a careful assistant for a logistics company.",
    "Answer questions about shipments, customs forms, delivery windows and invoices.",
    "If a tracking number is malformed, say so and ask for it again.",
    "Never invent prices; quote only the rates listed in the tariff below.",
    "Domestic parcels under two kilograms cost four euros and ninety cents.",
    "International parcels are priced by zone: zone A nine euros, zone B fourteen, zone C twenty-two.",
    "Weekend deliveries are possible in large cities for a surcharge of six euros.",
    "Refunds for late deliveries are granted when the delay exceeds forty-eight hours.",
]
QUESTION = "Question: how much does a 1.5 kg domestic parcel cost?\nAnswer:"
PHASES = ("process_start_to_result_ms", "kv_import_ms", "prompt_eval_ms", "first_token_ms", "total_ms")


def reflex(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reflex_engine", *args], capture_output=True, text=True, timeout=900)


def system_prompt(model: str, n_tokens: int) -> str:
    import reflex_engine.engine as engine

    file = engine.ModelFile(model)
    text, i = "", 0
    while len(file.encode(text)) < n_tokens:
        text += SENTENCES[i % len(SENTENCES)] + (" " if i % 4 != 3 else "\n")
        i += 1
    return text + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, os.path.basename(args.model))
        shutil.copy(args.model, model)
        system = system_prompt(model, args.tokens)
        with open(os.path.join(tmp, "system.txt"), "w") as f:
            f.write(system)
        start = time.perf_counter()
        out = reflex("prepare", model, "--system-prompt", os.path.join(tmp, "system.txt"), "--device", args.device)
        assert out.returncode == 0, out.stderr
        print(out.stdout.strip(), f"({time.perf_counter() - start:.1f} s wall)")
        baked = model + ".reflex-kv"
        print(f"baked file: {os.path.getsize(baked) / 1e6:.1f} MB")
        results: dict[str, list[dict]] = {"baked": [], "plain": []}
        for _ in range(args.runs):
            for kind in ("baked", "plain"):
                if kind == "plain":
                    os.rename(baked, baked + ".away")
                out = reflex("generate", model, system + QUESTION, "-n", "8", "--temp", "0", "--device", args.device, "--json")
                if kind == "plain":
                    os.rename(baked + ".away", baked)
                assert out.returncode == 0, out.stderr
                results[kind].append(json.loads(out.stdout))
        for kind, runs in results.items():
            cells = [f"{p}={statistics.median(r.get(p, 0.0) for r in runs):.1f}" for p in PHASES]
            print(f"{kind}: prompt_tokens={runs[0]['prompt_tokens']} cached_tokens={runs[0]['cached_tokens']} "
                  + " ".join(cells) + f" (n={len(runs)})")
        same = all(r["token_ids"] == results["plain"][0]["token_ids"] for r in results["baked"] + results["plain"])
        print("tokens identical across all runs:", same, results["plain"][0]["text"][:60].replace("\n", " "))


if __name__ == "__main__":
    main()
