"""The `reflex` console entry. A cold process spends ~45-80 ms importing argparse and building
the CLI's parser; a command that will run a model on the GPU starts the driver's init before
that, reading its device off argv with the defaults the parser itself uses. Its end is os._exit,
as soon as the output is flushed: no interpreter teardown, and a one-shot command's model (its
device memory, pinned pages, context) left to the driver, which releases it all at the exit sooner
than closing it in the process does (H200, 2026-12-02: launch to exit 20 ms sooner on 0.6B, 21 ms
on 8B; docs/perf-notes.md, run 11)."""
import os
import sys

# each model-running command's --device default (cli.py's parsers take theirs from here)
DEVICE_DEFAULTS = {"generate": "auto", "system1": "auto", "stdio": "auto", "uds": "auto", "bench": "auto", "check": "cpu"}


def device_in(argv: list[str]) -> str | None:
    """The device this command line asks for, or None for a command that loads no model."""
    if not argv or argv[0] not in DEVICE_DEFAULTS:
        return None
    device = DEVICE_DEFAULTS[argv[0]]
    for i, arg in enumerate(argv[1:], 1):
        if arg == "--":
            break
        if arg == "--device" and i + 1 < len(argv):
            device = argv[i + 1]
        elif arg.startswith("--device="):
            device = arg.split("=", 1)[1]
    return device


def run() -> None:
    backend, device = None, device_in(sys.argv[1:])
    if device in ("cuda", "auto"):
        from .backends import BackendStart

        backend = BackendStart(device)
    from .cli import main

    sys.exit(main(backend=backend, exit_now=exit_now))


def exit_now(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more reaches it anyway
            pass
    os._exit(code)
