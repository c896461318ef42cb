"""Kernel arguments as Device.launch packs them: one buffer through cuLaunchKernel's `extra`, laid
out by the kernel's own parameter table (cuFuncGetParamInfo) or, where the driver has none, as the
C ABI lays it out. Checked without a GPU: the fake libcuda (tools/fake_libcuda.py) reads each
kernel's table from its C signature in kernels/*.cu and checks every launch's buffer against it."""
import pathlib
import re
import struct

import pytest

import reflex_engine
from reflex_engine.backends.cuda import driver
from reflex_engine.backends.cuda.device import Device
from reflex_engine.backends.cuda.params import FAMILIES, KERNELS, param_format
from reflex_engine.errors import ReflexError
from reflex_engine.sampling import SamplingParams
from fake_libcuda import kernel_formats
from test_goldens import paths

SOURCE = kernel_formats()
GREEDY = SamplingParams(temperature=0)


def test_every_kernel_in_the_source_has_its_c_signature_in_params_py():
    assert len(SOURCE) > 130 and SOURCE["matvec_x16_1_q6_K"] == "PPPPPPPPPiiiiPfPPPPP" and SOURCE["to_f16"] == "PPq"
    wrong = {name: (param_format(name), fmt) for name, fmt in SOURCE.items() if param_format(name) != fmt}
    assert not wrong, f"params.py (first) disagrees with kernels/*.cu (second): {wrong}"
    assert not set(KERNELS) - set(SOURCE), "params.py names kernels kernels/*.cu lacks"
    assert all(any(name.startswith(f + "_") for name in SOURCE) for f in FAMILIES)


# the launch shapes the host code states and the kernels were built with: (module, its name) -> (file, the kernel's)
SHARED_CONSTANTS = {
    ("ops", "MATVEC_MAX_TOKENS"): [("matvec.cu", "MATVEC_MAX_TOKENS"), ("matvec_x16.cu", "X16_MAX_TOKENS")],
    ("ops", "X16_DECODE_ROWS"): [("matvec_x16.cu", "X16_DECODE_ROWS")],
    ("ops", "X16_DECODE_BLOCKS_AN_SM"): [("matvec_x16.cu", "X16_DECODE_BLOCKS_AN_SM")],
    ("ops", "X16_DECODE_BLOCKS_AN_SM_64R"): [("matvec_x16.cu", "X16_DECODE_BLOCKS_AN_SM_64R")],
    ("ops", "X16_THREADS"): [("matvec_x16.cu", "X16_THREADS")],
    ("ops", "X16_MMA_ROWS"): [("matvec_x16_mma.cu", "XM_ROWS")],
    ("ops", "X16_MMA_WARPS"): [("matvec_x16_mma.cu", "XM_WARPS")],
    ("ops", "X16_BULK_STAGES"): [("matvec_x16_mma.cu", "XB_STAGES")],
    ("ops", "X16_BULK_BLOCKS_AN_SM"): [("matvec_x16_mma.cu", "XB_BLOCKS_AN_SM")],
    ("ops", "X16_BULK_WIDE_WARPS"): [("matvec_x16_mma.cu", "XB_WIDE_WARPS")],
    ("ops", "X16_BULK_WIDE_STAGES"): [("matvec_x16_mma.cu", "XB_WIDE_STAGES")],
    ("ops", "GEMM_FRAG_ROWS"): [("gemm_frag.cu", "GF_ROWS")],
    ("ops", "GEMM_FRAG_TOKENS"): [("gemm_frag.cu", "GF_TOKENS")],
    ("ops", "GEMM_FRAG_WARPS"): [("gemm_frag.cu", "GF_WARPS")],
    ("ops", "GEMM_TILE_WARPS"): [("gemm_tile.cu", "GT_WARPS")],
    ("ops", "GEMM_TILE_TOKENS"): [("gemm_tile.cu", "GT_TOKENS")],
    ("ops", "GEMM_TILE_STAGES"): [("gemm_tile.cu", "GT_STAGES")],
    ("ops", "GEMM_TILE_SPLITS"): [("gemm_tile.cu", "GT_SPLITS")],
    ("ops", "ATTENTION_MAX_SPLITS"): [("attention.cu", "ATTN_MAX_SPLITS")],
    ("ops", "ATTENTION_SPLIT_SLOTS"): [("attention.cu", "ATTN_SPLIT_MIN_SLOTS")],
    ("ops", "ATTENTION_CLUSTER_SPLITS"): [("attention.cu", "ATTN_CLUSTER")],
    ("ops", "ATTENTION_GROUP_MAX"): [("attention.cu", "ATTN_GROUP_MAX")],
    ("ops", "TOP_K_MAX"): [("sampling.cu", "TOPK_MAX")],
    ("experts", "MOE_WARPS"): [("moe.cu", "MOE_WARPS")],
    ("experts", "ROUTE_THREADS"): [("moe.cu", "ROUTE_THREADS")],
    ("experts", "ROUTE_MAX_EXPERTS"): [("moe.cu", "ROUTE_MAX_EXPERTS")],
    ("experts", "ROUTE_MAX_USED"): [("moe.cu", "ROUTE_MAX_USED")],
    ("experts", "ROUTE_MAX_GROUPS"): [("moe.cu", "ROUTE_MAX_GROUPS")],
    ("experts", "MLA_PREFILL_WARPS"): [("mla.cu", "MLA_PREFILL_WARPS")],
    ("experts", "MLA_MMA_SLOTS"): [("mla.cu", "MLA_MMA_SLOTS")],
    ("experts", "MLA_MMA_DV"): [("mla.cu", "MLA_MMA_DV")],
    ("experts", "MLA_DECODE_WARPS"): [("mla.cu", "MLA_DECODE_WARPS")],
    ("delta_net", "CONV_MAX_TAPS"): [("delta_net.cu", "CONV_MAX_TAPS")],
    ("delta_net", "DELTA_MAX_DK"): [("delta_net.cu", "DELTA_MAX_DK")],
    ("delta_net", "CHUNK"): [("delta_net.cu", "CHUNK_MAX")],
    ("delta_net", "SCAN_COLUMNS"): [("delta_net.cu", "SCAN_COLUMNS")],
    ("delta_net", "PREP_THREADS"): [("delta_net.cu", "PREP_THREADS")],
}


