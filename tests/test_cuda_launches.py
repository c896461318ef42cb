"""Which kernels a pass launches on the CUDA backend, counted below the binding (conftest.py's
fake libcuda; everything above it is real): weights reading one x share a launch where they take
one kernel (q, k and v; gate and up), q and k are rotated together, a short prompt's attention
needs no merge, the short-prompt GEMM splits only weights too small to fill the GPU, wide rows take
the tensor-core kernels, and a pass whose shape was seen before is captured as a CUDA graph and
replayed after (test_cuda_graphs.py checks on a GPU that a replay computes what eager launches do),
each replay reading its own ints even when queued before the one ahead of it ran. On the tiny Qwen3
fixture: 2 layers of 256, q 256 rows, k and v 128 each, gate, up and down 256, the tied head 384,
all Q4_K."""
import ctypes
from collections import Counter

import numpy as np
import pytest

import reflex_engine
from reflex_engine.backends.cuda import device as device_module
from reflex_engine.backends.cuda import driver, memory
from reflex_engine.backends.cuda import ops as ops_module
from reflex_engine.backends.cuda.params import param_format
from reflex_engine.gguf.constants import GGML_BLOCK, GGMLType
from reflex_engine.ops import Batch, CacheShape, Rope, RopeMode, Routes
from reflex_engine.sampling import SamplingParams
from test_cuda_errors import MODEL


@pytest.fixture
def record(fake, monkeypatch):
    """The model on the fake GPU, eager (no decode graph), and the names of its launches."""
    fake()
    monkeypatch.setenv("REFLEX_CUDA_GRAPHS", "0")
    names: list[str] = []
    launch = device_module.Device.launch

    def recording(self, name, *args, **kw):
        names.append(name)
        return launch(self, name, *args, **kw)

    monkeypatch.setattr(device_module.Device, "launch", recording)
    model = reflex_engine.load(MODEL, device="cuda")
    return model, names


@pytest.fixture
def graphed(fake, monkeypatch):
    """The model on the fake GPU with graphs on, and what its passes did: "capture" and "replay"
    for each graph captured and launched."""
    lib = fake()
    monkeypatch.delenv("REFLEX_CUDA_GRAPHS", raising=False)
    events: list[str] = []
    lib.cuStreamBeginCapture_v2 = lambda *a: events.append("capture") or 0
    lib.cuGraphLaunch = lambda *a: events.append("replay") or 0
    lib.cuGraphExecDestroy = lambda *a: events.append("destroy") or 0
    return reflex_engine.load(MODEL, device="cuda"), events


def prompt_pass(model, events, ids) -> str:
    """How the prompt's pass ran: "eager", "captured" (then launched) or "replayed"."""
    events.clear()
    for _ in model.generate(ids, max_tokens=1, sampling=SamplingParams(temperature=0), ignore_eos=True):
        pass
    return "captured" if "capture" in events else "replayed" if "replay" in events else "eager"


def test_a_prompt_length_seen_before_is_captured_then_replayed(graphed):
    model, events = graphed
    a, b = list(range(1, 17)), list(range(1, 12))
    assert [prompt_pass(model, events, ids) for ids in (a, b, a[::-1], b, a, b)] == \
        ["eager", "eager", "captured", "captured", "replayed", "replayed"]


def test_the_graphs_used_last_are_kept_and_a_decode_steps_outlive_prompts(graphed):
    model, events = graphed
    lengths = [16, 11, 5, 9, 3]
    for n in lengths:
        assert [prompt_pass(model, events, list(range(1, n + 1))) for _ in range(2)] == ["eager", "captured"]
    assert events.count("destroy") == 1  # the fifth shape's capture destroyed the first's graph
    assert [shape[0] for shape in model._forward.graphs] == lengths[1:]
    # 16 again: every graph kept was used since it last came (five shapes in turn, four kept)
    assert [prompt_pass(model, events, list(range(1, 17))) for _ in range(2)] == ["eager", "captured"]
    for _ in model.generate([1, 2, 3], max_tokens=6, sampling=SamplingParams(temperature=0), ignore_eos=True):
        pass  # the decode steps' one graph
    for n in lengths:
        for _ in range(2):
            prompt_pass(model, events, list(range(1, n + 1)))
    assert [shape[0] for shape in model._forward.graphs] == [1, 5, 9, 3]


def test_prompts_cycling_through_more_shapes_than_fit_keep_the_graphs_they_have(graphed):
    """Two graphs free beside the decode steps' and four prompt lengths in turn (as a long prompt's
    passes come): two are captured and replayed after, the others stay eager, rather than each
    capture destroying the graph needed next."""
    model, events = graphed
    for _ in model.generate([1, 2], max_tokens=6, sampling=SamplingParams(temperature=0.8, seed=1), ignore_eos=True):
        pass
    for _ in model.generate([1, 2, 3, 4], max_tokens=6, sampling=SamplingParams(temperature=0), ignore_eos=True):
        pass
    assert [shape[0] for shape in model._forward.graphs] == [1, 1]
    lengths = [3, 5, 7, 9]
    cycles = [[prompt_pass(model, events, list(range(1, n + 1))) for n in lengths] for _ in range(4)]
    assert cycles == [["eager"] * 4, ["captured", "captured", "eager", "eager"]] + [["replayed", "replayed", "eager", "eager"]] * 2
    assert [shape[0] for shape in model._forward.graphs] == [1, 1, 3, 5]


def wait_for_choices(model, events) -> None:
    """Record "wait" where the host waits for a choice the device copies back (cuda/sampler.py Readback)."""
    def synchronize(event):
        readback = model.ops._readback
        if readback is not None and event.value in [e.value for e in readback.events]:
            events.append("wait")

    model.ops.device.drv.cuEventSynchronize = synchronize


def test_a_greedy_decode_queues_each_pass_before_the_host_reads_the_token_it_follows(graphed):
    """The device chooses greedily on its own and the next pass reads the choice there (ops.SAMPLED),
    so each pass is queued before the host waits for the token before it. The prompt's choice stays
    there too, so every decode step has one shape (a token on the device), the first step's included:
    captured at a process's second step and replayed at every position after, the next generation's
    first step too (runs 22-23: a first step reading the host's token was a shape of its own, eager in a
    one-shot generation, and left eager at 4,096, where its capture would destroy a prompt's graph)."""
    model, events = graphed
    wait_for_choices(model, events)
    greedy = SamplingParams(temperature=0)
    for _ in model.generate([1, 2, 3], max_tokens=6, sampling=greedy, ignore_eos=True):
        pass
    # the prompt's choice, the pass of token 1 eager, then 2-5 replayed; the last token's pass never runs
    assert events == ["wait", "capture", "replay", "wait", "replay", "wait", "replay", "wait", "replay", "wait", "wait"]
    events.clear()
    for _ in model.generate([4, 5, 6, 7], max_tokens=6, sampling=greedy, ignore_eos=True):
        pass
    # a new prompt length (eager), then every step's pass replayed, each queued before the token before it is read
    assert events == ["wait", "replay"] + ["replay", "wait"] * 4 + ["wait"]
    assert [shape[0] for shape in model._forward.graphs] == [1]


def test_a_sampled_decode_waits_for_each_token_before_its_pass(graphed):
    model, events = graphed
    wait_for_choices(model, events)
    for _ in model.generate([1, 2, 3], max_tokens=6, sampling=SamplingParams(temperature=0.8, seed=1), ignore_eos=True):
        pass
    assert events == ["capture", "replay", "replay", "replay", "replay"]  # tokens 1-4's passes; token 0's eager


def test_a_pass_wanting_more_logits_rows_than_the_graph_pool_holds_stays_eager(graphed):
    model, events = graphed
    for _ in range(3):
        model.logits(list(range(1, 17)))  # 16 rows of logits: the graph pool's buffers hold 8
    assert "capture" not in events and "replay" not in events
    model.logits(list(range(1, 9)))
    model.logits(list(range(1, 9)))
    assert events == ["capture", "replay"]


