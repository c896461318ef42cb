"""What the CUDA backend says when it cannot run: no driver, no GPU, a driver too old, no SASS
with PTX JIT disabled, a model or a context larger than the GPU's free memory. Each is one line
on stderr and a non-zero exit. Where no GPU exists they are simulated below the binding: a fake
libcuda answers the driver calls, so everything above it (Device, CudaOps, engine, CLI) is real."""
import ctypes
import ctypes.util

import pytest

from reflex_engine import cli
from reflex_engine.backends import create_backend
from reflex_engine.backends.cuda import device as device_module
from reflex_engine.backends.cuda import driver
from reflex_engine.errors import CudaUnavailable, ReflexError
from test_goldens import paths

MODEL = paths("qwen3", "Q4_K")[0]


def run(capsys, *argv):
    code = cli.main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="this machine has an NVIDIA driver")
def test_no_driver_is_one_line_and_auto_falls_back_to_the_cpu(capsys):
    code, err = run(capsys, "generate", MODEL, "hi", "--device", "cuda", "-n", "1")
    assert code == 1 and err == ["reflex: error: no NVIDIA driver on this machine (libcuda.so.1 not found); use --device cpu"]
    assert create_backend("auto").name == "cpu"


def test_a_driver_without_a_gpu(fake, capsys):
    fake(init_error=100)
    code, err = run(capsys, "generate", MODEL, "hi", "--device", "cuda", "-n", "1")
    assert code == 1 and len(err) == 1 and "no CUDA GPU found" in err[0]
    assert create_backend("auto").name == "cpu"


def test_a_driver_too_old_for_the_kernels(fake, capsys):
    fake(version=12040, min_driver=13000)
    code, err = run(capsys, "system1", MODEL, "hi", "--candidate", "a", "--device", "cuda")
    assert code == 1 and err == ["reflex: error: the NVIDIA driver supports CUDA 12.4; these kernels need CUDA 13.0 or newer: update the driver"]


def test_only_ptx_for_this_gpu_with_the_jit_disabled(fake, capsys, monkeypatch):
    fake(kind="ptx", capability=(12, 9))
    monkeypatch.setenv("CUDA_DISABLE_PTX_JIT", "1")
    with pytest.raises(CudaUnavailable, match=r"no SASS for Fake GPU \(sm_129\) and PTX JIT is disabled"):
        create_backend("cuda")
    code, err = run(capsys, "generate", MODEL, "hi", "--device", "cuda")
    assert code == 1 and len(err) == 1


def test_a_model_larger_than_free_memory_is_refused_before_allocating(fake, capsys):
    lib = fake(free=1 << 20)
    code, err = run(capsys, "generate", MODEL, "hi", "--device", "cuda", "-n", "1")
    assert code == 1 and len(err) == 1
    assert "of weights plus" in err[0] and "which has 0.00 GB free" in err[0]
    assert lib.allocated == 0


def test_a_context_too_large_for_memory_names_the_cache_and_the_way_out(fake, capsys):
    lib = fake(free=2 << 30)
    code, err = run(capsys, "generate", MODEL, "hi", "--device", "cuda", "-c", str(1 << 24))
    assert code == 1 and len(err) == 1
    assert f"a {1 << 24}-token context needs a" in err[0] and "pass a smaller --ctx-size" in err[0]
    assert lib.allocated == 0


def test_driver_errors_name_the_call_and_the_result(fake):
    lib = fake()
    lib.cuMemAlloc_v2 = lambda ptr, n: 2
    with pytest.raises(ReflexError, match=r"^CUDA driver call cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY \(2\)$"):
        driver.Driver(lib).alloc(100)


def test_an_install_without_kernels(fake, capsys, monkeypatch, tmp_path):
    from reflex_engine.backends.cuda import image

    fake()
    monkeypatch.setattr(device_module, "find_image", lambda cc: image.find_image(cc, str(tmp_path / "no-image")))
    code, err = run(capsys, "generate", MODEL, "hi", "--device", "cuda")
    assert code == 1 and len(err) == 1 and "this install has no CUDA kernels" in err[0]
    assert create_backend("auto").name == "cpu"


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek3"])
def test_an_architecture_without_cuda_kernels_is_one_line_on_cuda_and_takes_the_cpu_on_auto(fake, capsys, monkeypatch, arch):
    import reflex_engine
    from reflex_engine.arch import get_arch

    fake()
    moe = paths(arch, "Q8_0")[0]
    name = {"deepseek3": "deepseek2"}.get(arch, arch)  # the GGUF architecture of the V3-style file
    monkeypatch.setattr(get_arch(name), "BACKENDS", ("cpu",))  # as if it had no CUDA kernels (both have them now)
    code, err = run(capsys, "generate", moe, "hi", "--device", "cuda", "-n", "1")
    assert code == 1 and err == [f"reflex: error: {name} runs on the CPU backend for now: use --device cpu"]
    assert create_backend("auto").name == "cuda"  # this fake machine has a usable GPU
    assert reflex_engine.load(moe, device="auto").ops.name == "cpu"
    code, err = run(capsys, "generate", moe, "hi", "--device", "auto", "-n", "1")
    assert code == 0 and err == []


@pytest.mark.parametrize("usable", [True, False])
def test_the_early_init_holds_no_context_beyond_the_backends(fake, usable):
    """The init thread makes the primary context before the Device exists and lets go of its own hold
    once the Device has one, or has failed: closing the backend is the context's last release."""
    lib = fake(**({} if usable else {"version": 12040}))
    if not usable:
        with pytest.raises(ReflexError, match="update the driver"):
            create_backend("cuda")
        assert lib.contexts == 0
        return
    ops = create_backend("cuda")
    assert lib.contexts == 1
    ops.close()
    assert lib.contexts == 0
