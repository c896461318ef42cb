"""Per-phase wall-clock timings, measured from the moment reflex_engine was first imported."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager

from . import PROCESS_T0


class Timings:
    def __init__(self):
        self.phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[f"{name}_ms"] = self.phases.get(f"{name}_ms", 0.0) + (time.perf_counter() - start) * 1e3

    def fork(self) -> "Timings":
        """A copy to extend with one request's phases, keeping the load phases."""
        copy = Timings()
        copy.phases = dict(self.phases)
        return copy

    def mark(self, name: str) -> None:
        """Record now, as ms since the process began running reflex code."""
        self.phases[f"{name}_ms"] = since_start_ms()


# in this order on result lines: where the process was when reflex began, the host path, the
# driver's init and the part of it the host path hid, the weights' trip, then the request
# (constraint_ms: the main thread's time on a constraint, its vocabulary's build included where
# the thread building it had not ended when the first mask was wanted)
REPORTED_PHASES = ("interpreter_ms", "gguf_open_ms", "tokenizer_ms", "cuda_start_ms", "cuda_init_ms", "cuda_ready_ms",
                   "cuda_init_hidden_ms", "backend_init_ms", "model_load_ms", "reserve_ms", "upload_ms", "upload_gb_per_s",
                   "kv_import_ms", "constraint_ms", "prompt_eval_ms", "first_token_ms", "kv_export_ms", "total_ms")


def reported_phases(phases: dict) -> dict:
    """The phases result lines (CLI and IPC) carry, rounded to microseconds, with interpreter_ms:
    the process's age when reflex_engine was imported (the kernel's clock: 10 ms steps)."""
    phases = {"interpreter_ms": process_age_ms() - since_start_ms(), **phases}
    return {k: round(phases[k], 3) for k in REPORTED_PHASES if k in phases}


def since_start_ms() -> float:
    return (time.perf_counter() - PROCESS_T0) * 1e3


def process_age_ms() -> float:
    """Milliseconds since the kernel started this process (Linux /proc), else since import."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            start_ticks = int(fh.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime", "rb") as fh:
            uptime = float(fh.read().split()[0])
        return (uptime - start_ticks / os.sysconf("SC_CLK_TCK")) * 1e3
    except (OSError, ValueError, IndexError):
        return since_start_ms()
