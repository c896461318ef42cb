"""A decode step's launches, counted without a GPU: the engine runs on tools/fake_libcuda.py (every driver call
answered, no kernel run) with graphs off, so each launch a step makes is recorded, kernel by kernel. What fusing or
removing a short kernel saves shows here before a device call (runs 32 and 33 counted Qwen3.5's and DeepSeek's
steps so); what it costs on the GPU does not.

    PYTHONPATH=src python3 tools/step_launches.py MODEL [--sequence]

Prints the launches of one decode step, the count of each kernel and, with --sequence, the step's launches in
order. A greedy generation queues each step ahead of the host, so a step is what one more token adds.
"""
import argparse
import os
import sys
import tempfile
from collections import Counter

from fake_libcuda import FakeLibcuda


def install_fake_driver() -> FakeLibcuda:
    """The fake driver and a fake sm_90 image below the ctypes binding, for this process (tests/conftest.py's `fake`
    does the same for a test)."""
    from reflex_engine.backends.cuda import device as device_module
    from reflex_engine.backends.cuda import driver
    from reflex_engine.backends.cuda.image import ImageChoice

    lib = FakeLibcuda()
    image = os.path.join(tempfile.mkdtemp(prefix="reflex-step-launches-"), "sm_90.cubin")
    with open(image, "wb") as f:
        f.write(b"\x7fELF fake")
    driver.load_library = lambda name="libcuda.so.1": lib
    device_module.find_image = lambda cc: ImageChoice(image, "sass", "sm_90", 13000)
    return lib


def step_launches(model: str, lib: FakeLibcuda) -> list[str]:
    """The kernels one decode step of MODEL launches, in order, on the fake driver lib; REFLEX_CUDA_GRAPHS=0 in the
    environment (a replayed step is one graph launch)."""
    from reflex_engine.engine import ModelFile

    if os.environ.get("REFLEX_CUDA_GRAPHS") != "0":
        raise SystemExit("step_launches: set REFLEX_CUDA_GRAPHS=0 (a replayed step is one graph launch)")
    loaded = ModelFile(model).load(device="cuda", n_ctx=256)

    def generation(n: int) -> list[str]:
        lib.launches = []
        for _ in loaded.generate("hello there", max_tokens=n):
            pass
        return [launch[0] for launch in lib.launches]

    shorter, longer = generation(4), generation(5)
    return longer[len(shorter):]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--sequence", action="store_true", help="the step's launches in order too")
    args = ap.parse_args()
    os.environ["REFLEX_CUDA_GRAPHS"] = "0"
    from reflex_engine.errors import ReflexError

    try:
        step = step_launches(args.model, install_fake_driver())
    except ReflexError as e:
        sys.exit(f"step_launches: {e}")
    print(f"{len(step)} launches a decode step")
    for kernel, n in Counter(step).most_common():
        print(f"{n:5d}  {kernel}")
    if args.sequence:
        print(" ".join(step))


if __name__ == "__main__":
    main()