def matmul_launches(names):
    return Counter(n for n in names if n.startswith(("gemm", "matvec")))


def test_a_prompt_pass_shares_launches_between_weights_of_one_kernel(record):
    model, names = record
    names.clear()
    for _ in model.generate(list(range(1, 17)), max_tokens=1, sampling=SamplingParams(temperature=0), ignore_eos=True):
        pass
    # 16 tokens: the short-prompt GEMM for q, o, gate + up (one launch) and down; k + v (128 rows each,
    # the passes at any length) one launch; the head for the last token alone
    assert matmul_launches(names) == {"gemm_q4_K": 2 * 4, "matvec_x16_q4_K": 2 * 1, "matvec_x16_1_q4_K": 1}
    # its attention splits the 16 slots it reaches, not the cache's 512: one split, no merge
    assert names.count("attention") == 2 and "attention_combine" not in names
    assert names.count("rope_f32") == 2  # q and k (each normed) in one launch a layer
    assert "kv_store" not in names  # that launch wrote k and v to the cache too


def rope_then(lib, then):
    """The launches of q and k's rope (8 tokens, 4 and 2 heads of 64) into a one-layer cache, then of
    then(ops, q, k, v, cache), q and k the rope's; each as (kernel, its rope_f32 k_cache argument)."""
    ops = ops_module.CudaOps()
    ops.reserve([(GGMLType.F32, (64,))], CacheShape(1, 16, 128, 128), activation_width=2048)
    norm = ops.load_weight("norm", GGMLType.F32, (64,), np.ones(64, np.float32).tobytes())
    ops.commit_weights()
    cache = ops.new_kv_cache(CacheShape(1, 16, 128, 128))
    q, k, v = (ops.from_host(np.ones((8, w), np.float32)) for w in (256, 128, 128))
    lib.launches = []
    rope = Rope(RopeMode.NEOX, 64, 10000.0)
    qr, kr = ops.ropes((q, k), range(8), 64, rope, norms=((norm, 1e-6), (norm, 1e-6)))
    del q, k  # their buffers stay the rope's inputs until it runs
    then(ops, qr, kr, v, cache)
    ops.device.synchronize()
    k_cache_arg = len(param_format("rope_f32")) - len(ops_module.NO_CACHE_WRITE)  # the first of the cache's
    return [(name, int.from_bytes(args[k_cache_arg], "little") if name == "rope_f32" else None)
            for name, *_, args in lib.launches], cache


def test_only_the_first_rope_of_a_passs_positions_works_out_their_angles(fake):
    """kernels/elementwise.cu rope_angles: the pass's first rope writes the angles' table, the later ones of the
    same positions and parameters read it (angles_ready); new positions (the next pass's upload) or another base,
    not."""
    lib = fake()
    ops = ops_module.CudaOps()
    ops.reserve([(GGMLType.F32, (64,))], CacheShape(1, 16, 128, 128), activation_width=2048)
    ops.commit_weights()
    x = ops.from_host(np.ones((2, 128), np.float32))
    a, b = Rope(RopeMode.NEOX, 64, 10000.0), Rope(RopeMode.NEOX, 64, 500000.0)
    ready_arg = len(param_format("rope_f32")) - len(ops_module.NO_CACHE_WRITE) - 1
    lib.launches = []
    first, second = [0, 1], [2, 3]
    for rope, positions in ((a, first), (a, first), (b, first), (b, first), (b, second), (b, second)):
        ops.rope(x, positions, 64, rope)
        ops.device.release()
    ready = [int.from_bytes(args[ready_arg], "little") for name, *_, args in lib.launches if name == "rope_f32"]
    assert ready == [0, 1, 0, 1, 0, 1]


def attend(ops, q, k, v, cache):
    ops.attention(q, k, v, cache=cache, layer=0, batch=Batch.causal(range(8), 0), n_heads=4, n_kv_heads=2, scale=0.125)


def test_the_rope_of_q_and_k_writes_k_and_v_to_the_cache_for_the_attention_after_it(fake):
    """ops.ropes holds its launch back (Device.hold); the attention after it makes it with the layer's
    cache, so that it writes what kv_store would have: one launch fewer a layer."""
    launches, cache = rope_then(fake(), attend)
    assert launches == [("rope_f32", cache.k[0]), ("attention", None)]


@pytest.mark.parametrize("between,first", [("an op", "add_f32"), ("an upload", "upload"), ("a download", "download"),
                                           ("a poison", "memset")])
def test_a_held_rope_runs_before_anything_that_could_read_its_output(fake, between, first):
    """Anything else the stream does first makes the rope as it is, before it: then the attention
    stores k and v itself."""
    lib = fake()

    def marking(what):  # the stream's copies and fills, in order among the launches
        def call(*args):
            if lib.launches is not None:
                lib.launches.append((what, None, None, None, None, ()))
            return 0
        return call

    lib.cuMemcpyHtoDAsync_v2, lib.cuMemcpyDtoHAsync_v2, lib.cuMemsetD32Async = (marking(w) for w in ("upload", "download", "memset"))

    def then(ops, q, k, v, cache):
        if between == "an op":
            ops.add(q, q)
        elif between == "an upload":
            ops.from_host(np.ones((1, 8), np.float32))
        elif between == "a download":
            ops.to_host(k)
        else:
            ops.poison()
        attend(ops, q, k, v, cache)

    launches, _ = rope_then(lib, then)
    names = [name for name, _ in launches]
    assert names[:3] == ["upload", "rope_f32", first]  # the rope's positions, then the rope before the rest
    assert ("rope_f32", 0) in launches and names.count("rope_f32") == 1 and names[-2:] == ["kv_store", "attention"]


