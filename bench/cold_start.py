"""Cold start side by side: the driver's floor, Reflex and llama.cpp, launch to first token and
to exit, in milliseconds and joules. Run on the GPU machine:

    python bench/cold_start.py --model 0.6b=Q06.gguf --model 8b=Q8B.gguf --llama-bin LLAMA/build/bin \
        --floor-bin BUILD --python VENV/bin/python [--n 10] [--deadline-s 600]

Every row runs as n fresh processes, rounds interleaved (one run of every row, then the next
round). The parent timestamps the child's stdout: launch -> first token (the first bytes of the
generated text, or the first result line) and launch -> exit. NVML's energy counter is read at
launch, first token and exit (it moves in ~12.5 J steps on an H200: the tables give the runs' mean),
beside an idle baseline measured before and after. Model files are read once before the rounds,
so the page cache is warm, except in the rows marked "dropped cache", which evict the file
(posix_fadvise DONTNEED) before each run. Every run is kept in raw.jsonl, failures included;
table.md and phases.png summarise them. --deadline-s stops starting rounds that would not finish
in time (the table says how many ran); --resume DIR adds rounds to an earlier run's raw.jsonl.

BUILD holds `floor` (gcc -O2 bench/floor.c -ldl) and `floor.cubin` (nvcc -cubin of
bench/floor_kernel.cu); without them the floor rows are left out, as are llama.cpp's without
--llama-bin. Needs the engine importable (PYTHONPATH=src) for prompt lengths; matplotlib for the
plot, nvidia-ml-py for energy (each optional).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import NamedTuple

PASSAGE = ("The committee met on a grey morning to review the quarterly figures, and the discussion soon turned to "
           "the question of whether the new warehouse in the north should open before the winter or wait until the "
           "roads were repaired in spring. Several members argued that delay would cost more than it saved. ")
# --structured: a ~300-token extraction prompt and a small schema, launch -> valid JSON
EXTRACTION = "\n\nFrom the minutes above, extract the meeting's topic, the decision taken and the number of members present, as JSON:\n"
EXTRACTION_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["topic", "decision", "members"],
                     "properties": {"topic": {"type": "string", "maxLength": 40},
                                    "decision": {"enum": ["open before winter", "wait for spring", "undecided"]},
                                    "members": {"type": "integer", "minimum": 0, "maximum": 99}}}
EXTRACTION_TOKENS = 300
STRUCTURED_PROMPT = "extraction"  # the prompt tag of those rows
# a cap, not a length: both engines end where the schema does; llama.cpp's JSON grammar lets a random
# model write up to 20 blanks between tokens
EXTRACTION_MAX_TOKENS = 384
DRIVER_SETTINGS = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "CUDA_DEVICE_MAX_COPY_CONNECTIONS": "1"}  # what Reflex sets
PIPE_BUFFER = 4096  # stdio's buffer on a pipe: an unflushed echo arrives in pieces of this size
RUN_TIMEOUT_S = 120


class Row(NamedTuple):
    name: str  # begins with its engine: "floor", "python3", "Reflex" or "llama.cpp" (engine_of)
    model: str  # model tag ("0.6b"), "" for the floors
    prompt: str  # prompt tag ("16"), ""
    cmd: list[str]
    first: str  # "line:PREFIX" | "bytes" (first stdout bytes) | "echo:N" (first bytes after N echoed) | "" (exit only)
    env: dict[str, str] = {}
    drop_cache: str = ""  # a file to evict from the page cache before each run
    json_out: bool = False  # the run is ok only if its output holds a JSON object valid for EXTRACTION_SCHEMA


# -- prompts ---------------------------------------------------------------------------------------

def tokenizer_of(model_path: str):
    from reflex_engine.gguf import GGUFFile
    from reflex_engine.tokenizer import Tokenizer

    with GGUFFile(model_path) as f:
        return Tokenizer.from_gguf(f)


def prompt_length(model_path: str, text: str) -> int:
    return len(tokenizer_of(model_path).encode(text, add_bos=False))


def prompt_of(model_path: str, n_tokens: int) -> tuple[str, int]:
    """The longest prefix of the repeated passage (whole words) that tokenizes to <= n_tokens."""
    tok = tokenizer_of(model_path)
    words = (PASSAGE * (1 + n_tokens // 40)).split()
    count = lambda k: len(tok.encode(" ".join(words[:k]), add_bos=False))
    lo, hi = 1, len(words)
    while lo < hi:  # the largest k with count(k) <= n_tokens
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if count(mid) <= n_tokens else (lo, mid - 1)
    return " ".join(words[:lo]), count(lo)


# -- the rows --------------------------------------------------------------------------------------

def build_rows(args, prompts: dict[tuple[str, str], str]) -> list[Row]:
    py, rows = args.python, []
    floor, cubin = os.path.join(args.floor_bin or "", "floor"), os.path.join(args.floor_bin or "", "floor.cubin")
    if args.floor_bin and os.path.exists(floor) and os.path.exists(cubin):
        here = os.path.dirname(os.path.abspath(__file__))
        for settings, suffix in (({}, ""), (DRIVER_SETTINGS, ", Reflex's driver settings")):
            rows.append(Row(f"floor, C{suffix}", "", "", [floor, cubin], "line:FLOOR_OK", settings))
            rows.append(Row(f"floor, python3 + ctypes{suffix}", "", "", [py, os.path.join(here, "floor.py"), cubin],
                            "line:FLOOR_OK", settings))
    rows.append(Row("python3 -c pass", "", "", [py, "-c", "pass"], ""))
    llama = args.llama_bin
    for (tag, p), text in prompts.items():
        model = dict(args.model)[tag]
        reflex = [py, "-m", "reflex_engine"]
        common = [model, text, "--device", args.device]
        short = int(p) <= args.long_prompt // 2  # the rows that only the short prompts get, to fit a device call
        generate = reflex + ["generate"] + common + ["--temp", "0", "--ignore-eos", "-n"]
        rows += [
            Row("Reflex system1", tag, p, reflex + ["system1"] + common + ["--candidate", " yes", "--candidate", " no"],
                "line:REFLEX_SYSTEM1_CANDIDATE_OK"),
            Row("Reflex generate -n 1", tag, p, generate + ["1"], "bytes"),
        ]
        if short:
            rows.append(Row("Reflex generate -n 32", tag, p, generate + ["32"], "bytes"))
        if p == args.extra_prompt and tag == args.extra_model:
            rows.append(Row("Reflex generate -n 1, dropped cache", tag, p, generate + ["1"], "bytes", drop_cache=model))
            prepared = prepared_copy(model, py)
            if prepared:
                rows.append(Row("Reflex generate -n 1, after reflex prepare", tag, p,
                                reflex + ["generate", prepared, text, "--device", args.device, "--temp", "0", "--ignore-eos",
                                          "-n", "1"], "bytes"))
        if llama:
            ctx = "512" if int(p) <= 256 else str(2 * int(p))
            simple = [os.path.join(llama, "llama-simple"), "-m", model, "-n", "1", "-ngl", "99", text]
            completion = [os.path.join(llama, "llama-completion"), "-m", model, "-p", text, "-n", "1", "-ngl", "99", "-c", ctx,
                          "-fit", "off", "-no-cnv", "--no-display-prompt", "--temp", "0"]
            echo = len(text.encode()) // PIPE_BUFFER * PIPE_BUFFER
            rows += [
                Row("llama.cpp llama-simple -n 1 -ngl 99", tag, p, simple, f"echo:{echo}"),
                Row(f"llama.cpp llama-completion --no-warmup -c {ctx}", tag, p, completion + ["--no-warmup"], "bytes"),
            ]
            if short:
                rows.append(Row(f"llama.cpp llama-completion -c {ctx} (with warm-up)", tag, p, completion, "bytes"))
            if p == args.extra_prompt and tag == args.extra_model:
                rows.append(Row(f"llama.cpp llama-completion --no-warmup -c {ctx}, dropped cache", tag, p,
                                completion + ["--no-warmup"], "bytes", drop_cache=model))
    return rows


def structured_rows(args, text: str) -> list[Row]:
    """Reflex's --json-schema and llama.cpp's (its JSON-schema grammar) on the extraction prompt."""
    tag, p = args.structured, STRUCTURED_PROMPT
    model = dict(args.model)[tag]
    schema = os.path.join(tempfile.mkdtemp(), "extraction.schema.json")
    with open(schema, "w") as fh:
        json.dump(EXTRACTION_SCHEMA, fh)
    rows = [Row("Reflex generate --json-schema", tag, p,
                [args.python, "-m", "reflex_engine", "generate", model, text, "--device", args.device, "--temp", "0",
                 "--json-schema", schema, "-n", str(EXTRACTION_MAX_TOKENS)], "bytes", json_out=True)]
    if args.llama_bin:
        rows.append(Row("llama.cpp llama-completion --no-warmup --json-schema", tag, p,
                        [os.path.join(args.llama_bin, "llama-completion"), "-m", model, "-p", text, "-n", str(EXTRACTION_MAX_TOKENS), "-ngl", "99",
                         "-c", "1024", "-fit", "off", "-no-cnv", "--no-display-prompt", "--temp", "0", "--no-warmup",
                         "--json-schema", json.dumps(EXTRACTION_SCHEMA)], "bytes", json_out=True))
    return rows


def valid_extraction(text: str) -> bool:
    """The first JSON object in the output, checked against EXTRACTION_SCHEMA by hand (the harness
    needs nothing installed for it)."""
    at = text.find("{")
    try:
        doc, _ = json.JSONDecoder().raw_decode(text[at:]) if at >= 0 else (None, 0)
    except ValueError:
        return False
    props = EXTRACTION_SCHEMA["properties"]
    return (isinstance(doc, dict) and set(doc) == set(props) and isinstance(doc["topic"], str)
            and len(doc["topic"]) <= props["topic"]["maxLength"] and doc["decision"] in props["decision"]["enum"]
            and type(doc["members"]) is int and 0 <= doc["members"] <= 99)


def prepared_copy(model: str, python: str) -> str | None:
    """A hard link to the model with `reflex prepare`'s MODEL.reflex beside it (the tokenizer tables
    and the reader's index, ahead of time), so one row runs prepared and the others do not; the
    link shares the file's page cache. None where the folder refuses a link."""
    link = model[: -len(".gguf")] + ".prepared.gguf" if model.endswith(".gguf") else model + ".prepared"
    try:
        if not os.path.exists(link):
            os.link(model, link)
    except OSError:
        return None
    done = subprocess.run([python, "-m", "reflex_engine", "prepare", link], capture_output=True, text=True)
    return link if done.returncode == 0 else None


