"""Warm speed side by side (issue 11): `reflex bench` and llama.cpp's `llama-bench` on the same GGUF files in
one invocation, one table of tokens/s with the ratios. Run on the GPU machine:

    python bench/warm.py [NAME=]FILE... [--llama-bench LLAMA/build/bin/llama-bench] [--runs 3] [--out DIR]
        [--deadline-s S] [-c N]

For each file in turn: `reflex bench FILE --device cuda --runs N --json` (prefill at 16, 128, 512 and 2,048
tokens, decode at 128 and 4,096 tokens of context), then llama-bench's same figures: prefill from an empty
context (-p 16,128,512,2048 -n 0) and 64 generated tokens after 128 and 4,096 tokens (-p 0 -n 64 -d
128,4096), all layers on the GPU, N repetitions. Prints the table of tok/s, Reflex / llama.cpp (ratio; bold
where Reflex is ahead), and a second one of what llama-bench does not measure: decode's share of the copy
bandwidth, its per-token p50/p99, device memory. --out DIR also writes DIR/table.md and DIR/raw.json (both
engines' output as read). A failed run leaves '-' in its cells and its error under the tables. -c: reflex bench's
context length (its default fits every figure). --deadline-s: no file starts after S seconds (the table says
which did not run). Needs the engine importable (PYTHONPATH=src).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import NamedTuple

PREFILL = (16, 128, 512, 2048)
CONTEXTS = (128, 4096)
DECODE_TOKENS = 64  # llama-bench's generated tokens a decode figure (reflex bench's own default is 64 too)


class Figures(NamedTuple):
    """One engine's tokens/s on one file: prompt length -> prefill, context -> decode."""

    prefill: dict[int, float]
    decode: dict[int, float]


def reflex_figures(report: dict) -> Figures:
    """From `reflex bench --json`."""
    return Figures({int(n): v["tokens_per_s"] for n, v in report["prefill"].items()},
                   {int(c): v["tokens_per_s"] for c, v in report["decode"].items()})


def llama_figures(entries: list[dict]) -> Figures:
    """From llama-bench's `-o json` entries: a prompt test (n_gen 0) is prefill at n_prompt tokens, a generation
    test (n_prompt 0) decode after n_depth tokens."""
    prefill, decode = {}, {}
    for e in entries:
        if e["n_gen"] == 0:
            prefill[e["n_prompt"]] = e["avg_ts"]
        elif e["n_prompt"] == 0:
            decode[e.get("n_depth", 0)] = e["avg_ts"]
    return Figures(prefill, decode)


def cell(ours: float | None, theirs: float | None) -> str:
    """'ours / theirs (ratio)', bold where Reflex is ahead; '-' for a figure missing (no ratio then)."""
    if ours is None and theirs is None:
        return ""
    figures = f"{'-' if ours is None else f'{ours:,.0f}'} / {'-' if theirs is None else f'{theirs:,.0f}'}"
    if ours is None or theirs is None:
        return figures
    ratio = ours / theirs
    return f"{f'**{figures}**' if ratio >= 1 else figures} ({ratio:.2f}x)"


