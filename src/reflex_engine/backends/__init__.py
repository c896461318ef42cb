"""Backends implementing the Ops protocol (reflex_engine.ops), and starting them early.

A cold process spends ~150-250 ms in the CUDA driver (cuInit, the primary context, the kernel
image) before it can use the GPU. A BackendStart begins that on a thread at once, so the caller
opens the GGUF, builds the tokenizer and encodes the prompt meanwhile (ctypes releases the GIL
for every driver call); `BackendStart.ops()` then joins it.
"""
from __future__ import annotations

import sys
import threading
import time

from ..errors import CudaUnavailable, ReflexError
from ..timing import since_start_ms

DEVICES = ("cpu", "cuda", "auto")
INIT_SWITCH_INTERVAL_S = 1e-4


class BackendStart:
    """A backend being created: for `cuda` and `auto` the driver initialises on a thread from
    the moment this exists. `auto` is CUDA when a GPU, its driver and this install's kernels are
    there, else the CPU."""

    def __init__(self, device: str):
        if device not in DEVICES:
            raise ReflexError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})")
        self.device = device
        self.started_ms = since_start_ms()  # when the driver's init began, since reflex_engine's import
        self.cuda_init_ms: float | None = None  # the driver's time on the thread
        self.ready_ms: float | None = None  # when it ended, since reflex_engine's import
        self._cuda = self._error = None
        self._thread = None
        if device != "cpu":
            # Only the driver binding is imported before the thread starts (device.py's imports, ~20
            # ms on an H200 host, once delayed the init by as much); on the thread cuInit and the
            # primary context come first, device.py's import after them (see _init_cuda).
            from .cuda import driver

            self._driver = driver
            driver.configure_driver_environment()  # before the thread: setenv is not safe beside getenv
            # Each time a driver call returns, the init thread needs the GIL back from the busy main
            # thread, which yields it only every switch interval (5 ms): ~20 calls, up to ~100 ms.
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(INIT_SWITCH_INTERVAL_S)
            self._thread = threading.Thread(target=self._init_cuda, name="reflex-cuda-init", daemon=True)
            self._thread.start()

    def _init_cuda(self) -> None:
        start = time.perf_counter()
        try:
            drv = self._driver.Driver(self._driver.load_library())
            drv.init()
            # The primary context before device.py's imports (~10 ms), which the main thread has usually
            # done by then, on its way to ops(): after cuInit, the context is the init's longest step
            # (H200: cuInit ~107 ms, the context ~65 ms). Device retains it again; this hold ends then.
            held = self._driver.hold_primary_context(drv)
            try:
                from .cuda.device import Device

                self._cuda = Device(drv)
            finally:
                if held is not None:
                    drv.cuDevicePrimaryCtxRelease_v2(held)
        except BaseException as e:  # re-raised on the caller's thread by ops()
            self._error = e
        self.cuda_init_ms = (time.perf_counter() - start) * 1e3
        self.ready_ms = since_start_ms()

    def ops(self, cpu_only: str | None = None):
        """The backend, once ready (blocks until the driver's init ends). `cpu_only`: why the model
        needs the CPU backend, the error for `cuda`; `auto` then takes the CPU whatever the GPU."""
        if self._thread is not None:
            from .cuda import CudaOps  # while the driver may still be initialising

            self._thread.join()
            sys.setswitchinterval(self._switch_interval)
        if cpu_only is not None and self.device == "cuda":
            raise ReflexError(cpu_only)
        if self._thread is not None and cpu_only is None:
            if self._error is None:
                device, self._cuda = self._cuda, None  # a Device serves one CudaOps, whose close() closes it
                return CudaOps(device)
            if not (isinstance(self._error, CudaUnavailable) and self.device == "auto"):
                raise self._error
        from .cpu import CpuOps  # imports numpy: only once a backend is actually wanted

        return CpuOps()


def create_backend(device: str):
    """The backend for `device`, created now (no overlap with other work)."""
    return BackendStart(device).ops()


def started(device: str | BackendStart) -> BackendStart:
    """A device name's backend, starting now; a BackendStart as it is."""
    return BackendStart(device) if isinstance(device, str) else device