def qkv_rope_attention(lib, v_type, n_cols=256, between=lambda ops, k: None, qk_type=GGMLType.Q4_K, q_heads=4):
    """Two layers' q, k and v matmuls of one token (q_heads and 2 heads of 64; q and k qk_type, v v_type, n_cols
    wide), the rope of q and k, between(ops, the roped k), then the attention; the launches of each layer but x's int16
    blocks as (kernel, the rope form's tickets argument)."""
    ops = ops_module.CudaOps()
    shapes = [(qk_type, 64 * q_heads), (qk_type, 128), (v_type, 128)]
    ops.reserve([(t, (n_cols, rows)) for t, rows in shapes] + [(GGMLType.F32, (64,))], CacheShape(2, 16, 128, 128),
                activation_width=8 * max(n_cols, 64 * q_heads))
    weights = [ops.load_weight("w", t, (n_cols, rows), bytes(rows * n_cols // GGML_BLOCK[t][0] * GGML_BLOCK[t][1]))
               for t, rows in shapes]
    norm = ops.load_weight("norm", GGMLType.F32, (64,), np.ones(64, np.float32).tobytes())
    ops.commit_weights()
    cache, batch, rope = ops.new_kv_cache(CacheShape(2, 16, 128, 128)), Batch.causal(range(1), 3), Rope(RopeMode.NEOX, 64, 10000.0)
    x = ops.from_host(np.ones((1, n_cols), np.float32))
    layers = []
    for layer in range(2):
        lib.launches = []
        q, k, v = ops.matmuls(x, weights)
        qr, kr = ops.ropes((q, k), batch.positions, 64, rope, norms=((norm, 1e-6), (norm, 1e-6)))
        between(ops, kr)
        ops.attention(qr, kr, v, cache=cache, layer=layer, batch=batch, n_heads=q_heads, n_kv_heads=2, scale=0.125)
        ops.device.synchronize()
        layers.append([(name, int.from_bytes(args[-1], "little") if "_rope_" in name else None)
                       for name, *_, args in lib.launches if name not in ("upload", "download", "quantize_x16")])
    return layers


@pytest.mark.parametrize("v_type,n_cols,first,rope_form", [
    (GGMLType.Q4_K, 256, None, "matvec_x16_1_rope_q4_K"),  # q, k and v one launch
    (GGMLType.Q6_K, 256, "matvec_x16_1_q4_K", "matvec_x16_1_rope_q6_K"),  # q and k, then v
    (GGMLType.Q4_K, 4096, None, "matvec_x16_bulk_rope_q4_K"),
    (GGMLType.Q6_K, 4096, "matvec_x16_bulk_q4_K", "matvec_x16_1_rope_q6_K")], ids=["shared", "v-apart", "bulk", "bulk-v-apart"])
def test_a_one_token_rope_of_q_and_k_is_made_by_the_launch_making_v(fake, v_type, n_cols, first, rope_form):
    """Past the pass's first rope, whose launch works out its angles, the matvec launch making v makes q and k's
    rope and the cache's writes (kernels/rope.cuh RopeOut): no rope_f32 and no kv_store between it and the
    attention. Where q and k are that launch's too, each head's last block ropes it (its tickets); where they came
    before it, its blocks rope them after their own rows (no tickets)."""
    first_layer, second = qkv_rope_attention(fake(), v_type, n_cols)
    assert [name for name, _ in first_layer][-2:] == ["rope_f32", "attention"]
    assert [name for name, _ in second] == ([first] if first else []) + [rope_form, "attention"]
    assert (second[-2][1] != 0) == (first is None)


def test_a_rope_stays_apart_from_q_k_and_vs_launch_of_more_than_one_wave_of_int16_blocks(fake):
    """Each of the int16 matvec's blocks of q and k takes its head's ticket behind a fence, which holds a second wave
    back: a launch of q, k and v past the blocks the SMs hold at once (Q8_0's 8 an SM, on the fake's 132: 1,056)
    keeps the rope a launch of its own."""
    _, second = qkv_rope_attention(fake(), GGMLType.Q8_0, 4096, qk_type=GGMLType.Q8_0, q_heads=64)  # 1,088 blocks
    assert [name for name, _ in second] == ["matvec_x16_1_q8_0", "rope_f32", "attention"]
    _, second = qkv_rope_attention(fake(), GGMLType.Q8_0, 4096, qk_type=GGMLType.Q8_0, q_heads=60)  # 1,024
    assert [name for name, _ in second] == ["matvec_x16_1_rope_q8_0", "attention"]


def test_a_rope_with_anything_between_it_and_the_attention_runs_as_it_is(fake):
    """A download of the roped k before the attention makes the held matvec and the rope as they are, and the
    attention writes the cache itself."""
    _, second = qkv_rope_attention(fake(), GGMLType.Q4_K, between=lambda ops, k: ops.to_host(k))
    assert [name for name, _ in second] == ["matvec_x16_1_q4_K", "rope_f32", "kv_store", "attention"]


def norm_between_matvecs(lib, then):
    """The launches of one token's Q4_K matvec (256 x 256) with the residual summed in, an RMSNorm of its
    product, then of then(ops, normed, weight); each as (kernel, whether it writes a norm's share, whether it
    reads one's output): a matvec's norm_w and x_sums, norm_f32's xq (its int16 blocks)."""
    ops = ops_module.CudaOps()
    ops.reserve([(GGMLType.Q4_K, (256, 256)), (GGMLType.F32, (256,))], CacheShape(1, 16, 64, 64), activation_width=2048)
    w = ops.load_weight("w", GGMLType.Q4_K, (256, 256), bytes(256 * 144))
    norm = ops.load_weight("norm", GGMLType.F32, (256,), np.ones(256, np.float32).tobytes())
    ops.commit_weights()
    x, residual = ops.from_host(np.ones((1, 256), np.float32)), ops.from_host(np.ones((1, 256), np.float32))
    lib.launches = []
    normed = ops.rms_norm(ops.matmul(x, w, add=residual), norm, 1e-6)
    then(ops, normed, w)
    ops.device.synchronize()

    def arg(args, i):
        return int.from_bytes(args[i], "little") != 0

    matvec = param_format("matvec_x16_1_q4_K").index("Pf")  # x_sums, eps, then norm_w
    return [(name, arg(args, matvec + 2), arg(args, matvec)) if name.startswith("matvec") else
            (name, arg(args, 5) if name == "norm_f32" else None, None) for name, *_, args in lib.launches]


def test_a_norm_between_one_tokens_matvecs_is_theirs(fake):
    """The matvec making the norm's input writes the int16 blocks of x∘w and each group's sum of squares,
    the matvecs reading its output scale their sums by the norm's: no norm launch (x16.cuh NormOut). Its
    float values are made, without int16 blocks, only once something asks for their address."""
    launches = norm_between_matvecs(fake(), lambda ops, normed, w: ops.matmuls(normed, [w, w]))
    assert launches == [("quantize_x16", None, None), ("matvec_x16_1_q4_K", True, False), ("matvec_x16_1_q4_K", False, True)]

    def then_read(ops, normed, w):
        ops.matmul(normed, w)
        ops.to_host(normed)

    launches = norm_between_matvecs(fake(), then_read)
    assert launches[1:] == [("matvec_x16_1_q4_K", True, False), ("matvec_x16_1_q4_K", False, True), ("norm_f32", False, None)]


def test_the_int16_matvec_writes_a_norms_share_only_in_one_wave_of_blocks(fake):
    """matvec_x16_1's blocks of 4 rows each take a ticket for their group (a fence): past the blocks the SMs hold
    at once (its launch bounds: 6 an SM, 8 for Q8_0, on the fake's 132) that held the next wave back, so a wider
    product leaves its norm to a launch of its own. Q6_K launches that fit at 8 and not at 6 take a twin kernel of
    8 an SM; the tensor-core kernels hold whole groups and take no tickets."""
    lib = fake()
    ops = ops_module.CudaOps()
    shapes = [(GGMLType.Q5_K, 4096, 3168), (GGMLType.Q5_K, 4096, 3200),  # 792 blocks, 800
              (GGMLType.Q8_0, 4096, 4224), (GGMLType.Q8_0, 4096, 4256),  # 1,056, 1,064
              (GGMLType.Q6_K, 4096, 3168), (GGMLType.Q6_K, 4096, 4224), (GGMLType.Q6_K, 4096, 4256),
              (GGMLType.Q4_K, 4096, 4096)]
    ops.reserve([(t, (n_cols, n)) for t, n_cols, n in shapes] + [(GGMLType.F32, (n,)) for _, _, n in shapes],
                CacheShape(1, 16, 64, 64), activation_width=65536)
    weights = [ops.load_weight("w", t, (n_cols, n), bytes(n * n_cols // GGML_BLOCK[t][0] * GGML_BLOCK[t][1]))
               for t, n_cols, n in shapes]
    norms = [ops.load_weight("n", GGMLType.F32, (n,), np.ones(n, np.float32).tobytes()) for _, _, n in shapes]
    ops.commit_weights()
    x = ops.from_host(np.ones((1, 4096), np.float32))
    fused, kernels = [], []
    for w, norm in zip(weights, norms):
        residual = ops.from_host(np.ones((1, w.n_rows), np.float32))
        lib.launches = []
        fused.append(type(ops.rms_norm(ops.matmul(x, w, add=residual), norm, 1e-6)) is ops_module.LazyTensor)
        ops.device.release()
        kernels.append(next(name for name, *_ in lib.launches if name.startswith("matvec")))
    assert fused == [True, False, True, False, True, True, False, True]
    assert kernels[4:7] == ["matvec_x16_1_q6_K", "matvec_x16_1w_q6_K", "matvec_x16_1_q6_K"]


def test_a_split_copies_nothing_until_a_part_is_asked_for_its_address(fake):
    """A decode step's split of one head (MLA's latent and rope parts, Gated DeltaNet's q, k and v) at multiples of
    32 features is runs of the row, the row kept alive while a part is. Other splits' parts are where they lie in the
    tensor cut (memory.head_runs: for the rope, head_matmul's matvec and sigmoid_gate) until something asks for
    one's address: then one copy_heads_f32 launch makes both."""
    lib = fake()
    ops = ops_module.CudaOps()
    ops.reserve([(GGMLType.F32, (576,))], CacheShape(1, 16, 64, 64), activation_width=2048)
    ops.commit_weights()
    for n_tok, n_heads, widths in [(1, 1, (512, 64)), (1, 1, (32, 64, 96)), (2, 1, (512, 64)), (1, 2, (256, 32)),
                                   (1, 1, (48, 16))]:
        x = ops.from_host(np.ones((n_tok, n_heads * sum(widths)), np.float32))
        address = x.ptr
        lib.launches = []
        parts = ops.split(x, n_heads, widths)
        del x
        offsets = [4 * sum(widths[:i]) for i in range(len(widths))]
        if n_tok == n_heads == 1 and widths != (48, 16):
            assert [p.ptr - address for p in parts] == offsets
            assert parts[-1]._of.cols == sum(widths)  # the row outlives its name
        else:
            assert [memory.head_runs(p) for p in parts] == [(address + o, w, sum(widths)) for o, w in zip(offsets, widths)]
            ops.device.synchronize()
            assert lib.launches == []
            parts[1].ptr, parts[0].ptr
            ops.device.synchronize()
            assert [launch[0] for launch in lib.launches] == ["copy_heads_f32"]


def test_a_norm_read_by_a_launch_of_many_waves_keeps_its_own_launch(fake):
    """Each block of a launch reading a norm's output sums the norm's group sums first: past two waves of int16
    blocks, as the output head is, the norm runs on its own. A wave on the fake's 132 SMs: 6 blocks of 4 warps an SM
    (4,096 columns: 1,584 blocks of 4 rows in two), or 16 of one warp (1,024 columns: 4,224 blocks in two)."""
    lib = fake()
    ops = ops_module.CudaOps()
    cases = [(1024, 16896, False), (1024, 16960, True), (4096, 6336, False), (4096, 6400, True)]  # width, reader rows
    ops.reserve([(GGMLType.Q4_K, (4096, w)) for w in (1024, 4096)] + [(GGMLType.F32, (w,)) for w in (1024, 4096)]
                + [(GGMLType.Q6_K, (w, n)) for w, n, _ in cases], CacheShape(1, 16, 64, 64), activation_width=65536)

    def weight(t, n_cols, n):
        return ops.load_weight("w", t, (n_cols, n), bytes(n * n_cols // GGML_BLOCK[t][0] * GGML_BLOCK[t][1]))

    producers = {w: weight(GGMLType.Q4_K, 4096, w) for w in (1024, 4096)}  # tensor cores: whole groups, no tickets
    norms = {w: ops.load_weight("n", GGMLType.F32, (w,), np.ones(w, np.float32).tobytes()) for w in (1024, 4096)}
    readers = [weight(GGMLType.Q6_K, w, n) for w, n, _ in cases]
    ops.commit_weights()
    x = ops.from_host(np.ones((1, 4096), np.float32))
    norm_launched = []
    for (w, _, _), reader in zip(cases, readers):
        residual = ops.from_host(np.ones((1, w), np.float32))
        lib.launches = []
        ops.matmul(ops.rms_norm(ops.matmul(x, producers[w], add=residual), norms[w], 1e-6), reader)
        ops.device.synchronize()
        norm_launched.append(any(name == "norm_f32" for name, *_ in lib.launches))
    assert norm_launched == [launched for *_, launched in cases]


def test_a_norm_whose_output_something_else_reads_first_runs_as_it_is(fake):
    """Any other op first makes the held matvec and the norm as they are, before it."""
    launches = norm_between_matvecs(fake(), lambda ops, normed, w: ops.matmul(ops.add(normed, normed), w))
    assert [name for name, *_ in launches[1:]] == ["matvec_x16_1_q4_K", "norm_f32", "add_f32", "quantize_x16", "matvec_x16_1_q4_K"]
    assert launches[1] == ("matvec_x16_1_q4_K", False, False) and launches[2] == ("norm_f32", True, None)


def test_a_decode_steps_attention_splits_its_bucket_of_slots_not_the_whole_cache(fake):
    """One token's attention grid covers the slots up to a power of two past its own (256 at least,
    the cache's capacity at most), 128 a split but 8 splits at least (of 32 slots at least); so does its
    graph's shape, which a step replays until the next bucket's. Prompts split the slots they reach. On
    sm_90 (the fake's), up to 8 splits are one cluster's blocks (attention_cluster); more merge through
    memory: 64- and 128-wide heads, 4 to 8 query heads a KV head, a block a KV head's group (attention_group,
    128 slots a split, an even count, as many as the partials' 4 MB hold); other heads a block a query head, as
    many splits as fill one wave of the SMs at 5 blocks an SM (4 heads on 20 SMs: 25), 64 at most."""
    from reflex_engine.backends.cuda.graph import pass_shape

    lib = fake()
    for d, n_kv, long in ((128, 1, "group"), (64, 1, "group"), (96, 1, "wave"), (128, 2, "wave"), (64, 1, "wave")):
        ops = ops_module.CudaOps()
        ops.device.info = ops.device.info._replace(multiprocessors=20)
        shape = CacheShape(1, 4224, n_kv * d, n_kv * d)
        ops.reserve([(GGMLType.F32, (64,))], shape, activation_width=2048)
        cache = ops.new_kv_cache(shape)
        n_heads = 16 if long == "wave" and d == 64 else 4  # 16 heads on one KV head: past a group; 4 on 2: short of one
        q = ops.from_host(np.ones((1, n_heads * d), np.float32))
        kv = ops.from_host(np.ones((1, n_kv * d), np.float32))
        grids = {}
        for start in (0, 100, 255, 256, 1000, 1024, 3000, 4223):
            lib.launches = []
            ops.attention(q, kv, kv, cache=cache, layer=0, batch=Batch.causal([0], start), n_heads=n_heads,
                          n_kv_heads=n_kv, scale=0.1)
            grids[start] = next((name, grid[1], grid[2]) for name, grid, *_ in lib.launches if name.startswith("attention"))
        cluster = ("attention_cluster", n_heads, 8)
        if long == "group":  # the bucket's slots: 2,048, 4,096, then the cache's 4,224 (33 splits' worth)
            later = {1024: ("attention_group", n_kv, 16), 3000: ("attention_group", n_kv, 32), 4223: ("attention_group", n_kv, 32)}
        else:
            wave = ("attention", n_heads, 5 * 20 // n_heads)
            later = {1024: wave, 3000: wave, 4223: wave}
        assert grids == {0: cluster, 100: cluster, 255: cluster, 256: cluster, 1000: cluster, **later}, (d, n_kv)
    one = [pass_shape(Batch.causal([0], start), [0]) for start in (1, 100, 255, 256, 511, 512)]
    assert one[0] == one[1] == one[2] != one[3] == one[4] != one[5]
    assert pass_shape(Batch.causal([0], 0), [0]) != one[0]  # a fresh recurrent state


def test_a_kv_head_groups_splits_fit_the_partials_scratch(fake):
    """attention_group's splits leave each query head's partials (a pair and dv floats a split) in the 4 MB scratch
    (ops.ATTENTION_PARTIALS_BYTES): 128 heads of 128 on 16 KV heads at 16,384 slots take 62 splits, not the 64
    of 128 slots each, whose 4.26 MB would run past it."""
    lib = fake()
    ops = ops_module.CudaOps()
    shape = CacheShape(1, 16384, 16 * 128, 16 * 128)
    ops.reserve([(GGMLType.F32, (64,))], shape, activation_width=2 * 128 * 128)
    cache = ops.new_kv_cache(shape)
    q = ops.from_host(np.ones((1, 128 * 128), np.float32))
    kv = ops.from_host(np.ones((1, 16 * 128), np.float32))
    lib.launches = []
    ops.attention(q, kv, kv, cache=cache, layer=0, batch=Batch.causal([0], 9000), n_heads=128, n_kv_heads=16, scale=0.1)
    (grid,) = [grid for name, grid, *_ in lib.launches if name == "attention_group"]
    assert grid == (1, 16, 62) and 4 * 128 * 62 * (128 + 2) <= ops_module.ATTENTION_PARTIALS_BYTES


def test_a_decode_step_shares_launches_between_weights_of_one_kernel(record):
    model, names = record
    greedy = SamplingParams(temperature=0)
    steps = iter(model.generate([1, 2, 3], max_tokens=2, sampling=greedy, ignore_eos=True))
    next(steps)  # the prompt's pass and the first token
    names.clear()
    next(steps)  # one decode step (the last: none is queued after it)
    # one token: q + k + v, o, gate + up, down a layer, then the head; the second layer's q + k + v launch ropes q
    # and k and writes the cache (the first's rope works out the pass's angles in a launch of its own)
    assert matmul_launches(names) == {"matvec_x16_1_q4_K": 2 * 4, "matvec_x16_1_rope_q4_K": 1}
    assert names.count("rope_f32") == 1 and "kv_store" not in names
    # a decode step splits its bucket of slots (one grid for every position of it, as its graph replays it), and
    # the cluster of its splits merges them: no launch of its own
    assert names.count("attention_cluster") == 2 and "attention" not in names and "attention_combine" not in names
    assert "take_rows_f32" not in names  # its one row is the logits row: nothing to take
    # the norms after o and down (ffn, the next layer's attention, the output's) are theirs and the next
    # matvecs': only the first layer's, after the embedding, is a launch of its own
    assert names.count("norm_f32") == 1 and "quantize_x16" not in names


def test_bench_times_decode_steps_that_replay_graphs_captured_in_its_warm_ups(fake, monkeypatch):
    """`reflex bench` times warm decoding: no graph is captured inside a timed decode run (a capture is an eager
    pass and an instantiation; run 22's 8B bench timed the first step's in its one 64-token run, 9.5 ms)."""
    from reflex_engine.backends.cuda import graph as graph_module
    from reflex_engine.bench import run_bench

    fake()
    model = reflex_engine.load(MODEL, device="cuda", n_ctx=4200)
    timed, captured = [False], []
    capture = graph_module.CapturedPass._capture
    monkeypatch.setattr(graph_module.CapturedPass, "_capture",
                        lambda self, batch: (captured.append((timed[0], len(batch.tokens), batch.start)), capture(self, batch))[1])
    generate = model.generate

    def marked(ids, max_tokens, **kwargs):  # the timed decode runs are the ones of decode_tokens
        timed[0] = max_tokens == 64
        return generate(ids, max_tokens=max_tokens, **kwargs)

    monkeypatch.setattr(model, "generate", marked)
    monkeypatch.setattr(model.ops.device, "copy_bandwidth", lambda: 4e12)  # the fake's events take no time
    run_bench(model, runs=3, decode_tokens=64)  # its prompts of 16 to 2,048 tokens, its decodes at 128 and 4,096
    assert any(n == 1 and start >= 128 for _, n, start in captured)  # the decode graphs were captured, in warm-ups
    assert [c for c in captured if c[0]] == []


def test_a_prompt_chunk_whose_logits_no_one_wants_multiplies_no_head(fake, monkeypatch):
    """A prompt longer than a pass (ops.MAX_BATCH) runs in chunks; the first one's logits rows are none, and
    its head matmul is of 0 rows: nothing launched, whichever kernel one row would take."""
    fake()
    monkeypatch.setenv("REFLEX_CUDA_GRAPHS", "0")
    model = reflex_engine.load(MODEL, device="cuda", n_ctx=1024)
    vocab = model.config.n_vocab
    ids = [1 + i % (vocab - 1) for i in range(ops_module.MAX_BATCH + 88)]
    for _ in model.generate(ids, max_tokens=1, sampling=SamplingParams(temperature=0), ignore_eos=True):
        pass


def test_a_short_prompts_gemm_splits_the_columns_of_weights_too_small_to_fill_the_gpu():
    from reflex_engine.backends.cuda.ops import FUSED_WEIGHTS, GEMM_MAX_SPLITS, gemm_splits

    target = 2 * 132  # GEMM_BLOCKS_AN_SM on an H200
    # Qwen3-8B's q (4,096 x 4,096), 16 tokens: 128 blocks of 32 rows, so 3 splits of its 8 steps; k and v
    # (1,024 rows) 8 (9 would fill more, but there are 8 steps); gate and up (12,288 rows) none; nor q at
    # 127 tokens (4 token tiles)
    assert gemm_splits([4096, 1024, 1024], 4096, 1, target) == (8, (3, 8, 8))
    assert gemm_splits([12288, 12288], 4096, 1, target) == (1, (1, 1, 1))
    assert gemm_splits([4096], 4096, 4, target) == (1, (1, 1, 1))
    for n_cols in (512, 1000, 4096, 12288):
        for tiles in (1, 2, 4, 16):
            for rows in (33, 100, 1024, 4096, 30000):
                z, (s, *absent) = gemm_splits([rows], n_cols, tiles, target)
                blocks = -(-rows // 32) * tiles
                assert z == s and absent == [1] * (FUSED_WEIGHTS - 1)
                assert 1 <= s <= min(-(-n_cols // 512), GEMM_MAX_SPLITS)
                assert s == 1 or blocks < target  # a weight that fills the GPU is not split
                assert blocks * s < 2 * target or s == 1  # what ops.py sizes the scratch for
                # the same splits beside other weights: a product's bits do not depend on its company
                assert gemm_splits([64, rows, 9000], n_cols, tiles, target)[1][1] == s


def recorded_launches(fake, monkeypatch, capability):
    """A fake driver of that compute capability, with its launches (name, grid, dynamic shared bytes) and its
    functions' attributes set (name, attribute, value) recorded in the two lists returned."""
    lib = fake(capability=capability)
    launched: list[tuple[str, tuple, int]] = []
    launch = device_module.Device.launch
    monkeypatch.setattr(device_module.Device, "launch",
                        lambda self, name, grid, block, args, smem=0: (launched.append((name, grid, smem)),
                                                                       launch(self, name, grid, block, args, smem)))
    allowed = []
    monkeypatch.setattr(lib, "cuFuncSetAttribute", lambda fn, attr, value: allowed.append((lib._name(fn), attr, value)) or 0,
                        raising=False)
    return launched, allowed


@pytest.mark.parametrize("capability", [(9, 0), (8, 9)])
def test_rows_of_4096_columns_or_more_take_the_tensor_core_kernels(fake, monkeypatch, capability):
    """One token's Q4_K matvec (kernels/matvec_x16_mma.cu) and a short prompt's Q4_K and Q8_0 GEMM
    (kernels/gemm_frag.cu) run on tensor cores for rows of ops.MMA_MIN_COLS columns or more; narrower rows
    and the other types keep the int16 matvec and gemm.cu, faster there on the H200 (docs/perf-notes.md run 10).
    From sm_90 on, the Q4_K matvec streams its rows through shared memory by bulk copies: at most 2 blocks
    an SM, each with its stages' shared memory allowed; a launch of at most one group of 32 rows an SM whose rows take
    8,192 columns or more (8B's downs: 4,096 rows of 12,288) takes blocks of 16 warps, one an SM. Before sm_90
    its blocks load them into registers."""
    launched, allowed = recorded_launches(fake, monkeypatch, capability)
    shapes = [(t, n_cols, 256) for t in (GGMLType.Q4_K, GGMLType.Q8_0, GGMLType.Q6_K) for n_cols in (1024, 4096)] \
        + [(GGMLType.Q4_K, 12288, 9000), (GGMLType.Q4_K, 12288, 4096)]
    ops = ops_module.CudaOps()
    ops.reserve([(t, (n_cols, n_rows)) for t, n_cols, n_rows in shapes], CacheShape(1, 16, 64, 64), activation_width=8 * 4096)
    weights = {}
    for t, n_cols, n_rows in shapes:
        block, size = GGML_BLOCK[t]
        weights[t, n_cols, n_rows] = ops.load_weight("w", t, (n_cols, n_rows), bytes(n_rows * n_cols // block * size))
    ops.commit_weights()
    chosen = {}
    for (t, n_cols, n_rows), w in weights.items():
        for n_tok in (1, 16) if n_cols < 12288 else (1,):
            x = ops.from_host(np.zeros((n_tok, n_cols), np.float32))
            launched.clear()
            ops.matmul(x, w)
            chosen[t.name, n_cols, n_tok] = chosen[n_rows] = [(n, g[0], s) for n, g, s in launched if n.startswith(("gemm", "matvec"))]
    bulk = capability >= (9, 0)
    q4_k_1 = [("matvec_x16_bulk_q4_K", 8, ops_module.X16_BULK_SHARED)] if bulk else [("matvec_x16_mma_q4_K", 8, 0)]
    # 9,000 rows: 282 groups of 32 over 2 blocks an SM of the fake's 132
    wide_1 = [("matvec_x16_bulk_q4_K", 264, ops_module.X16_BULK_SHARED)] if bulk else [("matvec_x16_mma_q4_K", 282, 0)]
    assert {k: [n for n, _, _ in v] for k, v in chosen.items() if type(k) is tuple and k[1] != 12288} == {
        ("Q4_K", 1024, 1): ["matvec_x16_1_q4_K"], ("Q4_K", 1024, 16): ["gemm_q4_K"],
        ("Q4_K", 4096, 1): [q4_k_1[0][0]], ("Q4_K", 4096, 16): ["gemm_frag_q4_K"],
        ("Q8_0", 1024, 1): ["matvec_x16_1_q8_0"], ("Q8_0", 1024, 16): ["gemm_q8_0"],
        ("Q8_0", 4096, 1): ["matvec_x16_1_q8_0"], ("Q8_0", 4096, 16): ["gemm_frag_q8_0"],
        ("Q6_K", 1024, 1): ["matvec_x16_1_q6_K"], ("Q6_K", 1024, 16): ["gemm_q6_K"],
        ("Q6_K", 4096, 1): ["matvec_x16_1_q6_K"], ("Q6_K", 4096, 16): ["gemm_q6_K"],
    }
    # 4,096 rows of 12,288: 128 groups, under the fake's 132 SMs, of six stages (16 warps, two a superblock)
    down_1 = [("matvec_x16_bulk16_q4_K", 128, ops_module.X16_BULK_WIDE_SHARED)] if bulk else [("matvec_x16_mma_q4_K", 128, 0)]
    assert chosen["Q4_K", 4096, 1] == q4_k_1 and chosen[9000] == wide_1 and chosen[4096] == down_1
    assert all(smem == 0 for k, v in chosen.items() for n, _, smem in v if "bulk" not in n)
    assert set(allowed) == ({(kernel, attribute, value) for kernel, shared in (("matvec_x16_bulk_q4_K", ops_module.X16_BULK_SHARED),
                                                                                ("matvec_x16_bulk16_q4_K", ops_module.X16_BULK_WIDE_SHARED))
                             for attribute, value in ((driver.FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared),
                                                      (driver.FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100))}
                            if bulk else set())


@pytest.mark.parametrize("capability", [(9, 0), (8, 9)])
def test_prompts_past_the_int16_passes_multiply_the_blocks_in_tiles_of_64_tokens(fake, monkeypatch, capability):
    """Q4_K, Q6_K and Q8_0 rows of ops.MMA_MIN_COLS columns or more take kernels/gemm_tile.cu from
    GEMM_TILE_MIN_TOKENS tokens on, no f16 copy of the weights: the grid's x the token tiles of 64 (the tiles of
    one weight's rows run together, its bytes read once), y the groups of 128 rows, its two stages of x allowed in
    shared memory. A weight of fewer blocks than SMs takes, from sm_90 on, clusters of GEMM_TILE_SPLITS blocks
    (grid z), each a share of the columns. Rows of 1,024 columns take them up to GEMM_TILE_NARROW_MAX_TOKENS (192),
    then the f16 copy (gemm_f16.cu), as Q8_0's do past GEMM_TILE_MAX_TOKENS; rows of 512 keep gemm.cu, then the
    f16 copy."""
    launched, allowed = recorded_launches(fake, monkeypatch, capability)
    # 20,000 rows: 157 groups of 128, past the fake's 132 SMs at one token tile
    shapes = [(GGMLType.Q4_K, 4096, 256), (GGMLType.Q6_K, 4096, 256), (GGMLType.Q8_0, 4096, 256),
              (GGMLType.Q4_K, 4096, 20000), (GGMLType.Q4_K, 1024, 256), (GGMLType.Q4_K, 512, 256)]
    ops = ops_module.CudaOps()
    ops.reserve([(t, (n_cols, n_rows)) for t, n_cols, n_rows in shapes], CacheShape(1, 16, 64, 64), activation_width=4 * 20000)
    weights = [ops.load_weight("w", t, (n_cols, n_rows), bytes(n_rows * n_cols // GGML_BLOCK[t][0] * GGML_BLOCK[t][1]))
               for t, n_cols, n_rows in shapes]
    ops.commit_weights()
    chosen = {}
    for (t, n_cols, n_rows), w in zip(shapes, weights):
        for n_tok in (32, 33, 130, 192, 193, 300):
            launched.clear()
            ops.matmul(ops.from_host(np.zeros((n_tok, n_cols), np.float32)), w)
            chosen[t.name, n_cols, n_rows, n_tok] = [(n, g, s) for n, g, s in launched if n.startswith("gemm")]
    tile = "gemm_tile_split" if capability >= (9, 0) else "gemm_tile"
    z, shared = (ops_module.GEMM_TILE_SPLITS if capability >= (9, 0) else 1), ops_module.GEMM_TILE_SHARED
    assert chosen == {
        ("Q4_K", 4096, 256, 32): [("gemm_frag_q4_K", (8, 2), 0)],
        ("Q4_K", 4096, 256, 33): [(f"{tile}_q4_K", (1, 2, z), shared)],
        ("Q4_K", 4096, 256, 130): [(f"{tile}_q4_K", (3, 2, z), shared)],
        ("Q4_K", 4096, 256, 192): [(f"{tile}_q4_K", (3, 2, z), shared)],
        ("Q4_K", 4096, 256, 193): [(f"{tile}_q4_K", (4, 2, z), shared)],
        ("Q4_K", 4096, 256, 300): [(f"{tile}_q4_K", (5, 2, z), shared)],
        ("Q6_K", 4096, 256, 32): [("gemm_q6_K", (8, 1, 8), 0)],
        ("Q6_K", 4096, 256, 33): [(f"{tile}_q6_K", (1, 2, z), shared)],
        ("Q6_K", 4096, 256, 130): [(f"{tile}_q6_K", (3, 2, z), shared)],
        ("Q6_K", 4096, 256, 192): [(f"{tile}_q6_K", (3, 2, z), shared)],
        ("Q6_K", 4096, 256, 193): [(f"{tile}_q6_K", (4, 2, z), shared)],
        ("Q6_K", 4096, 256, 300): [(f"{tile}_q6_K", (5, 2, z), shared)],
        ("Q8_0", 4096, 256, 32): [("gemm_frag_q8_0", (8, 2), 0)],
        ("Q8_0", 4096, 256, 33): [(f"{tile}_q8_0", (1, 2, z), shared)],
        ("Q8_0", 4096, 256, 130): [(f"{tile}_q8_0", (3, 2, z), shared)],
        ("Q8_0", 4096, 256, 192): [(f"{tile}_q8_0", (3, 2, z), shared)],
        ("Q8_0", 4096, 256, 193): [(f"{tile}_q8_0", (4, 2, z), shared)],
        ("Q8_0", 4096, 256, 300): [("gemm_f16_64", (4, 5), 0)],
        ("Q4_K", 4096, 20000, 32): [("gemm_frag_q4_K", (625, 2), 0)],
        ("Q4_K", 4096, 20000, 33): [("gemm_tile_q4_K", (1, 157, 1), shared)],
        ("Q4_K", 4096, 20000, 130): [("gemm_tile_q4_K", (3, 157, 1), shared)],
        ("Q4_K", 4096, 20000, 192): [("gemm_tile_q4_K", (3, 157, 1), shared)],
        ("Q4_K", 4096, 20000, 193): [("gemm_tile_q4_K", (4, 157, 1), shared)],
        ("Q4_K", 4096, 20000, 300): [("gemm_tile_q4_K", (5, 157, 1), shared)],
        ("Q4_K", 1024, 256, 32): [("gemm_q4_K", (8, 1, 2), 0)],
        ("Q4_K", 1024, 256, 33): [(f"{tile}_q4_K", (1, 2, z), shared)],
        ("Q4_K", 1024, 256, 130): [(f"{tile}_q4_K", (3, 2, z), shared)],
        ("Q4_K", 1024, 256, 192): [(f"{tile}_q4_K", (3, 2, z), shared)],
        ("Q4_K", 1024, 256, 193): [("gemm_f16_64", (4, 4), 0)],
        ("Q4_K", 1024, 256, 300): [("gemm_f16_64", (4, 5), 0)],
        ("Q4_K", 512, 256, 32): [("gemm_q4_K", (8, 1, 1), 0)],
        ("Q4_K", 512, 256, 33): [("gemm_q4_K", (8, 2, 1), 0)],
        ("Q4_K", 512, 256, 130): [("gemm_f16_64", (4, 3), 0)],
        ("Q4_K", 512, 256, 192): [("gemm_f16_64", (4, 3), 0)],
        ("Q4_K", 512, 256, 193): [("gemm_f16_64", (4, 4), 0)],
        ("Q4_K", 512, 256, 300): [("gemm_f16_64", (4, 5), 0)],
    }
    most = driver.FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    assert (f"{tile}_q4_K", most, shared) in allowed and ("gemm_tile_q4_K", most, shared) in allowed


class StreamInOrder:
    """The driver as graph.py uses it, with a stream whose work runs in the order queued when the
    host waits (cuEventSynchronize runs it up to the event, cuStreamSynchronize all of it); what is
    queued during a capture goes into the graph instead. `read` queues a kernel that records the
    first position the pass finds in the scratch ints."""

    def __init__(self):
        self.queue, self.capturing, self.graphs, self.seen, self._host, self.events_made = [], None, {}, [], [], 0

    def __getattr__(self, name):
        return lambda *args: None  # destroying and freeing

    def cuMemHostAlloc(self, out, nbytes, flags):
        self._host.append(ctypes.create_string_buffer(nbytes))
        out._obj.value = ctypes.addressof(self._host[-1])

    def cuEventCreate(self, out, flags):
        self.events_made += 1
        out._obj.value = self.events_made

    def _queue(self, op):
        (self.capturing if self.capturing is not None else self.queue).append(op)

    def cuMemcpyHtoDAsync_v2(self, dst, src, nbytes, stream):
        self._queue(lambda: ctypes.memmove(dst, src, nbytes))

    def cuEventRecord(self, event, stream):
        self._queue(("event", event.value))

    def read(self, positions_at):
        self._queue(lambda: self.seen.append(ctypes.c_int32.from_address(positions_at).value))

    def cuStreamBeginCapture_v2(self, stream, mode):
        self.capturing = []

    def cuStreamEndCapture(self, stream, out):
        out._obj.value = len(self.graphs) + 1
        self.graphs[out._obj.value], self.capturing = self.capturing, None

    def cuGraphInstantiateWithFlags(self, out, graph, flags):
        out._obj.value = graph.value

    def cuGraphLaunch(self, exec_, stream):
        self.queue += self.graphs[exec_.value]

    def _run(self, until=None):
        while self.queue:
            op = self.queue.pop(0)
            if op == ("event", until):
                return
            if callable(op):
                op()

    def cuEventSynchronize(self, event):
        self._run(event.value)

    def cuStreamSynchronize(self, stream):
        self._run()


def test_a_replay_queued_before_the_one_before_it_ran_reads_its_own_positions():
    """A greedy decode queues each pass before the last one has run (engine.py _step): every
    replay must find its own ints on the device, not the ints staged after it."""
    from types import SimpleNamespace

    from reflex_engine.backends.cuda.graph import FROM_BATCH, CapturedPass
    from reflex_engine.backends.cuda.ops import STEP_INTS
    from reflex_engine.ops import SAMPLED, Batch

    drv = StreamInOrder()
    scratch = ctypes.create_string_buffer(16 * len(STEP_INTS))
    ints = {kind: ctypes.addressof(scratch) + 16 * i for i, kind in enumerate(STEP_INTS)}
    device = SimpleNamespace(drv=drv, stream=ctypes.c_void_p(1), release=lambda: None)
    ops = SimpleNamespace(_ints=ints, max_batch=4, device=device,
                          weights_arrived=lambda: None, _captured_ints=None, _positions=None)

    def forward(batch):  # as CudaOps records the ints a captured pass reads, then its kernels
        ops._captured_ints.update({kind: derive(batch) for kind, derive in FROM_BATCH.items()}, rows=[0])
        drv.read(ints["positions"])
        return "logits"

    step = CapturedPass(ops, forward, STEP_INTS)
    for n_past in range(10, 16):  # six steps queued, the host waiting on none
        assert step(Batch.causal(SAMPLED, n_past)) == "logits"
    drv.cuStreamSynchronize(ops.device.stream)
    assert drv.seen == list(range(10, 16))


def test_experts_take_int16_x_in_a_decode_pass_and_tensor_core_tiles_in_a_prompt_matrix_by_matrix(fake, monkeypatch):
    """A decode pass's experts (<= 8 tokens) of the int16 types: x's blocks made once, gate and up in one launch
    (grid y: 2 weights x tokens x slots), SwiGLU's blocks beside h, the down summing the slots (grid y: tokens). A
    prompt's: grouped by expert, and each matrix of Q4_K, Q6_K or Q8_0 of whole superblocks in tiles of 64 pairs
    (grid x: the most tiles there may be, ceil(pairs / 64) + experts; y: groups of 128 rows, its x as f16 once for
    gate and up), any other (a Q8_0 down of 288 columns) in float passes of 8 pairs. A residual is the int16
    down's own sum, else add_f32's after the experts."""
    launched, allowed = recorded_launches(fake, monkeypatch, (9, 0))
    n_expert, e, k = 8, 512, 2
    files = {"whole": ((GGMLType.Q4_K, 768), (GGMLType.Q4_K, 768), (GGMLType.Q4_K, 768)),
             "mixed": ((GGMLType.Q4_K, 288), (GGMLType.Q4_K, 288), (GGMLType.Q8_0, 288))}
    shapes = {name: [(t, (e, f, n_expert)) if i < 2 else (t, (f, e, n_expert)) for i, (t, f) in enumerate(mats)]
              for name, mats in files.items()}
    ops = ops_module.CudaOps()
    ops.reserve([s for mats in shapes.values() for s in mats], CacheShape(1, 16, 64, 64), activation_width=4 * 4096)
    weights = {name: [ops.load_weight("w", t, shape, bytes(shape[0] * shape[1] * n_expert // GGML_BLOCK[t][0] * GGML_BLOCK[t][1]))
                      for t, shape in mats] for name, mats in shapes.items()}
    ops.commit_weights()
    rng = np.random.default_rng(0)
    for name, (gate, up, down) in weights.items():
        f = gate.n_rows
        for n_tok, residual in ((1, False), (1, True), (40, False), (40, True)):
            ids = np.stack([rng.permutation(n_expert)[:k] for _ in range(n_tok)]).astype(np.int32)
            routes = Routes(ops.from_host(ids.view(np.float32)), ops.from_host(np.full((n_tok, k), 0.5, np.float32)))
            x = ops.from_host(np.zeros((n_tok, e), np.float32))
            add = ops.from_host(np.zeros((n_tok, e), np.float32)) if residual else None
            launched.clear()
            ops.moe_ffn(x, routes, gate=gate, up=up, down=down, add=add)
            got = [(n, g) for n, g, _ in launched]
            if residual and n_tok > 1:
                assert got[-1] == ("add_f32", (-(-n_tok * e // 256),))
                got = got[:-1]
            if n_tok == 1:
                down_name = f"experts_down_x16_{ops_module.kernel_suffix(down.ggml_type)}"
                assert got == [("quantize_x16", (1,)), ("stacked_matvec_x16_q4_K", (f // 4, 2 * k)), ("swiglu_f32", (-(-f * k // 256),)),
                               (down_name, (e // 4, 1))], name
                continue
            tiles = -(-n_tok * k // 64) + n_expert
            tiled = [("gemm_tile_experts_q4_K", (tiles, -(-f // 128)))] * 2
            last = [("to_f16_interleaved", (-(-n_tok * k * f // 1024),)), ("gemm_tile_experts_q4_K", (tiles, e // 128))] \
                if name == "whole" else [("grouped_matvec_q8_0", (e // 2, n_expert))]
            assert got == [("moe_group", (1,)), ("moe_gather", (n_tok * k,)), ("to_f16_interleaved", (-(-n_tok * k * e // 1024),)),
                           *tiled, ("swiglu_f32", (-(-n_tok * k * f // 256),)), *last, ("moe_combine", (n_tok,))], name
    assert ("gemm_tile_experts_q4_K", driver.FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, ops_module.GEMM_TILE_SHARED) in allowed



def test_a_prompts_heads_take_tensor_core_tiles_where_the_type_and_width_allow(fake, monkeypatch):
    """head_matmul (MLA's attn_k_b, attn_v_b): up to 8 tokens the stacked matvec, a token and head a grid row; past
    them gemm_tile_heads (grid: tiles of 64 tokens, groups of 128 rows, heads), x as f16 once. DeepSeek-V2-Lite's
    attn_k_b is 512 rows of 128 columns of Q5_0 (half a superblock: tiles), its attn_v_b 128 rows of 512 of Q4_K;
    a type gemm_tile.cu has no kernels for (Q4_0) keeps the matvec, as do rows of 96 columns."""
    launched, allowed = recorded_launches(fake, monkeypatch, (9, 0))
    n_heads = 16
    mats = {"k_b": (GGMLType.Q5_0, (128, 512, n_heads)), "v_b": (GGMLType.Q4_K, (512, 128, n_heads)),
            "q4_0": (GGMLType.Q4_0, (128, 512, n_heads)), "narrow": (GGMLType.Q8_0, (96, 512, n_heads))}
    ops = ops_module.CudaOps()
    ops.reserve(list(mats.values()), CacheShape(1, 16, 64, 64), activation_width=4 * 16 * 512)
    weights = {name: ops.load_weight(name, t, shape, bytes(shape[0] * shape[1] * n_heads // GGML_BLOCK[t][0] * GGML_BLOCK[t][1]))
               for name, (t, shape) in mats.items()}
    ops.commit_weights()
    for name, w in weights.items():
        for n_tok in (8, 9, 130):
            launched.clear()
            ops.head_matmul(ops.from_host(np.zeros((n_tok, n_heads * w.n_cols), np.float32)), w)
            got = [(n, g) for n, g, _ in launched]
            if n_tok > 8 and name in ("k_b", "v_b"):
                kernel = f"gemm_tile_heads_{ops_module.kernel_suffix(w.ggml_type)}"
                assert got == [("to_f16_interleaved", (-(-n_tok * n_heads * w.n_cols // 1024),)),
                               (kernel, (-(-n_tok // 64), -(-w.n_rows // 128), n_heads))], (name, n_tok)
                assert (kernel, driver.FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, ops_module.GEMM_TILE_SHARED) in allowed
            else:
                assert got == [(f"stacked_matvec_{ops_module.kernel_suffix(w.ggml_type)}", (n_tok * n_heads, w.n_rows // 4))], (name, n_tok)


@pytest.mark.parametrize("capability", [(9, 0), (8, 9)])
def test_the_latent_attention_takes_the_tensor_core_kernels_on_sm90(fake, monkeypatch, capability):
    """kernels/mla.cu on sm_90+: from 64 tokens on latent_attention_prefill (225 KB of shared memory a block at
    DeepSeek's 576-wide rows allowed), grid (ceil(tokens x heads / 128), v_width / 256), its slots unsplit; below,
    latent_attention_decode, 16 rows a block, its slots split as the cache's capacity (256 slots: 4 of 64) and the
    partials' scratch allow, merged by latent_attention_combine. Before sm_90 the split kernel and its merge."""
    launched, allowed = recorded_launches(fake, monkeypatch, capability)
    n_heads, width, v_width = 16, 576, 512
    ops = ops_module.CudaOps()
    shape = CacheShape(1, 256, width, v_width, latent=True)
    ops.reserve([], shape, activation_width=4 * n_heads * width)
    cache = ops.new_kv_cache(shape)
    for n_tok in (1, 63, 64, 130):
        launched.clear()
        q, kv = ([ops.from_host(np.zeros((n_tok, n * w), np.float32)) for w in (v_width, width - v_width)] for n in (n_heads, 1))
        ops.latent_attention(q, kv, cache=cache, layer=0, batch=Batch.causal(list(range(n_tok)), 0), n_heads=n_heads,
                             scale=0.1)
        got = [(n, g) for n, g, _ in launched if n.startswith("latent_attention")]
        splits = min(4, ops_module.ATTENTION_PARTIALS_BYTES // (4 * n_tok * n_heads * (v_width + 2)))
        if capability < (9, 0):
            assert got[0][0] == "latent_attention" and {n for n, _ in got[1:]} <= {"latent_attention_combine"}, n_tok
        elif n_tok >= 64:
            assert got == [("latent_attention_prefill", (-(-n_tok * n_heads // 128), 2, 1))], n_tok
        else:
            assert got == [("latent_attention_decode", (n_tok, 2, splits)), ("latent_attention_combine", (n_tok, n_heads))], n_tok
    for kernel, rows in (("latent_attention_prefill", 128), ("latent_attention_decode", 16)):
        shared = (rows + 2 * 32) * (width + 8) * 2 + 2 * 32 * 4
        assert ((kernel, driver.FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared) in allowed) == (capability >= (9, 0))


def test_tools_step_launches_counts_what_one_more_decode_step_launches(fake, monkeypatch):
    """tools/step_launches.py (a decode step's launches before a device call): on the qwen3 fixture (two layers), the
    launches of one step, each layer's rope and attention among them, and a step's one sampler launch."""
    from step_launches import step_launches

    monkeypatch.setenv("REFLEX_CUDA_GRAPHS", "0")
    step = Counter(step_launches(MODEL, fake()))
    assert step["rope_f32"] == step["matvec_x16_1_rope_q4_K"] == 1 and step["attention_cluster"] == 2, step
    assert step["top_k"] == 1, step
