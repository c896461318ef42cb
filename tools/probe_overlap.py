"""Where a cold `reflex generate -n 1` spends its time before the first token and after it: fresh
processes under variants, rounds interleaved, timed from outside as bench/cold_start.py times them
(launch -> first stdout bytes, launch -> exit), beside the Python floor when --floor-bin is given
(--teardown: and the floor holding 1 or 4 GB of device memory, or the model file pinned, for what
each adds to the driver's teardown at the exit; --floor-init: the floor's driver init alone, its steps
marked as the "init marked" variants mark Reflex's).

    python3 tools/probe_overlap.py MODEL [--n 10] [--prompt-tokens 16] [--floor-bin DIR [--teardown] [--floor-init]] [--python PY]
        [--variants "as is,init marked"]

Variants: the engine as it is; compiled from source in each process (no bytecode); with Python's cyclic collector off; the model given back in the process before
its exit, each step timed; marked (the moments after the driver's init on the result line: the
backend handed over, the model loaded, the pass begun, ms since the import; the patch imports the
engine first, so the init starts later); every copy landed before the pass starts; the driver's
default work and copy queues (8 each) instead of Reflex's one and one; the driver's init with its
steps marked, beside the host path or alone before it. (Earlier variants and what they showed are in docs/perf-notes.md.)
A throwaway measurement tool: the engine path is what it is, monkeypatched here per variant.
"""
import argparse
import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bench"))
from cold_start import DRIVER_SETTINGS, Energy, Row, compile_bytecode, run_once  # noqa: E402 (bench/ is not a package)