def speed_table(rows: list[tuple[str, Figures | None, Figures | None]]) -> str:
    head = [f"prefill {n:,}" for n in PREFILL] + [f"decode at {c:,}" for c in CONTEXTS]
    lines = ["| file | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for name, ours, theirs in rows:
        ours, theirs = ours or Figures({}, {}), theirs or Figures({}, {})
        cells = [cell(ours.prefill.get(n), theirs.prefill.get(n)) for n in PREFILL]
        cells += [cell(ours.decode.get(c), theirs.decode.get(c)) for c in CONTEXTS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def decode_table(reports: list[tuple[str, dict | None]]) -> str:
    """Reflex's decode beyond tokens/s: the weight bytes a token reads over the measured device copy, and latency."""
    at_head = [f"decode at {c:,}: share of the copy, p50 / p99" for c in CONTEXTS]
    lines = ["| file | weights a token | device copy | " + " | ".join(at_head) + " | device memory |",
             "|---" * (len(CONTEXTS) + 4) + "|"]
    for name, r in reports:
        if r is None:
            lines.append(f"| {name} |" + " |" * (len(CONTEXTS) + 3))
            continue
        copy = f"{r['copy_bytes_per_s'] / 1e12:.2f} TB/s" if r["copy_bytes_per_s"] else ""
        at = []
        for c in CONTEXTS:
            d = r["decode"].get(str(c))
            share = f"{d['bandwidth_fraction']:.1%}, " if d and d["bandwidth_fraction"] is not None else ""
            at.append(f"{share}{d['p50_ms']:.2f} / {d['p99_ms']:.2f} ms" if d else "")
        memory = f"{r['device_bytes_reserved'] / 1e9:.2f} GB" if r["device_bytes_reserved"] is not None else ""
        lines.append(f"| {name} | {r['weight_bytes_per_token'] / 1e9:.3f} GB | {copy} | " + " | ".join(at) + f" | {memory} |")
    return "\n".join(lines)


def run_json(cmd: list[str]) -> tuple[object | None, str | None]:
    """A command's stdout as JSON, or its failure as one line."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{cmd[0]}: {e}"
    if p.returncode != 0:
        return None, f"{' '.join(cmd)}: exit {p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1]}"
    try:
        return json.loads(p.stdout), None
    except json.JSONDecodeError as e:
        return None, f"{' '.join(cmd)}: output is not JSON ({e})"


def bench_file(path: str, *, device: str, runs: int, llama_bench: str | None, ctx_size: int | None = None) -> dict:
    """Both engines' raw output on one file, each None where it failed (its error beside it)."""
    out: dict = {"file": path}
    ctx = ["-c", str(ctx_size)] if ctx_size else []
    out["reflex"], out["reflex_error"] = run_json(
        [sys.executable, "-m", "reflex_engine", "bench", path, "--device", device, "--runs", str(runs), *ctx, "--json"])
    if llama_bench:
        common = [llama_bench, "-m", path, "-ngl", "99", "-r", str(runs), "-o", "json"]
        prefill, e1 = run_json(common + ["-p", ",".join(map(str, PREFILL)), "-n", "0"])
        decode, e2 = run_json(common + ["-p", "0", "-n", str(DECODE_TOKENS), "-d", ",".join(map(str, CONTEXTS))])
        out["llama"] = None if prefill is None and decode is None else (prefill or []) + (decode or [])
        out["llama_error"] = e1 or e2
    return out


def tables(results: list[tuple[str, dict]]) -> str:
    speed = [(name, reflex_figures(r["reflex"]) if r.get("reflex") else None,
              llama_figures(r["llama"]) if r.get("llama") else None) for name, r in results]
    errors = [f"- {name}: {r[k]}" for name, r in results for k in ("reflex_error", "llama_error") if r.get(k)]
    text = "Tokens/s, Reflex / llama.cpp (the ratio):\n\n" + speed_table(speed) + "\n\nReflex's decode:\n\n" \
        + decode_table([(name, r.get("reflex")) for name, r in results])
    return text + ("\n\nFailed:\n" + "\n".join(errors) if errors else "") + "\n"


def write(out: str, results: list[tuple[str, dict]]) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(tables(results))
    with open(os.path.join(out, "raw.json"), "w") as f:
        json.dump([r for _, r in results], f, indent=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", metavar="[NAME=]FILE")
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench binary (without it: Reflex's figures alone)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", help="a directory for table.md and raw.json")
    ap.add_argument("--deadline-s", type=float, help="start no file after this many seconds")
    ap.add_argument("-c", "--ctx-size", type=int, help="reflex bench's context length")
    args = ap.parse_args(argv)
    named = [f.split("=", 1) if "=" in f else (os.path.basename(f).removesuffix(".gguf"), f) for f in args.files]
    if missing := [f for _, f in named if not os.path.isfile(f)]:
        print(f"warm: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    if args.llama_bench and not os.access(args.llama_bench, os.X_OK):
        print(f"warm: {args.llama_bench} is not an executable", file=sys.stderr)
        return 2
    results, start = [], time.monotonic()
    for name, path in named:
        if args.deadline_s is not None and time.monotonic() - start > args.deadline_s:
            results.append((name, {"file": path, "reflex_error": "not run: past the deadline"}))
        else:
            results.append((name, bench_file(path, device=args.device, runs=args.runs, llama_bench=args.llama_bench,
                                              ctx_size=args.ctx_size)))
            print(f"warm: {name} done at {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
        if args.out:  # after each file: a call cut short keeps what it measured
            write(args.out, results)
    print(tables(results), end="")
    return 1 if any(r.get("reflex_error") for _, r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