# -- one run ---------------------------------------------------------------------------------------

class Energy:
    """NVML's total-energy counter of GPU 0, in joules (None without nvidia-ml-py or a GPU)."""

    def __init__(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle, self._nvml = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml
        except Exception:  # no library, no driver: the table says so
            self._nvml = None

    def read(self) -> float | None:
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1e3 if self._nvml else None

    def idle_watts(self, seconds: float) -> float | None:
        a, t = self.read(), time.perf_counter()
        time.sleep(seconds)
        b = self.read()
        return None if a is None else (b - a) / (time.perf_counter() - t)


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_once(row: Row, energy: Energy) -> dict:
    if row.drop_cache:
        evict(row.drop_cache)
    env = {**os.environ, **row.env}
    with tempfile.TemporaryFile() as err:
        e0, t0 = energy.read(), time.perf_counter()
        proc = subprocess.Popen(row.cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=env)
        out, first_ms, e_first = b"", None, None
        mode, _, arg = row.first.partition(":")
        watchdog = threading.Timer(RUN_TIMEOUT_S, proc.kill)
        watchdog.start()
        while True:
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            now = time.perf_counter()
            if not chunk:
                break
            before, out = len(out), out + chunk
            if first_ms is None and (mode == "bytes" or mode == "echo" and len(out) > int(arg)
                                     or mode == "line" and re.search(rb"(^|\n)" + re.escape(arg.encode()), out)):
                first_ms, e_first = (now - t0) * 1e3, energy.read()
        rc = proc.wait()
        watchdog.cancel()
        exit_ms, e_exit = (time.perf_counter() - t0) * 1e3, energy.read()
        err.seek(0)
        stderr = err.read()[-2000:].decode(errors="replace")
    text = out.decode(errors="replace")
    ok = rc == 0 and (first_ms is not None or not row.first) and (not row.json_out or valid_extraction(text))
    return {"row": row.name, "model": row.model, "prompt": row.prompt, "rc": rc, "ok": ok, "first_ms": first_ms, "exit_ms": exit_ms,
            "j_first": None if e0 is None or e_first is None else e_first - e0, "j_exit": None if e0 is None else e_exit - e0,
            "phases": result_fields(text) if engine_of(row.name) == "reflex" else {},
            "stdout_tail": text[-600:], "stderr_tail": stderr}


def result_fields(stdout: str) -> dict[str, float]:
    """The numeric key=value fields of Reflex's result line (REFLEX_*_OK ...)."""
    lines = [ln for ln in stdout.splitlines() if re.match(r"REFLEX_(GENERATE|SYSTEM1)_OK ", ln)]
    fields = {}
    for key, value in re.findall(r"(\w+)=(-?[0-9.]+(?:e-?\d+)?)(?=\s|$)", lines[-1] if lines else ""):
        fields[key] = float(value)
    return fields


# -- the summary -----------------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def engine_of(row_name: str) -> str:
    return next(e for prefix, e in (("floor", "floor"), ("python3", "python"), ("Reflex", "reflex"), ("llama.cpp", "llama.cpp"))
                if row_name.startswith(prefix))


def critical_path(ph: dict) -> list[tuple[str, float]] | None:
    """Reflex's launch-to-first-token as consecutive segments, from its phases: the interpreter,
    its own code before the driver's init starts, the init (the host path runs beside it), the
    model load once the driver is ready, the prompt's pass (the weights' copies run beside it). The init's start is cuda_start_ms
    where the result line has it, else what the other phases leave for it."""
    need = ("interpreter_ms", "cuda_init_ms", "model_load_ms", "prompt_eval_ms", "first_token_ms", "backend_init_ms")
    if not all(k in ph for k in need):
        return None
    ready = ph["first_token_ms"] - ph["prompt_eval_ms"] - ph["model_load_ms"]  # since import
    start = ph.get("cuda_start_ms", ready - ph["cuda_init_ms"])
    return [("interpreter", ph["interpreter_ms"]), ("before the driver's init", start),
            ("driver init (host path beside it)", ready - start), ("model load", ph["model_load_ms"]),
            ("prompt eval (the weights' upload beside it)", ph["prompt_eval_ms"])]


def summarise(runs: list[dict], meta: dict) -> tuple[str, dict]:
    """The tables from the raw runs, rows in the order they first ran."""
    by_row: dict[tuple, list[dict]] = {}
    for r in runs:
        by_row.setdefault((r["row"], r["model"], r["prompt"]), []).append(r)
    stats = {}
    for key, rs in by_row.items():
        ok = [r for r in rs if r["ok"]]
        s = {"n": len(ok), "failed": len(rs) - len(ok)}
        for field in ("first_ms", "exit_ms", "j_first", "j_exit"):
            vals = [r[field] for r in ok if r[field] is not None]
            if vals:
                s[field] = {"p50": statistics.median(vals), "p95": pct(vals, 0.95), "min": min(vals), "mean": statistics.mean(vals)}
        phases = {}
        for r in ok:
            for k, v in r["phases"].items():
                phases.setdefault(k, []).append(v)
        s["phases"] = {k: statistics.median(v) for k, v in phases.items()}
        if meta.get("idle_w") is not None and "exit_ms" in s and "j_exit" in s:
            s["j_exit_above_idle"] = s["j_exit"]["mean"] - meta["idle_w"] * statistics.mean(r["exit_ms"] for r in ok) / 1e3
        stats[key] = s

    def cell(s, field, digits=0):
        v = s.get(field)
        return "–" if not v else f"{v['p50']:.{digits}f} ({v['p95']:.{digits}f}, {v['min']:.{digits}f})"

    idle = f"idle GPU power {meta['idle_w']:.1f} W" if meta.get("idle_w") is not None else "energy not measured"
    lines = [f"# Cold start, {meta['date']}, {meta['gpu']}", "",
             f"Driver {meta['driver']}, {meta['python']}; Reflex from compiled bytecode, as pip installs it; page cache warm "
             f"except where a row says \"dropped cache\"; n fresh processes per row, rounds interleaved; {idle}; energy as the "
             "mean of the runs (NVML's counter moves in ~12.5 J steps, which a median would pick one of).", "",
             "| model | prompt tokens | process | n | launch→first token p50 (p95, min) ms | launch→exit p50 (p95, min) ms "
             "| J launch→first token | J launch→exit | J launch→exit above idle |", "|---|---|---|---|---|---|---|---|---|"]
    for (name, model, prompt), s in stats.items():
        j = lambda f: "–" if f not in s else f"{s[f]['mean']:.1f}"
        above = f"{s['j_exit_above_idle']:.1f}" if "j_exit_above_idle" in s else "–"
        tokens = meta["prompt_tokens"].get(f"{model}/{prompt}", "") if model else ""
        failed = f" ({s['failed']} failed)" if s["failed"] else ""
        lines.append(f"| {model or '–'} | {tokens or '–'} | {name} | {s['n']}{failed} | {cell(s, 'first_ms')} | "
                     f"{cell(s, 'exit_ms')} | {j('j_first')} | {j('j_exit')} | {above} |")
    lines += ["", "Reflex's own phases (p50 of its result lines, ms; cuda_init ran on a thread beside the host path; "
              "first_token counts from the import of reflex_engine, interpreter is the process's age then, in 10 ms steps):", "",
              "| model | prompt | process | interpreter | gguf_open | tokenizer | cuda_init | hidden | backend wait | upload (GB/s) "
              "| prompt_eval | first_token |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (name, model, prompt), s in stats.items():
        ph = s["phases"]
        if engine_of(name) != "reflex" or not ph:
            continue
        g = lambda k: f"{ph[k]:.1f}" if k in ph else "–"
        up = f"{g('upload_ms')} ({ph['upload_gb_per_s']:.1f})" if "upload_gb_per_s" in ph else g("upload_ms")
        lines.append(f"| {model} | {prompt} | {name} | {g('interpreter_ms')} | {g('gguf_open_ms')} | {g('tokenizer_ms')} | "
                     f"{g('cuda_init_ms')} | {g('cuda_init_hidden_ms')} | {g('backend_init_ms')} | {up} | {g('prompt_eval_ms')} | "
                     f"{g('first_token_ms')} |")
    lines += ["", *ratios(stats)]
    return "\n".join(lines) + "\n", stats


def ratios(stats: dict) -> list[str]:
    """Reflex against the floor at default settings and against llama.cpp's best row, same run."""
    def typical(key, field):  # times: the p50; energy: the mean (see summarise)
        return stats.get(key, {}).get(field, {}).get("mean" if field.startswith("j_") else "p50")

    floor = {f: typical(("floor, python3 + ctypes", "", ""), f) for f in ("first_ms", "exit_ms", "j_exit")}
    out = ["| model | prompt | Reflex generate -n 1 first token / exit | ÷ Python floor (first, exit, J) | "
           "llama.cpp best first token / exit | llama.cpp ÷ Reflex (first, exit) |", "|---|---|---|---|---|---|"]
    for (name, model, prompt) in (k for k in stats if k[0] == "Reflex generate -n 1"):
        r = {f: typical((name, model, prompt), f) for f in ("first_ms", "exit_ms", "j_exit")}
        peers = [k for k in stats if k[0].startswith("llama.cpp") and k[1:] == (model, prompt) and "dropped" not in k[0]]
        best = {f: min((typical(k, f) for k in peers if typical(k, f) is not None), default=None) for f in ("first_ms", "exit_ms")}
        div = lambda a, b: f"{a / b:.2f}" if a is not None and b else "–"
        out.append(f"| {model} | {prompt} | {r['first_ms'] or 0:.0f} / {r['exit_ms'] or 0:.0f} ms | "
                   f"{div(r['first_ms'], floor['first_ms'])}, {div(r['exit_ms'], floor['exit_ms'])}, {div(r['j_exit'], floor['j_exit'])} | "
                   + (f"{best['first_ms']:.0f} / {best['exit_ms']:.0f} ms | {div(best['first_ms'], r['first_ms'])}, "
                      f"{div(best['exit_ms'], r['exit_ms'])} |" if best["first_ms"] else "– | – |"))
    return out


def plot(stats: dict, path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    keys = [k for k, s in stats.items() if "exit_ms" in s]
    fig, ax = plt.subplots(figsize=(11, 0.3 * len(keys) + 2.2))
    colours = {"floor": "#888888", "python": "#bbbbbb", "reflex": "#1f77b4", "llama.cpp": "#d62728"}
    segment_colours = ["#f0f0f0", "#fdae6b", "#9ecae1", "#756bb1", "#08306b"]
    labelled = set()
    for y, key in enumerate(keys):
        s, engine = stats[key], engine_of(key[0])
        first, exit_ = s.get("first_ms", {}).get("p50"), s["exit_ms"]["p50"]
        ax.barh(y, exit_, color=colours[engine], alpha=0.3)
        if first:
            ax.barh(y, first, color=colours[engine], alpha=0.85)
        path_ = critical_path(s["phases"]) if engine == "reflex" else None
        if path_:
            left = 0.0
            for (label, width), colour in zip(path_, segment_colours):
                ax.barh(y, width, left=left, height=0.4, color=colour, edgecolor="white", linewidth=0.3,
                        label=None if label in labelled else label)
                labelled.add(label)
                left += width
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels([f"{m + ' ' if m else ''}{p + ' tok ' if p else ''}{n}" for n, m, p in keys], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms from launch, p50: dark = first token, light = exit; inner bars: Reflex's critical path", fontsize=8)
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    return True


def write_summary(out: str, runs: list[dict], meta: dict) -> str:
    table, stats = summarise(runs, meta)
    with open(os.path.join(out, "table.md"), "w") as fh:
        fh.write(table)
    plotted = plot(stats, os.path.join(out, "phases.png"), f"Cold start, {meta['gpu']}, {meta['date']}")
    return table + ("" if plotted else "\n(no matplotlib: no plot)\n")


# -- main ------------------------------------------------------------------------------------------

def machine() -> dict:
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0].split(", ")
    except (OSError, IndexError, subprocess.SubprocessError):
        q = ["no GPU", "–"]
    return {"gpu": q[0], "driver": q[1], "python": f"Python {platform.python_version()}", "cpus": os.cpu_count(),
            "date": datetime.date.today().isoformat()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", default=[], type=lambda s: tuple(s.split("=", 1)), metavar="TAG=PATH")
    ap.add_argument("--prompt-tokens", default="16,1024")
    ap.add_argument("--long-prompt", type=int, default=1024,
                    help="prompts over half this get no generate -n 32 and no llama.cpp warm-up row (time)")
    ap.add_argument("--llama-bin", help="llama.cpp's build/bin (llama-simple, llama-completion)")
    ap.add_argument("--floor-bin", help="a folder with floor and floor.cubin")
    ap.add_argument("--python", default=sys.executable, help="the interpreter for Reflex and the Python floor")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--deadline-s", type=float, default=1e9, help="start no round that would end later than this")
    ap.add_argument("--extra-model", default="0.6b", help="the model of the dropped-cache rows")
    ap.add_argument("--extra-prompt", default="16")
    ap.add_argument("--structured", metavar="TAG", help="add the structured-extraction rows on this model")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--resume", help="a results folder to add rounds to")
    ap.add_argument("--summarise", metavar="FOLDER", help="only rewrite FOLDER's table.md and phases.png from its raw.jsonl")
    args = ap.parse_args()
    if args.summarise:
        return resummarise(args.summarise)
    if not args.model:
        ap.error("give at least one --model TAG=PATH")
    t_end = time.monotonic() + args.deadline_s
    meta = machine()
    prompts, counts = {}, {}
    from reflex_engine.errors import ReflexError

    try:  # a model that cannot be read is one line, before any run
        for tag, path in args.model:
            for n in map(int, args.prompt_tokens.split(",")):
                prompts[tag, str(n)], counts[f"{tag}/{n}"] = prompt_of(path, n)
    except ReflexError as e:
        sys.exit(f"cold_start: {e}")
    extraction = None
    if args.structured:
        path = dict(args.model)[args.structured]
        extraction = prompt_of(path, EXTRACTION_TOKENS - 30)[0] + EXTRACTION
        counts[f"{args.structured}/{STRUCTURED_PROMPT}"] = prompt_length(path, extraction)
    meta["prompt_tokens"] = counts
    rows = build_rows(args, prompts) + (structured_rows(args, extraction) if extraction else [])
    compile_bytecode(args.python)
    for _, path in args.model:  # page cache warm
        with open(path, "rb") as fh:
            while fh.read(64 << 20):
                pass
    slug = re.sub(r"[^a-z0-9]+", "-", meta["gpu"].lower()).strip("-")
    out = args.resume or os.path.join(args.out, f"{meta['date']}-{slug}")
    os.makedirs(out, exist_ok=True)
    raw_path = os.path.join(out, "raw.jsonl")
    energy = Energy()
    idle = [energy.idle_watts(3.0)]
    print(f"{len(rows)} rows; idle {idle[0]} W; results in {out}", flush=True)
    rounds = 0
    with open(raw_path, "a") as raw:
        while rounds < args.n:
            start = time.monotonic()
            for row in rows:
                r = run_once(row, energy)
                r["round"] = rounds
                raw.write(json.dumps(r) + "\n")
                raw.flush()
                if not r["ok"]:
                    print(f"FAILED {row.name} {row.model} {row.prompt}: rc={r['rc']} {r['stderr_tail'][-300:]!r}"
                          f"{' stdout ' + repr(r['stdout_tail'][-300:]) if row.json_out else ''}", flush=True)
                time.sleep(0.2)  # let the GPU settle back toward idle between processes
            rounds += 1
            took = time.monotonic() - start
            print(f"round {rounds}: {took:.1f} s", flush=True)
            if time.monotonic() + took > t_end:
                print(f"stopping after {rounds} rounds: the next would pass the deadline", flush=True)
                break
    idle.append(energy.idle_watts(3.0))
    meta["idle_w"] = statistics.mean(idle) if None not in idle else None
    meta["commands"] = {f"{r.name} [{r.model} {r.prompt}]": {"cmd": r.cmd, "env": r.env} for r in rows}
    with open(os.path.join(out, "meta.json"), "w") as fh:
        json.dump(meta, fh, indent=1)
    print(write_summary(out, load_runs(raw_path), meta), flush=True)


def compile_bytecode(python: str) -> None:
    """Reflex's modules compiled for `python`, as pip compiles them at install. A checkout's bytecode is
    otherwise written by the first process that imports it, or never where PYTHONDONTWRITEBYTECODE is
    set (as on the GPU host), and then every process compiles them from source first: ~50 ms of the
    main thread's host path there (docs/perf-notes.md, run 14)."""
    import importlib.util

    spec = importlib.util.find_spec("reflex_engine")
    if spec is not None and spec.submodule_search_locations:
        try:
            subprocess.run([python, "-m", "compileall", "-q", *spec.submodule_search_locations], stdout=subprocess.DEVNULL, check=False)
        except OSError as e:
            sys.exit(f"cold_start: cannot run --python {python}: {e.strerror or e}")


def load_runs(raw_path: str) -> list[dict]:
    with open(raw_path) as fh:
        return [json.loads(line) for line in fh]


def resummarise(folder: str) -> None:
    """table.md and phases.png again from a results folder's raw.jsonl and meta.json."""
    with open(os.path.join(folder, "meta.json")) as fh:
        meta = json.load(fh)
    print(write_summary(folder, load_runs(os.path.join(folder, "raw.jsonl")), meta))

if __name__ == "__main__":
    main()