MARKS = """
from reflex_engine import backends, engine, timing
MARKS = {}
def marking(name, f):
    def call(*args, **kwargs):
        if name.startswith("begin"):
            MARKS.setdefault(name[6:] + "_ms", timing.since_start_ms())
        out = f(*args, **kwargs)
        MARKS.setdefault(name + "_ms", timing.since_start_ms())
        return out
    return call
backends.BackendStart.ops = marking("ops_ready", backends.BackendStart.ops)
engine.ModelFile.load = marking("load_end", engine.ModelFile.load)
engine.Model._next_logits = marking("begin_pass_start", engine.Model._next_logits)
reported = timing.reported_phases
timing.reported_phases = lambda phases: {**reported(phases), **{k: round(v, 3) for k, v in MARKS.items()}}
"""
# the driver's init as BackendStart._init_cuda runs it, its steps marked on the result line (ms since the
# init thread began: the library and cuInit, the primary context, device.py imported); "alone": the main
# thread waits for the init before anything else, so nothing runs beside it
INIT_MARKS = """
import time
from reflex_engine import backends, timing
INIT = {}
def marked_init(self):
    start = time.perf_counter()
    mark = lambda name: INIT.setdefault(name, round((time.perf_counter() - start) * 1e3, 2))
    try:
        drv = self._driver.Driver(self._driver.load_library())
        drv.init()
        mark("init_cuinit_ms")
        held = self._driver.hold_primary_context(drv)
        mark("init_context_ms")
        from reflex_engine.backends.cuda.device import Device
        mark("init_import_ms")
        self._cuda = Device(drv)
        if held is not None:
            drv.cuDevicePrimaryCtxRelease_v2(held)
    except BaseException as e:
        self._error = e
    self.cuda_init_ms = (time.perf_counter() - start) * 1e3
    self.ready_ms = timing.since_start_ms()
backends.BackendStart._init_cuda = marked_init
reported = timing.reported_phases
timing.reported_phases = lambda phases: {**reported(phases), **INIT}
"""
INIT_ALONE = """
made = backends.BackendStart.__init__
def joined(self, *args, **kwargs):
    made(self, *args, **kwargs)
    if self._thread is not None:
        self._thread.join()
backends.BackendStart.__init__ = joined
"""
# the model given back inside the process before os._exit, each step timed onto stderr (a REFLEX_TEARDOWN line the
# probe adds to the run's phases): the pages unpinned, the device memory freed, the module, stream and context let go;
# what the exit then costs outside is the kernel's share
TEARDOWN_TIMED = """
import sys, time
from reflex_engine import launch
from reflex_engine.backends import BackendStart
def timed_run():  # launch.run's order: the driver's init first, the engine's imports beside it
    backend = BackendStart(launch.device_in(sys.argv[1:]))
    from reflex_engine import cli, engine
    held, load = [], engine.ModelFile.load
    def holding(self, *args, **kwargs):
        held.append(load(self, *args, **kwargs))
        return held[-1]
    engine.ModelFile.load = holding
    def timed_exit(code):
        ops, marks = held[0].ops, [("start", time.perf_counter())]
        ops.weights_arrived()
        ops._upload.close()
        marks.append(("teardown_unpin_ms", time.perf_counter()))
        ops.device.synchronize()
        for region in ops._allocations:
            ops.device.free(region.base)
        ops._allocations = []
        marks.append(("teardown_free_ms", time.perf_counter()))
        ops.device.close()
        marks.append(("teardown_context_ms", time.perf_counter()))
        sys.stderr.write("REFLEX_TEARDOWN " + " ".join(f"{k}={(t - marks[i][1]) * 1e3:.2f}" for i, (k, t) in enumerate(marks[1:])) + "\\n")
        launch.exit_now(code)
    sys.exit(cli.main(backend=backend, exit_now=timed_exit))
launch.run = timed_run
"""
VARIANTS = {
    "as is": ("", {}),
    "as is, marked": (MARKS, {}),
    "every copy landed before the pass, marked": (MARKS + """
from reflex_engine.backends.cuda import ops
commit = ops.CudaOps.commit_weights
def patched(self):
    n = commit(self)
    for i in range(len(self._upload._chunks_of)):
        self._upload.wait(i)
    return n
ops.CudaOps.commit_weights = patched
""", {}),
    # Python's cyclic collector off for the whole process: does a collection land on the first token's path?
    "gc off": ("import gc\ngc.disable()\n", {}),
    "gc off, marked": ("import gc\ngc.disable()\n" + MARKS, {}),
    "teardown timed": (TEARDOWN_TIMED, {}),
    # every module compiled from source, as where PYTHONDONTWRITEBYTECODE keeps a checkout's bytecode from being written
    "from source": ("", {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "/tmp/reflex-no-pycache"}),
    "8 work + 8 copy queues": ("", {"CUDA_DEVICE_MAX_CONNECTIONS": "8", "CUDA_DEVICE_MAX_COPY_CONNECTIONS": "8"}),
    "init marked": (INIT_MARKS, {}),
    "init marked, alone": (INIT_MARKS + INIT_ALONE, {}),
}
DEFAULT = "as is,init marked,init marked, alone"
# the floor's driver init alone, its steps marked as INIT_MARKS marks Reflex's (ms since the library's load)
FLOOR_INIT_MARKED = """
import ctypes, time
from ctypes import byref, c_int, c_void_p
start = time.perf_counter()
mark = lambda: round((time.perf_counter() - start) * 1e3, 2)
cu = ctypes.CDLL("libcuda.so.1")
dev, ctx = c_int(), c_void_p()
assert cu.cuInit(0) == 0
cuinit = mark()
assert cu.cuDeviceGet(byref(dev), 0) == 0 and cu.cuDevicePrimaryCtxRetain(byref(ctx), dev) == 0
context = mark()
print(f"FLOOR_OK init_cuinit_ms={cuinit} init_context_ms={context}", flush=True)
"""
# the floor, holding more before its kernel: what each costs the driver's teardown at the exit (the pinned
# file: the model, all of it, as Reflex's upload pins it)
FLOOR_HOLDING = """
import ctypes, mmap, os, runpy, sys
cu = ctypes.CDLL("libcuda.so.1")
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
assert cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0 and cu.cuCtxSetCurrent(ctx) == 0
if DEVICE_BYTES:
    assert cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(DEVICE_BYTES)) == 0
if PIN:
    from reflex_engine.backends.cuda.ops import buffer_address
    fd = os.open(PIN, os.O_RDONLY)
    kept = mmap.mmap(fd, 0, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
    size = len(kept) // mmap.PAGESIZE * mmap.PAGESIZE
    cu.cuMemHostRegister_v2.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)
    assert cu.cuMemHostRegister_v2(buffer_address(memoryview(kept)), size, 8) == 0  # READ_ONLY
sys.argv = ["floor.py", CUBIN]
runpy.run_path(FLOOR, run_name="__main__")
"""
PHASES = ("teardown_unpin_ms", "teardown_free_ms", "teardown_context_ms", "cuda_ready_ms", "cuda_init_ms", "init_cuinit_ms", "init_context_ms", "init_import_ms", "backend_init_ms", "model_load_ms",
          "upload_ms", "prompt_eval_ms", "first_token_ms", "ops_ready_ms", "load_end_ms", "pass_start_ms")


def variant_names(text: str) -> list[str]:
    """--variants' names: comma-separated, where a name may hold ", " itself."""
    return [n.strip() for n in re.split(r",(?=[^ ])", text)]


