"""What each kind of kernel costs inside a replayed decode step: the step's CUDA graph captured
after a prompt of each --contexts' length (the cache as `reflex bench` sizes it), then replayed with kernel nodes
switched off by name
(cuGraphNodeSetEnabled): all on, each name off alone, only the matvecs on, only the rest on; with --places, each
matvec's place instead of its name alone (its grid and the kernel before it: o after attention, down after SwiGLU). A
switched-off kernel leaves its outputs stale, so later kernels compute on garbage; on dense models what they read and
how long they take do not depend on the values (no kernel branches on them but attention's masks, which read the
step's ints, untouched). A MoE router does: there the per-name rows move which experts run (the output says so).

    PYTHONPATH=src python3 tools/probe_graph_nodes.py MODEL [--replays 200] [--places] [--contexts 128,4096]

A throwaway measurement tool: it keeps the captured graph the engine would destroy.
"""
import argparse
import ctypes
import statistics
import sys
from collections import Counter
from ctypes import byref, c_float, c_size_t, c_void_p

import reflex_engine
from reflex_engine.errors import ReflexError
from reflex_engine.sampling import SamplingParams

NODE_KERNEL = 0  # CU_GRAPH_NODE_TYPE_KERNEL
EVENT_DEFAULT = 0


def kernel_nodes(lib, graph, names_of: dict[int, str]) -> list[tuple[c_void_p, str, int]]:
    """(node, kernel name, gridDim.x) of each kernel node, in the graph's order (the launches')."""
    count = c_size_t()
    assert lib.cuGraphGetNodes(graph, None, byref(count)) == 0
    nodes = (c_void_p * count.value)()
    assert lib.cuGraphGetNodes(graph, nodes, byref(count)) == 0
    out, kind, params = [], ctypes.c_int(), (ctypes.c_uint8 * 256)()
    for node in nodes:
        assert lib.cuGraphNodeGetType(c_void_p(node), byref(kind)) == 0
        if kind.value == NODE_KERNEL:
            assert lib.cuGraphKernelNodeGetParams_v2(c_void_p(node), params) == 0
            func = ctypes.c_void_p.from_buffer(params).value  # CUDA_KERNEL_NODE_PARAMS_v2's first field
            grid = ctypes.c_uint32.from_buffer(params, 8).value  # then gridDimX
            out.append((c_void_p(node), names_of.get(func, f"? {func:#x}"), grid))
    return out


def places(nodes) -> list[tuple[c_void_p, str]]:
    """Each matvec node named by its grid and the kernel node before it, the others by their name."""
    out, before = [], "the step's start"
    for node, name, grid in nodes:
        out.append((node, f"{name} [{grid}] after {before}" if name.startswith("matvec") else name))
        before = name
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--places", action="store_true")
    ap.add_argument("--contexts", default="128,4096")
    args = ap.parse_args()
    model, contexts = load_for_steps("probe_graph_nodes", args, min_replays=5)
    for context in contexts:
        probe(model, context, args)


def load_for_steps(tool: str, args, min_replays: int):
    """(the model on CUDA, its cache sized as `reflex bench` sizes it for the longest context, its own forward's
    graphs closed; the --contexts), or the tool's exit with what is wrong."""
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        contexts = []
    if args.replays < min_replays or not contexts or min(contexts) < 1:
        sys.exit(f"{tool}: --replays takes {min_replays} or more, --contexts comma-separated lengths of 1 or more")
    try:
        model = reflex_engine.load(args.model, device="cuda", n_ctx=max(contexts) + 256)
    except ReflexError as e:
        sys.exit(f"{tool}: {e}")
    model._forward.close()
    return model, contexts


def captured_step(model, context: int):
    """(graph exec, graph, [(node, kernel name, gridDim.x)]) of the decode step after a prompt of `context` tokens,
    the graph kept from the engine (the caller destroys it)."""
    dev = model.ops.device
    drv = dev.drv
    kept = []
    destroy = drv.cuGraphDestroy
    drv.cuGraphDestroy = kept.append  # the engine destroys the graph once instantiated: keep it
    greedy = SamplingParams(temperature=0)
    prompt = [(1000 + i) % model.config.n_vocab for i in range(context)]
    for _ in model.generate(prompt, max_tokens=4, sampling=greedy, ignore_eos=True):
        pass
    drv.cuGraphDestroy = destroy
    # the decode step's: the generation's last pass replayed it, and its capture is the one this prompt made
    exec_, graph = model._forward.graphs[next(reversed(model._forward.graphs))]._exec, kept[-1]
    names_of = {fn.value: name for name, fn in dev._functions.items()}
    return exec_, graph, kernel_nodes(drv._lib, graph, names_of)


def probe(model, context: int, args) -> None:
    """The table of a decode step after a prompt of `context` tokens."""
    dev = model.ops.device
    drv, lib, stream = dev.drv, dev.drv._lib, dev.stream
    exec_, graph, nodes = captured_step(model, context)
    destroy = drv.cuGraphDestroy
    nodes = places(nodes) if args.places else [(node, name) for node, name, _ in nodes]
    counts = Counter(name for _, name in nodes)
    start, end = c_void_p(), c_void_p()
    drv.cuEventCreate(byref(start), EVENT_DEFAULT)
    drv.cuEventCreate(byref(end), EVENT_DEFAULT)

    def step_us(off) -> float:
        """us a replay with the kernels whose names off() picks switched off (median of 5 runs of replays)."""
        for node, name in nodes:
            assert lib.cuGraphNodeSetEnabled(exec_, node, 0 if off(name) else 1) == 0
        for _ in range(10):
            drv.cuGraphLaunch(exec_, stream)
        times = []
        for _ in range(5):
            drv.cuEventRecord(start, stream)
            for _ in range(args.replays // 5):
                drv.cuGraphLaunch(exec_, stream)
            drv.cuEventRecord(end, stream)
            drv.cuEventSynchronize(end)
            ms = c_float()
            drv.cuEventElapsedTime(byref(ms), start, end)
            times.append(ms.value * 1e3 / (args.replays // 5))
        return statistics.median(times)

    matvec = lambda name: name.startswith("matvec")  # noqa: E731
    full = step_us(lambda name: False)
    print(f"## {args.model}: a decode step at a {context}-token context, {len(nodes)} kernel nodes, {full:.1f} us a replay "
          f"({1e6 / full:.0f} tok/s)\n")
    if model.config.n_expert:
        print("Experts: the router reads what a switched-off kernel left stale, so other experts run; a row that switches\n"
              "off anything before a router moves the experts' bytes too (run 31: SwiGLU off made a DeepSeek step slower).\n")
    print("| kernels switched off | nodes | us a step | saved us | saved a node |\n|---|---|---|---|---|")
    rows = [(name, lambda n, name=name: n == name, counts[name]) for name in sorted(counts)]
    rows += [("all but the matvecs", lambda n: not matvec(n), sum(c for n, c in counts.items() if not matvec(n))),
             ("the matvecs", matvec, sum(c for n, c in counts.items() if matvec(n))),
             ("all", lambda n: True, len(nodes))]
    for label, off, n in rows:
        us = step_us(off)
        print(f"| {label} | {n} | {us:.1f} | {full - us:.1f} | {(full - us) / max(n, 1):.2f} |", flush=True)
    for node, _ in nodes:  # the engine's graph as it was
        assert lib.cuGraphNodeSetEnabled(exec_, node, 1) == 0
    destroy(graph)


if __name__ == "__main__":
    sys.exit(main())