def kernel_constant(file: str, name: str) -> int:
    """An integer constant of kernels/<file>: a `constexpr int` (one of a list too) or a `#define`."""
    text = (pathlib.Path(reflex_engine.__file__).parent / "kernels" / file).read_text()
    found = re.findall(rf"^\s*(?:constexpr int [^;]*?\b{name}\s*=\s*(\d+)|#define {name} (\d+))", text, re.M)
    assert len(found) == 1, f"kernels/{file} defines {name} {len(found)} times"
    return int("".join(found[0]))


def test_the_launch_shapes_the_host_states_are_the_ones_the_kernels_were_built_with():
    from reflex_engine.backends.cuda import delta_net, experts, ops

    modules = {"ops": ops, "experts": experts, "delta_net": delta_net}
    wrong = {f"{module}.{name}": [(f"kernels/{file}", const, kernel_constant(file, const)) for file, const in sources]
             for (module, name), sources in SHARED_CONSTANTS.items()
             if any(getattr(modules[module], name) != kernel_constant(file, const) for file, const in sources)}
    assert not wrong, f"the host's launch shapes disagree with the kernels': {wrong}"


def generations(model, lengths=(1, 5, 16, 40, 70, 130)):
    for n in lengths:
        ids = [(7 * i + n) % model.config.n_vocab for i in range(n)]
        list(model.generate(ids, max_tokens=3, sampling=GREEDY, ignore_eos=True))
    sampled = SamplingParams(temperature=0.8, top_k=5, seed=1, repeat_penalty=1.2, presence_penalty=0.5)
    list(model.generate([1, 2, 3], max_tokens=2, sampling=sampled, ignore_eos=True, top_logprobs=2))


@pytest.mark.parametrize("arch,qtype", [("qwen3", "Q4_K"), ("qwen35", "Q8_0"), ("qwen3moe", "Q8_0"),
                                        ("deepseek2", "Q8_0")])
@pytest.mark.parametrize("graphs", ["1", "0"])
def test_every_launch_passes_one_buffer_the_size_of_its_kernels_parameters(fake, monkeypatch, arch, qtype, graphs):
    """Prompts that take every matmul and attention path, decode steps eager or captured (those
    through cuLaunchKernelEx), sampling with penalties and log-probabilities: the fake refuses any
    launch whose buffer is not its kernel's size, and each launch's letters are the C signature's."""
    monkeypatch.setenv("REFLEX_CUDA_GRAPHS", graphs)
    lib = fake()
    lib.launches = []
    model = reflex_engine.load(paths(arch, qtype)[0], device="cuda")
    generations(model)
    launched = {name for name, *_ in lib.launches}
    assert len(launched) > 15 and any(ex for *_, ex, _ in lib.launches) == (graphs == "1")
    assert {name: k.fmt for name, k in model.ops.device._kernels.items()} == {name: SOURCE[name] for name in launched}


