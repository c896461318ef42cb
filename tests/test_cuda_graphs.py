"""Passes replayed as CUDA graphs give what eager launches give: decode steps the same tokens
and the same log-probabilities, greedy and sampled (penalties included), at every position,
across requests on one model, and prompts of a repeated length the same logits bit for bit;
the graph is really what ran. A greedy decode that runs a pass ahead of the host gives the
tokens of one that waits."""
import random

import numpy as np
import pytest

import reflex_engine
from reflex_engine.sampling import SamplingParams
from test_goldens import paths

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away"]
SAMPLINGS = [SamplingParams(temperature=0),
             SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=7),
             SamplingParams(temperature=0.7, min_p=0.05, repeat_penalty=1.3, presence_penalty=0.5, seed=11)]


def run(model, prompt, sampling):
    gen = model.generate(prompt, max_tokens=40, sampling=sampling, ignore_eos=True, top_logprobs=3)
    events = [e for e in gen if e.id is not None]
    return [e.id for e in events], [e.logprob for e in events], [[t.token for t in e.top_logprobs] for e in events]


# qwen3moe: its greedy checks (test_moe.py) caught a queued pass reading the next step's ints (run 13),
# which these two dense fixtures' decodes never did
@pytest.fixture(scope="module", params=[("qwen3", "Q4_K"), ("llama", "Q8_0"), ("qwen3moe", "Q8_0")], ids=lambda p: "-".join(p))
def models(request):
    path = paths(*request.param)[0]
    graphed = reflex_engine.load(path, device="cuda", n_ctx=256)
    mp = pytest.MonkeyPatch()
    mp.setenv("REFLEX_CUDA_GRAPHS", "0")
    eager = reflex_engine.load(path, device="cuda", n_ctx=256)
    mp.undo()
    return graphed, eager


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "top-k-top-p", "min-p-penalties"])
def test_replayed_decode_equals_eager_decode(models, sampling):
    graphed, eager = models
    for prompt in PROMPTS:  # the second request replays the graph captured by the first
        got, want = run(graphed, prompt, sampling), run(eager, prompt, sampling)
        assert got[0] == want[0]
        assert got[2] == want[2]
        assert got[1] == pytest.approx(want[1], abs=1e-6)
    assert 1 in [shape[0] for shape in graphed._forward.graphs]  # the decode step's graph
    assert type(eager._forward).__name__ != "ReplayedPasses"


def test_a_greedy_decode_queued_ahead_of_the_host_equals_one_waiting_for_each_token(models):
    """Greedy without scores, each pass reads the device's own choice before the host has it;
    with scores (run's top_logprobs) the host reads each token first."""
    for model in models:  # replayed and eager
        for prompt in PROMPTS:
            gen = model.generate(prompt, max_tokens=40, sampling=SAMPLINGS[0], ignore_eos=True)
            assert [e.id for e in gen if e.id is not None] == run(model, prompt, SAMPLINGS[0])[0]


def test_replayed_prompt_passes_equal_eager_ones(models):
    graphed, eager = models
    rng = random.Random(5)
    for n in (8, 3, 8):  # the third and later of each run of one length replay the second's graph
        for _ in range(4):
            ids = [rng.randrange(1, graphed.config.n_vocab) for _ in range(n)]
            np.testing.assert_array_equal(graphed.logits(ids), eager.logits(ids))
    for _ in range(4):  # a 16-token prompt's pass, its last row's logits sampled from
        prompt = [rng.randrange(1, graphed.config.n_vocab) for _ in range(16)]
        assert run(graphed, prompt, SAMPLINGS[1]) == run(eager, prompt, SAMPLINGS[1])
    assert 16 in [shape[0] for shape in graphed._forward.graphs]


def test_kernels_that_start_before_the_previous_one_ends_compute_what_serialized_kernels_do(monkeypatch):
    """Programmatic stream serialization (device.py) lets each kernel's blocks start early and
    wait inside it: a kernel that read or wrote before that wait would race, and differ here."""
    path = paths("qwen3", "Q4_K")[0]
    overlapped = reflex_engine.load(path, device="cuda", n_ctx=256)
    monkeypatch.setenv("REFLEX_CUDA_PDL", "0")
    serialized = reflex_engine.load(path, device="cuda", n_ctx=256)
    assert overlapped.ops.device._config is not None and serialized.ops.device._config is None
    for sampling in SAMPLINGS[:2]:
        got, want = run(overlapped, PROMPTS[1], sampling), run(serialized, PROMPTS[1], sampling)
        assert got == want  # the same kernels on the same inputs: bit for bit