def rows(args) -> list[Row]:
    prompt = " ".join(["hello"] * args.prompt_tokens)
    out = []
    if args.floor_bin:
        cubin, floor_py = os.path.join(args.floor_bin, "floor.cubin"), os.path.join(os.path.dirname(HERE), "bench", "floor.py")
        for env, suffix in (({}, ""), (DRIVER_SETTINGS, ", Reflex's driver settings")):
            out.append(Row(f"floor, python3 + ctypes{suffix}", "", "", [args.python, floor_py, cubin], "line:FLOOR_OK", env))
        if args.floor_init:
            out.append(Row("floor, python3 + ctypes, Reflex's driver settings, the init alone, marked", "", "",
                           [args.python, "-c", FLOOR_INIT_MARKED], "line:FLOOR_OK", DRIVER_SETTINGS))
        if args.teardown:
            for label, device_bytes, pin in (("1 GB of device memory", 1 << 30, ""), ("4 GB of device memory", 4 << 30, ""),
                                             ("the model file pinned", 0, args.model)):
                code = (FLOOR_HOLDING.replace("DEVICE_BYTES", str(device_bytes)).replace("PIN", repr(pin))
                        .replace("CUBIN", repr(cubin)).replace("FLOOR", repr(floor_py)))
                out.append(Row(f"floor, python3 + ctypes, Reflex's driver settings, holding {label}", "", "",
                               [args.python, "-c", code], "line:FLOOR_OK", {**DRIVER_SETTINGS, "PYTHONPATH": SRC}))
    names = variant_names(args.variants)
    for name in names:
        patch, env = VARIANTS[name]
        code = patch + "\nfrom reflex_engine.launch import run\nrun()\n"
        out.append(Row(f"Reflex {name}", "m", str(args.prompt_tokens),
                       [args.python, "-c", code, "generate", args.model, prompt, "--device", "cuda", "--temp", "0", "-n", "1",
                        "--ignore-eos"], "bytes", {"PYTHONPATH": SRC, **env}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--floor-bin", help="a folder with floor.cubin (bench/floor_kernel.cu): adds the Python floor's rows")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--teardown", action="store_true", help="with --floor-bin: the floor holding device memory or the pinned model")
    ap.add_argument("--floor-init", action="store_true", help="with --floor-bin: the floor's driver init alone, its steps marked")
    ap.add_argument("--variants", default=DEFAULT, help=f"comma-separated, of: {'; '.join(VARIANTS)}")
    ap.add_argument("--raw", help="also write every run (its row, times and phases) to this JSON-lines file")
    args = ap.parse_args()
    unknown = [n for n in variant_names(args.variants) if n not in VARIANTS]
    if unknown:
        sys.exit(f"probe_overlap: unknown variant {unknown[0]!r} (choose from: {'; '.join(VARIANTS)})")
    try:  # before the runs: a path that cannot be written is one line, not a traceback after minutes
        raw = open(args.raw, "w") if args.raw else None
    except OSError as e:
        sys.exit(f"probe_overlap: cannot write {args.raw}: {e.strerror}")
    compile_bytecode(args.python)  # as the harness runs Reflex (but for the "from source" variant)
    table, energy = rows(args), Energy()
    runs: dict[str, list[dict]] = {row.name: [] for row in table}
    for _ in range(args.n):  # rounds interleaved
        for row in table:
            run = run_once(row, energy)
            for line in run["stderr_tail"].splitlines() + run["stdout_tail"].splitlines():  # "teardown timed", the marked floor
                if line.startswith(("REFLEX_TEARDOWN ", "FLOOR_OK init_")):
                    run["phases"].update((k, float(v)) for k, v in (f.split("=") for f in line.split()[1:]))
            runs[row.name].append(run)
    if raw is not None:
        with raw:
            for name, rs in runs.items():
                for r in rs:
                    raw.write(json.dumps({"row": name, **r}) + "\n")
    print(f"{args.prompt_tokens}-token prompt, n={args.n} interleaved; first and exit from the launch, phases from the import (p50 ms)")
    print("| process | n | first | exit | exit - first | " + " | ".join(PHASES) + " |")
    print("|---" * (5 + len(PHASES)) + "|")
    for name, rs in runs.items():
        ok = [r for r in rs if r["ok"]]
        if not ok:
            print(f"| {name} | 0 | {rs[0]['stderr_tail'][-300:]!r} |")
            continue
        med = lambda vs: f"{statistics.median(vs):.1f}" if vs else "–"  # noqa: E731
        cells = [med([r["first_ms"] for r in ok]), med([r["exit_ms"] for r in ok]), med([r["exit_ms"] - r["first_ms"] for r in ok])]
        cells += [med([r["phases"][k] for r in ok if k in r["phases"]]) for k in PHASES]
        print(f"| {name} | {len(ok)} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
