"""The `reflex` command line. Imports only the standard library at module level: each
subcommand imports what it needs when it runs, so `reflex info` never pays for numpy."""
from __future__ import annotations

import argparse
import json
import sys

from .errors import ReflexError


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="path to a .gguf file")


def cmd_info(args) -> int:
    from .gguf import GGUFFile
    from .model_info import describe, format_description

    with GGUFFile(args.model) as f:
        info = describe(f)
    print(json.dumps(info, indent=2) if args.json else format_description(info))
    return 0


def _read_text(args) -> str:
    if args.file is not None:
        try:
            with open(args.file, "rb") as fh:
                raw = fh.read()
        except OSError as e:
            raise ReflexError(f"cannot read {args.file}: {e.strerror or e}") from None
        # Invalid UTF-8 becomes U+FFFD, as Hugging Face tokenizers would see the text.
        return raw.decode("utf-8", errors="replace")
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
            sections["tokenizer"] = prepare_tokenizer(f)
    path = sidecar.write_sections(args.model, sections)
    print(f"wrote {path} ({', '.join(sections)})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reflex", description="GGUF-native LLM inference, built for the cold start.")
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

    p = sub.add_parser("prepare", help="write build-time caches beside the model (MODEL.reflex)")
    _add_model(p)
    p.set_defaults(run=cmd_prepare)

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
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