def recorded(fake, **machine):
    lib = fake(**machine)
    lib.launches = []
    model = reflex_engine.load(paths("qwen3", "Q4_K")[0], device="cuda")
    generations(model, lengths=(16, 40))
    return lib.launches


@pytest.mark.parametrize("machine", [dict(param_info=False), dict(param_info_error=801)])
def test_a_driver_without_parameter_tables_gets_the_same_bytes(fake, machine):
    """A driver older than CUDA 12.4 (no cuFuncGetParamInfo), or one that will not answer: the
    natural layout, which is what the kernels' tables say."""
    assert recorded(fake, **machine) == recorded(fake)


def device(fake, **machine):
    lib = fake(**machine)
    return lib, Device(driver.Driver(driver.load_library()))


def test_the_buffer_follows_the_drivers_offsets_and_pads_as_c(fake):
    lib, dev = device(fake)
    lib.launches = []
    dev.launch("rope_yarn_f32", (1,), 32, (1, 2, 5, 6, 7, 3, 0, 128, 64, True, 1e6, 0.5, 1.0, 2.0, 3.0, 0.75, 192, 64))
    k = dev._kernels["rope_yarn_f32"]
    assert k.size.value == 128  # 2 pointers, an int, 4 bytes of padding, 4 pointers, 3 ints, 4 bytes, 6 doubles from 72, 2 ints
    assert bytes(dev._args)[16:32] == struct.pack("<i4xQ", 5, 6)
    assert bytes(dev._args)[72:88] == struct.pack("<dd", 1e6, 0.5)
    assert lib.launches[0][-1][-3:] == (struct.pack("<d", 0.75), struct.pack("<i", 192), struct.pack("<i", 64))
    lib.layouts["smoke"] = [(0, 8), (16, 8), (24, 4)]  # a table with a gap: its offsets, not the natural ones
    dev.launch("smoke", (1,), 32, (1, 2, 3))
    assert dev._kernels["smoke"].size.value == 28 and lib.launches[1][-1] == (struct.pack("<Q", 1), struct.pack("<Q", 2),
                                                                             struct.pack("<i", 3))


def test_a_kernel_that_takes_other_parameters_is_an_error_naming_it(fake):
    lib, dev = device(fake)
    lib.formats["add_f32"] = "PPPi"  # an image whose add_f32 takes an int where Reflex passes an int64
    with pytest.raises(ReflexError, match=r"^kernel add_f32 takes 4 parameters of \[8, 8, 8, 4\] bytes .* Reflex passes 4 \(PPPq\)"):
        dev.launch("add_f32", (1,), 256, (1, 2, 3, 4))
    lib.formats["swiglu_f32"], lib.formats["smoke"] = "PPPqP", "PPii"  # one parameter fewer, one more
    with pytest.raises(ReflexError, match=r"^kernel swiglu_f32 takes 5 parameters"):
        dev.launch("swiglu_f32", (1,), 256, (1, 2, 3, 4, 5, 6))
    with pytest.raises(ReflexError, match=r"^kernel smoke takes 4 parameters"):
        dev.launch("smoke", (1,), 256, (1, 2, 3))


@pytest.mark.parametrize("args, why", [((1, 2, 3), "expected 4 items"), ((1, 2, 3, 4, 5), "expected 4 items"),
                                       ((1, 2, 3, 4.0), "not an integer"), ((1, None, 3, 4), "not an integer"),
                                       ((-1, 2, 3, 4), "out of range")])
def test_arguments_that_do_not_fit_are_an_error_not_a_launch(fake, args, why):
    """A float for an int is refused, not reinterpreted; so are a wrong count and a negative pointer."""
    lib, dev = device(fake)
    lib.launches = []
    with pytest.raises(ReflexError, match=rf"^internal error: kernel take_rows_f32's arguments .* do not fit its parameters PPPi: .*{why}"):
        dev.launch("take_rows_f32", (1,), 256, args)
    assert lib.launches == []


def test_an_unknown_kernel_is_an_error(fake):
    _, dev = device(fake)
    with pytest.raises(ReflexError, match="kernel no_such_kernel is not in backends/cuda/params.py"):
        dev.launch("no_such_kernel", (1,), 32, ())
