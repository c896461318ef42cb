"""Options: each a flag and an environment variable (the flag wins), listed once in OPTIONS, which
both argparse and the README's table come from."""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from dataclasses import dataclass

from .api import Defaults


@dataclass(frozen=True)
class Option:
    flag: str
    env: tuple[str, ...]  # the first one set is used
    default: object
    help: str
    type: type = str
    choices: tuple | None = None


OPTIONS = [
    Option("model", ("REFLEX_MODEL",), None, "the GGUF file (or hub spec) the engine serves; positional"),
    Option("--host", ("REFLEX_HOST",), "127.0.0.1", "address to listen on (0.0.0.0 in a container)"),
    Option("--port", ("REFLEX_PORT", "PORT"), 8000, "HTTP port; 0 picks a free one (the log line names it)", int),
    Option("--health-port", ("PORT_HEALTH",), None, "a second port that serves only /ping and /healthz (Runpod's "
           "load balancer polls /ping on PORT_HEALTH)", int),
    Option("--served-model-name", ("REFLEX_SERVED_MODEL_NAME",), None, "the model id clients send and see; "
           "default: MODEL as given"),
    Option("--api-key", ("REFLEX_API_KEY",), None, "if set, /v1/* requires `Authorization: Bearer KEY` (else 401)"),
    Option("--max-queue", ("REFLEX_MAX_QUEUE",), 64, "requests that may wait behind the one being served; more get "
           "429 with Retry-After", int),
    Option("--retry-after", ("REFLEX_RETRY_AFTER",), 1, "seconds in a 429's Retry-After header", int),
    Option("--device", ("REFLEX_DEVICE",), "auto", "the engine's --device", str, ("auto", "cpu", "cuda")),
    Option("--ctx-size", ("REFLEX_CTX_SIZE",), None, "the engine's -c (context length); default: the model's", int),
    Option("--engine-cmd", ("REFLEX_ENGINE_CMD",), None, "command that runs the engine, before `stdio MODEL ...` "
           "(shell words); default: `reflex` on PATH, else `python -m reflex_engine`"),
    Option("--on-engine-exit", ("REFLEX_ON_ENGINE_EXIT",), "exit", "when the engine child dies: `exit` (the sidecar "
           "exits with status 1 after --exit-delay) or `restart` (a new child; /healthz 204 until it is ready)",
           str, ("exit", "restart")),
    Option("--exit-delay", ("REFLEX_EXIT_DELAY",), 1.0, "seconds /healthz answers 503 after the engine died, "
           "before the sidecar exits", float),
    Option("--default-temperature", ("REFLEX_DEFAULT_TEMPERATURE",), 1.0, "temperature when a request gives none "
           "(OpenAI's default: 1)", float),
    Option("--default-top-p", ("REFLEX_DEFAULT_TOP_P",), 1.0, "top_p when a request gives none", float),
    Option("--default-max-tokens", ("REFLEX_DEFAULT_MAX_TOKENS",), None, "max_tokens when a request gives none; "
           "default: OpenAI's (chat: until the context is full; completions: 16)", int),
    Option("--log-level", ("REFLEX_LOG_LEVEL",), "warning", "uvicorn's log level (info shows each request)", str,
           ("critical", "error", "warning", "info", "debug")),
]


@dataclass
class Config:
    model: str
    host: str
    port: int
    health_port: int | None
    served_model_name: str | None
    api_key: str | None
    max_queue: int
    retry_after: int
    device: str
    ctx_size: int | None
    engine_cmd: str | None
    on_engine_exit: str
    exit_delay: float
    default_temperature: float
    default_top_p: float
    default_max_tokens: int | None
    log_level: str

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    @property
    def defaults(self) -> Defaults:
        return Defaults(self.default_temperature, self.default_top_p, self.default_max_tokens)

    def engine_argv(self) -> list[str]:
        if self.engine_cmd:
            prefix = shlex.split(self.engine_cmd)
        elif reflex := shutil.which("reflex"):
            prefix = [reflex]
        else:
            prefix = [sys.executable, "-m", "reflex_engine"]
        argv = [*prefix, "stdio", self.model, "--device", self.device]
        return argv + ["-c", str(self.ctx_size)] if self.ctx_size else argv


def parse(argv: list[str] | None = None, environ=os.environ) -> Config:
    parser = argparse.ArgumentParser(prog="reflex-openai", description="OpenAI-compatible HTTP server over one "
                                     "`reflex stdio` engine process. Every option can also be set by its environment "
                                     "variable.")
    for option in OPTIONS:
        env = next((environ[name] for name in option.env if environ.get(name)), None)
        default = option.default if env is None else _convert(parser, option, env)
        names = "/".join(option.env)
        if option.flag == "model":
            parser.add_argument("model", nargs="?" if default else None, default=default, help=f"{option.help} [{names}]")
        else:
            parser.add_argument(option.flag, type=option.type, default=default, choices=option.choices,
                                help=f"{option.help} [{names}; default: {option.default}]")
    args = parser.parse_args(argv)
    if args.max_queue < 0:
        parser.error("--max-queue must be >= 0")
    return Config(**vars(args))


def _convert(parser, option: Option, text: str):
    try:
        value = option.type(text)
    except ValueError:
        parser.error(f"{option.env[0]}={text!r}: not a valid {option.type.__name__}")
    if option.choices and value not in option.choices:
        parser.error(f"{option.env[0]}={text!r}: choose from {', '.join(option.choices)}")
    return value
