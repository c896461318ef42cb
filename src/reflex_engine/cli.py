"""The `reflex` command line. Imports only the standard library at module level: each
subcommand imports what it needs when it runs, so `reflex info` never pays for numpy."""
from __future__ import annotations

import argparse
import json
import sys

from .errors import ReflexError
from .launch import DEVICE_DEFAULTS
from .timing import reported_phases


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="path to a .gguf file, or a hub spec org/repo[@revision]:file.gguf")


def _resolve_model(model: str) -> str:
    """Every command's MODEL: a local path as given, a hub spec downloaded (or found cached) first."""
    from .hub import resolve_model

    return resolve_model(model)


def cmd_info(args) -> int:
    from .gguf import GGUFFile
    from .model_info import describe, format_description

    with GGUFFile(args.model) as f:
        info = describe(f)
    print(json.dumps(info, indent=2) if args.json else format_description(info))
    return 0


def _read_file(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as e:
        raise ReflexError(f"cannot read {path}: {e.strerror or e}") from None
    # Invalid UTF-8 becomes U+FFFD, as Hugging Face tokenizers would see the text.
    return raw.decode("utf-8", errors="replace")


def _read_text(args) -> str:
    if args.file is not None:
        return _read_file(args.file)
    if args.text is None:
        raise ReflexError("give the text to tokenize, or --file PATH")
    return args.text


def cmd_tokenize(args) -> int:
    from .gguf import GGUFFile
    from .tokenizer import Tokenizer

    text = _read_text(args)
    with GGUFFile(args.model) as f:
        tok = Tokenizer.from_gguf(f)
    ids = tok.encode(text, add_bos=False if args.no_bos else None, parse_special=args.parse_special)
    print(json.dumps(ids) if args.json else " ".join(map(str, ids)))
    return 0


def cmd_prepare(args) -> int:
    from . import sidecar
    from .gguf import GGUFFile, layout_section
    from .tokenizer import prepare_tokenizer

    with GGUFFile(args.model, use_sidecar=False) as f:
        sections = {"layout": layout_section(f)}
        if "tokenizer.ggml.model" in f.metadata:
            from .constraints import TOKEN_BYTES_SECTION, token_bytes_section
            from .tokenizer import Tokenizer

            sections["tokenizer"] = prepare_tokenizer(f)
            sections[TOKEN_BYTES_SECTION] = token_bytes_section(f, Tokenizer.from_gguf(f, use_cache=False))  # a constraint's vocabulary
    path = sidecar.write_sections(args.model, sections)
    print(f"wrote {path} ({', '.join(sections)})")
    if args.system_prompt is not None:
        _bake_system_prompt(args)
    return 0


def _bake_system_prompt(args) -> None:
    """The system prompt's KV beside the model: a later request whose prompt ids start with its
    ids skips evaluating them (kvstate.prefix)."""
    from .engine import ModelFile
    from .kvstate import baked_state_path

    text = _read_file(args.system_prompt)
    file = ModelFile(args.model)
    for adapter, scale in _loras(args):  # then the baked state is the adapted model's, used by its runs only
        file.add_lora(adapter, scale)
    if args.chat:
        ids = file.encode(file.render_chat([{"role": "system", "content": text}], add_generation_prompt=False), add_bos=False)
    else:
        ids = file.encode(text)
    if not ids:
        raise ReflexError(f"the system prompt in {args.system_prompt} tokenizes to no tokens")
    if len(ids) > file.config.n_ctx_train:
        raise ReflexError(f"the system prompt is {len(ids)} tokens, longer than the model's context ({file.config.n_ctx_train})")
    model = file.load(args.device, n_ctx=len(ids))
    path = baked_state_path(args.model)
    with file.timings.phase("prompt_eval"):
        model.bake_prompt(ids, path)
    print(f"wrote {path} (the system prompt's KV: {len(ids)} tokens on {model.device}, "
          f"{file.timings.phases['prompt_eval_ms']:.0f} ms)")


def _model_and_prompt(args) -> tuple[str, str]:
    from .demo import DEMO_PROMPT, demo_model_path

    importing = getattr(args, "import_kv", None) is not None  # then the prompt continues the state, and may be left out
    if importing and args.chat:
        raise ReflexError("--chat renders a whole conversation; with --import-kv give the next text as it is")
    if args.demo:
        if len(args.inputs) > 1:
            raise ReflexError("with --demo give only the PROMPT")
        return demo_model_path(), args.inputs[0] if args.inputs else "" if importing else DEMO_PROMPT
    if len(args.inputs) == 1 and importing:
        return _resolve_model(args.inputs[0]), ""
    if len(args.inputs) != 2:
        raise ReflexError("give MODEL and PROMPT (or --demo [PROMPT])")
    return _resolve_model(args.inputs[0]), args.inputs[1]


def _open_and_encode(args, output_tokens, constrained: bool = False):
    """The host work, beside the driver's init (main started it): open the file, render and
    encode the prompt; then the backend. output_tokens(file) is how many tokens the request adds
    to the prompt (None: unbounded), for the default context size. constrained: start building
    the constraint's vocabulary (a thread) as soon as the tokenizer exists."""
    from .engine import ModelFile

    path, prompt = _model_and_prompt(args)
    file = ModelFile(path)
    if constrained:
        from . import constraints

        with file.timings.phase("constraint"):
            constraints.prepare(file.tokenizer, file.gguf)
    for adapter, scale in _loras(args):
        file.add_lora(adapter, scale)
    if args.chat:
        prompt = file.render_chat([{"role": "user", "content": prompt}])
    # A rendered template carries its own BOS text, an imported state its BOS: don't add a second one.
    ids = file.encode(prompt, add_bos=False if args.chat or getattr(args, "import_kv", None) else None)
    n_ctx = args.ctx_size if args.ctx_size is not None else _one_shot_context(file, len(ids), output_tokens(file))
    args.loaded = file.load(args.backend, n_ctx=n_ctx)  # held to main's exit_now (see main)
    return args.loaded, ids


def _one_shot_context(file, prompt_tokens: int, output_tokens: int | None) -> int | None:
    """Room for this one request, in steps of 256 tokens, as llama-simple sizes its context: a
    single-shot process need not reserve the model's whole trained context (40,960 tokens for
    Qwen3: a 4.7 GB cache on 0.6B). None (the model's) when the output is unbounded. A prompt
    already over the model's context gets the model's, and the engine's error."""
    if output_tokens is None:
        return None
    return min(file.config.n_ctx_train, -(-(prompt_tokens + output_tokens) // 256) * 256)


def _process_ms() -> float:
    """Milliseconds since the process started (the kernel's clock-tick start time: 10 ms steps)."""
    from .timing import process_age_ms

    return round(process_age_ms(), 1)


def _result_line(tag: str, fields: dict) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.7g}"
        if isinstance(v, list):
            return json.dumps(v, separators=(",", ":"))  # no spaces: a line is space-separated k=v
        return json.dumps(v, ensure_ascii=False) if isinstance(v, str) else str(v)

    return " ".join([tag] + [f"{k}={fmt(v)}" for k, v in fields.items()])


def cmd_generate(args) -> int:
    from .sampling import SamplingParams

    sampling = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              repeat_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
                              repeat_last_n=args.repeat_last_n, seed=None if args.seed < 0 else args.seed)
    constraint = _constraint(args)
    if constraint is not None:
        from .constraints import check

        check(constraint)  # a bad one is refused before the model loads
    model, ids = _open_and_encode(args, lambda file: None if args.max_tokens == -1 else args.max_tokens + _imported(args),
                                  constrained=constraint is not None)
    gen = model.generate(ids, max_tokens=args.max_tokens, sampling=sampling, stop=args.stop, ignore_eos=args.ignore_eos,
                         import_kv=args.import_kv, export_kv=args.export_kv, constraint=constraint)
    for event in gen:
        if not args.json and event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    summary = {"process_start_to_result_ms": _process_ms(), "tokens": len(gen.tokens), "prompt_tokens": gen.prompt_tokens,
               "cached_tokens": gen.cached_tokens, "tokens_per_s": round(gen.tokens_per_s, 3), "finish": gen.finish_reason, "device": model.device,
               **reported_phases(gen.timings)}
    if args.json:
        print(json.dumps({"text": gen.text, "token_ids": gen.tokens, **summary}, ensure_ascii=False))
    else:
        print()
        print(_result_line("REFLEX_GENERATE_OK", summary))
    return 0


def _constraint(args):
    """--json-schema FILE, --json-object, --regex PATTERN or --grammar FILE (at most one), or None."""
    given = [(kind, value) for kind, value in (("json_schema", args.json_schema), ("json_object", args.json_object or None),
                                               ("regex", args.regex), ("grammar", args.grammar)) if value is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ReflexError("give at most one of --json-schema, --json-object, --regex and --grammar")
    from .constraints import Constraint

    kind, value = given[0]
    if kind in ("json_schema", "grammar"):
        value = _read_file(value)
    return Constraint(kind, "" if kind == "json_object" else value)


def cmd_system1(args) -> int:
    schema, candidates = None, args.candidate or []
    if args.json_schema is not None:
        from .constraints import schema_instances

        if candidates:
            raise ReflexError("give --candidate or --json-schema, not both")
        schema = _read_file(args.json_schema)
        candidates = schema_instances(schema)  # refused here, before the model loads; sizes the context
    model, ids = _open_and_encode(args, lambda file: _imported(args) + sum(len(file.encode(c, add_bos=False))
                                                                           for c in candidates))
    result = model.system1(ids, None if schema is not None else candidates, import_kv=args.import_kv,
                           export_kv=args.export_kv, json_schema=schema)
    done_ms = _process_ms()
    # idx, token_ids, num_candidates, best_idx: the field names of the original Reflex's lines
    candidates = [{"idx": c.index, "text": c.text, "token_ids": c.tokens, "score": c.score, "probability": c.probability}
                  for c in result.candidates]
    summary = {"process_start_to_result_ms": done_ms, "num_candidates": len(candidates), "best_idx": result.best,
               "best_text": result.candidates[result.best].text, "entropy": result.entropy,
               "prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens, "device": model.device,
               **reported_phases(result.timings)}
    if args.json:
        print(json.dumps({**summary, "scores": candidates}, ensure_ascii=False))
    else:
        for c in candidates:
            print(_result_line("REFLEX_SYSTEM1_CANDIDATE_OK", c))
        print(_result_line("REFLEX_SYSTEM1_OK", summary))
    return 0


def _imported(args) -> int:
    """Tokens an --import-kv file adds to the context (checked when the model reads it)."""
    from .kvstate import count_tokens

    return count_tokens(args.import_kv) if args.import_kv is not None else 0


def cmd_check(args) -> int:
    from . import load
    from .check import check_against_reference

    model = load(args.model, device=args.backend, n_ctx=args.ctx_size, lora=_loras(args))
    report = check_against_reference(model, args.reference, tolerance=args.tolerance)
    for line in report.lines:
        print(line)
    print(_result_line("REFLEX_CHECK_OK" if report.ok else "REFLEX_CHECK_FAIL",
                       {"process_start_to_result_ms": _process_ms(), "worst": report.worst, "tolerance": report.tolerance, "prompts": report.n_prompts,
                        "device": model.device}))
    return 0 if report.ok else 1


def cmd_pull(args) -> int:
    from .hub import pull

    print(pull(args.spec))  # the local path alone on stdout, for scripts; progress goes to stderr
    return 0


def cmd_smoke(args) -> int:
    from .backends.cuda.smoke import smoke

    r = smoke()
    print(_result_line("REFLEX_SMOKE_OK", {"process_start_to_result_ms": _process_ms(), "device": r.device,
                                           "compute_capability": r.compute_capability, "code": r.code, "driver_cuda": r.driver}))
    return 0


def cmd_bench(args) -> int:
    from .bench import DECODE_CONTEXTS, format_report, run_bench
    from .engine import ModelFile

    file = ModelFile(args.model)
    # room for the longest decode context, not the model's whole trained one
    n_ctx = args.ctx_size if args.ctx_size is not None else min(file.config.n_ctx_train, max(DECODE_CONTEXTS) + 256)
    model = file.load(args.backend, n_ctx=n_ctx)
    report = run_bench(model, runs=args.runs)
    description = getattr(model.ops, "description", model.device)
    print(json.dumps(report.as_dict()) if args.json else format_report(report, f"{args.model} on {description}"))
    return 0


def cmd_stdio(args) -> int:
    from .ipc import serve_stdio

    return serve_stdio(args.model, device=args.backend, n_ctx=args.ctx_size, lora=_loras(args))


def cmd_uds(args) -> int:
    from .ipc import serve_unix

    return serve_unix(args.model, args.path, device=args.backend, n_ctx=args.ctx_size, lora=_loras(args))


def _loras(args) -> list[tuple[str, float]]:
    """--lora ADAPTER ... with --lora-scale S ...: the i-th scale goes with the i-th adapter (default 1)."""
    adapters, scales = args.lora or [], args.lora_scale or []
    if len(scales) > len(adapters):
        raise ReflexError(f"{len(scales)} --lora-scale values for {len(adapters)} --lora adapters")
    return [(a, scales[i] if i < len(scales) else 1.0) for i, a in enumerate(adapters)]


def _add_lora_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", action="append", metavar="ADAPTER.gguf",
                   help="apply a LoRA adapter (llama.cpp's convert_lora_to_gguf.py output) at load; repeatable")
    p.add_argument("--lora-scale", action="append", type=float, metavar="S",
                   help="scale of the matching --lora's update (default 1; 0 turns it off)")


def _add_device_option(p: argparse.ArgumentParser, command: str) -> None:
    p.add_argument("--device", default=DEVICE_DEFAULTS[command], choices=("cpu", "cuda", "auto"))


def _add_device_options(p: argparse.ArgumentParser, command: str) -> None:
    _add_device_option(p, command)
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context length (default: generate and system1 the request's, rounded up to 256; "
                   "stdio, uds and check the model's)")
    _add_lora_options(p)


def _add_run_options(p: argparse.ArgumentParser, command: str) -> None:
    p.add_argument("inputs", nargs="*", metavar="MODEL PROMPT",
                   help="a .gguf file (or org/repo[@revision]:file.gguf) and the prompt (with --demo: just the prompt)")
    p.add_argument("--demo", action="store_true", help="use the embedded SmolLM2-135M-Instruct demo model")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the model's chat template")
    _add_device_options(p, command)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text and a result line")
    p.add_argument("--import-kv", metavar="FILE", help="continue the conversation a KV state file holds: PROMPT (optional) "
                   "is appended to it; a run with the file's --seed continues its random stream")
    p.add_argument("--export-kv", metavar="FILE", help="at the end, write the KV state (the cache, tokens, sampler) to FILE, "
                   "atomically")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="reflex", description="GGUF-native LLM inference, built for the cold start.")
    parser.add_argument("--version", action="version", version=f"reflex {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("info", help="architecture, size, quant mix and tokenizer of a GGUF file")
    _add_model(p)
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p.set_defaults(run=cmd_info)

    p = sub.add_parser("tokenize", help="print the token ids of a text")
    _add_model(p)
    p.add_argument("text", nargs="?", help="the text (or use --file)")
    p.add_argument("--file", metavar="PATH", help="read the text from a file (bytes; invalid UTF-8 becomes U+FFFD)")
    p.add_argument("--no-bos", action="store_true", help="never add the BOS token")
    p.add_argument("--parse-special", action=argparse.BooleanOptionalAction, default=True,
                   help="match control tokens such as <|im_end|> written in the text (default: on)")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(run=cmd_tokenize)

    p = sub.add_parser("generate", help="generate text from a prompt")
    _add_run_options(p, "generate")
    p.add_argument("-n", "--max-tokens", type=int, default=64, help="-1: until the context is full")
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=40, help="0 = off")
    p.add_argument("--top-p", type=float, default=0.95, help="1 = off")
    p.add_argument("--min-p", type=float, default=0.05, help="0 = off")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="1 = off")
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--repeat-last-n", type=int, default=64)
    p.add_argument("--seed", type=int, default=-1, help="-1 = random")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop before this text (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")
    # constrained decoding (constraints.py): needs the structured extra
    p.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid under the JSON schema in FILE")
    p.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    p.add_argument("--regex", metavar="PATTERN", help="the output matches PATTERN as a whole")
    p.add_argument("--grammar", metavar="FILE", help="the output follows the grammar in FILE (Lark, as llguidance reads it, or GBNF)")
    p.set_defaults(run=cmd_generate)

    p = sub.add_parser("system1", help="score candidate answers in one forward pass")
    _add_run_options(p, "system1")
    p.add_argument("--candidate", action="append", metavar="TEXT", help="a candidate continuation (repeat for each)")
    p.add_argument("--json-schema", metavar="FILE", help="instead of --candidate: every instance of the JSON schema in FILE "
                   "(a finite set: enum, const, boolean, bounded integers, objects and arrays of those; at most 1,024), "
                   "written as generate --json-schema writes JSON")
    p.set_defaults(run=cmd_system1)

    p = sub.add_parser("check", help="compare our logits with a reference; non-zero exit on mismatch")
    _add_model(p)
    p.add_argument("--reference", required=True, metavar="NPZ",
                   help="goldens file: prompt_<i> token ids and logits_<i> float32 [T, V]; optional greedy_prompt_<j>/greedy_<j>")
    _add_device_option(p, "check")
    p.add_argument("--tolerance", type=float, default=None,
                   help="max |error| relative to each prompt's logit range (default: per device, see check.py)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context length (default: the model's)")
    _add_lora_options(p)
    p.set_defaults(run=cmd_check)

    p = sub.add_parser("pull", help="download org/repo[@revision]:file.gguf from the Hugging Face Hub, check it, print its path")
    p.add_argument("spec", metavar="org/repo[@revision]:file.gguf")
    p.set_defaults(run=cmd_pull)

    p = sub.add_parser("bench", help="warm prefill and decode speed: tokens/s, per-token latency, memory, bandwidth")
    _add_model(p)
    _add_device_option(p, "bench")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context length (default: 4,352, the longest decode context's need)")
    p.add_argument("--runs", type=int, default=5, help="timed runs per figure (their median)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=cmd_bench)

    p = sub.add_parser("smoke", help="run one kernel on the GPU and check it: the first command on a new machine")
    p.set_defaults(run=cmd_smoke)

    p = sub.add_parser("prepare", help="write build-time caches beside the model (MODEL.reflex, MODEL.reflex-kv)")
    _add_model(p)
    p.add_argument("--system-prompt", metavar="FILE", help="bake this text's KV into MODEL.reflex-kv: a prompt that starts "
                   "with its tokens skips their prefill")
    p.add_argument("--chat", action="store_true", help="with --system-prompt: FILE is a system message's content, rendered "
                   "with the model's chat template as the system turn")
    p.add_argument("--device", default="auto", choices=("cpu", "cuda", "auto"), help="where --system-prompt is evaluated "
                   "(its cache is f16 from CUDA, f32 from the CPU; either device reads either)")
    _add_lora_options(p)
    p.set_defaults(run=cmd_prepare)

    p = sub.add_parser("stdio", help="serve JSON-line requests on stdin/stdout, one at a time (docs/protocol.md)")
    _add_model(p)
    _add_device_options(p, "stdio")
    p.set_defaults(run=cmd_stdio)

    p = sub.add_parser("uds", help="serve the stdio protocol on a Unix socket, one connection at a time")
    _add_model(p)
    p.add_argument("path", help="the socket's path (a stale socket file there is replaced)")
    _add_device_options(p, "uds")
    p.set_defaults(run=cmd_uds)

    return parser


def main(argv: list[str] | None = None, backend=None, exit_now=None) -> int:
    """backend: a BackendStart that launch.run began from argv before this module was imported.
    exit_now(code): how the console entry ends its process, called while a one-shot command's model
    (args.loaded) is still held, so that its device is left to the driver's teardown at the exit."""
    args = build_parser().parse_args(argv)
    code = _run(args, backend)
    if exit_now is not None:
        exit_now(code)
    return code


def _run(args, backend) -> int:
    from .native import exit_on_sigbus

    exit_on_sigbus()  # a model file truncated under us: one line and exit 2, not a core dump
    try:
        if hasattr(args, "device") and args.run is not cmd_prepare:  # the driver's init overlaps all that follows
            from .backends import BackendStart

            args.backend = backend if backend is not None and backend.device == args.device else BackendStart(args.device)
        if getattr(args, "model", None) is not None:
            args.model = _resolve_model(args.model)
        return args.run(args)
    except ReflexError as e:
        print(f"reflex: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
