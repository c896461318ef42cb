"""The CUDA backend's host-side bookkeeping, which needs no GPU: buffer addresses handed to the
driver, the regions carved at load, and the activation pool that gives every decode step the
same buffers."""
import mmap

import numpy as np
import pytest

from reflex_engine.backends.cuda.memory import ALIGN, Plan, Pool, Region, Tensor
from reflex_engine.backends.cuda.ops import buffer_address
from reflex_engine.errors import ReflexError


def test_buffer_address_of_writable_and_read_only_buffers(tmp_path):
    a = np.arange(10, dtype=np.float32)
    assert buffer_address(memoryview(a).cast("B")) == a.ctypes.data
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 64)
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = memoryview(m)[100:200]
        import ctypes

        assert ctypes.string_at(buffer_address(view), 100) == bytes(view)
        del view


def test_regions_carve_aligned_pieces_and_refuse_to_overflow():
    r = Region(1 << 20, 4 * ALIGN, "test")
    assert [r.carve(1), r.carve(ALIGN + 1)] == [1 << 20, (1 << 20) + ALIGN]
    with pytest.raises(ReflexError, match="the test region"):
        r.carve(2 * ALIGN)


def test_the_pool_recycles_a_buffer_per_width_when_its_tensor_dies():
    pool = Pool(Region(0, 1 << 20, "activation"), rows=8)
    a = Tensor(pool, 3, 100)
    first = a.ptr
    del a
    b = Tensor(pool, 8, 100)  # same width: the same buffer, whatever the row count
    c = Tensor(pool, 1, 100)  # a second live one of that width: a new buffer
    d = Tensor(pool, 1, 64)
    assert b.ptr == first and len({b.ptr, c.ptr, d.ptr}) == 3
    with pytest.raises(ReflexError, match="exceed"):
        Tensor(pool, 9, 100)


def test_the_memory_plan_names_what_does_not_fit():
    plan = Plan(weights=5_000_000_000, cache=3_000_000_000, activations=400_000_000, scratch=1_000_000)
    plan.check(free=9_000_000_000, device="GPU", n_ctx=4096)
    with pytest.raises(ReflexError, match=r"5.00 GB of weights plus 0.40 GB of buffers on GPU, which has 4.00 GB free"):
        plan.check(free=4_000_000_000, device="GPU", n_ctx=4096)
    with pytest.raises(ReflexError, match=r"a 4096-token context needs a 3.00 GB KV cache.*smaller --ctx-size"):
        plan.check(free=6_000_000_000, device="GPU", n_ctx=4096)


# -- giving the device back (through conftest.py's fake libcuda, which keeps the books) ----

def loaded_and_used(fake):
    import reflex_engine
    from reflex_engine.sampling import SamplingParams
    from test_goldens import paths

    lib = fake()
    model = reflex_engine.load(paths("llama", "F32")[0], device="cuda")  # tensors large enough to be pinned
    for _ in model.generate([1, 2, 3], max_tokens=4, sampling=SamplingParams(temperature=0), ignore_eos=True):
        pass
    assert lib.live and lib.registered and lib.contexts == 1  # something to give back
    return lib, model


def test_a_closed_model_gives_back_its_memory_pinned_pages_and_context(fake):
    lib, model = loaded_and_used(fake)
    assert lib._host  # the captured decode step's pinned buffer
    model.close()
    assert lib.live == {} and lib.registered == {} and lib._host == {} and lib.contexts == 0
    with pytest.raises(ReflexError, match="closed"):
        model.generate([1, 2], max_tokens=1)
    model.close()  # a second close does nothing (a double free would fail in the fake)


def test_a_backend_reserves_memory_for_one_model_only(fake):
    """A second reserve would leave the first one's regions allocated with nothing pointing at them."""
    from reflex_engine.backends import create_backend
    from reflex_engine.gguf import GGMLType
    from reflex_engine.ops import CacheShape

    lib = fake()
    ops = create_backend("cuda")
    ops.reserve([(GGMLType.F32, (1 << 20,))], CacheShape(1, 16, 64, 64), activation_width=4096)
    held = dict(lib.live)
    with pytest.raises(ReflexError, match="already holds"):
        ops.reserve([(GGMLType.F32, (1 << 20,))], CacheShape(1, 16, 64, 64), activation_width=4096)
    assert lib.live == held
    ops.close()
    assert lib.live == {}


def test_a_dropped_model_gives_its_memory_back_too(fake):
    import gc

    lib, model = loaded_and_used(fake)
    del model
    gc.collect()
    assert lib.live == {} and lib.registered == {} and lib.contexts == 0


def test_a_model_as_a_context_manager_closes_at_the_end(fake):
    import reflex_engine
    from test_goldens import paths

    lib = fake()
    with reflex_engine.load(paths("qwen3", "Q4_K")[0], device="cuda") as model:
        assert model.device == "cuda" and lib.live
    assert lib.live == {} and lib.contexts == 0


def test_closing_a_model_whose_device_failed_is_quiet(fake, capsys):
    lib, model = loaded_and_used(fake)
    from reflex_engine.backends.cuda.driver import CudaError

    def lost(*args):  # as after an error that loses the context: every later call fails
        raise CudaError("cuStreamSynchronize", 999, "CUDA_ERROR_UNKNOWN")

    model.ops.device.drv.cuStreamSynchronize = lost
    model.close()
    assert capsys.readouterr().err == ""
    with pytest.raises(ReflexError, match="closed"):
        model.logits([1, 2])
