"""Sampling: greedy, seeds, and each filter's contract on a known distribution."""
import numpy as np
import pytest

from reflex_engine.backends.cpu.sampler import Sampler, log_softmax
from reflex_engine.errors import ReflexError
from reflex_engine.sampling import SamplingParams, candidate_distribution

LOGITS = np.log(np.array([0.40, 0.25, 0.15, 0.10, 0.06, 0.04], np.float32))


def draws(n=400, **params):
    sampler = Sampler(SamplingParams(**{"seed": 1, **params}))
    return {sampler(LOGITS, []) for _ in range(n)}


def test_temperature_zero_is_argmax():
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert Sampler(SamplingParams(temperature=0))(logits, []) == int(np.argmax(logits))


def test_same_seed_same_tokens_other_seed_differs():
    def run(seed):
        s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed))
        return [s(LOGITS, []) for _ in range(50)]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_filters_keep_exactly_the_expected_tokens():
    open_filters = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    assert draws(**open_filters) == {0, 1, 2, 3, 4, 5}
    assert draws(**{**open_filters, "top_k": 2}) == {0, 1}
    assert draws(**{**open_filters, "top_p": 0.8}) == {0, 1, 2}  # 0.40 + 0.25 + 0.15 reaches 0.8
    assert draws(**{**open_filters, "min_p": 0.3}) == {0, 1, 2}  # p >= 0.3 * 0.40


def test_repeat_and_presence_penalties_follow_llama_cpp():
    logits = np.array([2.0, -2.0, 1.0], np.float32)
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=4.0))
    assert s(logits, [0]) == 2  # 2.0 / 4 = 0.5 < 1.0
    s = Sampler(SamplingParams(temperature=0, presence_penalty=1.5))
    assert s(logits, [0]) == 2  # 2.0 - 1.5 = 0.5
    assert s(logits, [1]) == 0
    assert s(logits, []) == 0


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=2), dict(top_k=-1),
                                 dict(repeat_penalty=0), dict(seed=-1)])
def test_bad_parameters_are_rejected(bad):
    with pytest.raises(ReflexError):
        SamplingParams(**bad)


def test_log_softmax_rows_sum_to_one():
    rows = np.random.default_rng(2).standard_normal((3, 50)).astype(np.float32) * 30
    np.testing.assert_allclose(np.exp(log_softmax(rows)).sum(axis=1), 1.0, rtol=1e-12)


@pytest.mark.parametrize("params", [dict(top_k=40, top_p=0.95, min_p=0.05), dict(top_k=1), dict(top_k=0, top_p=0.9, min_p=0.0),
                                    dict(top_k=0, top_p=1.0, min_p=0.0), dict(top_k=0, top_p=1.0, min_p=0.1),
                                    dict(top_k=7, top_p=0.5, min_p=0.2, temperature=0.3), dict(top_k=300, top_p=0.99)])
def test_candidate_distribution_equals_the_numpy_sampler(params):
    """The plain-Python filters a device backend runs on its top candidates give the numpy
    sampler's distribution, and say when the candidates cannot settle it."""
    p = SamplingParams(**{"temperature": 0.8, **params})
    for scale in (3.0, 0.01):  # peaked, and so flat that 256 candidates hold too little mass
        logits = (np.random.default_rng(5).standard_normal(4000) * scale).astype(np.float32)
        logits[10:20] = logits.max()  # ties at the top
        want_ids, want_probs = Sampler(p).distribution(logits, [])
        order = np.argsort(-logits, kind="stable")
        normalizer = float(np.exp(logits.astype(np.float64) - logits.max()).sum())
        for n in (256, 4000):
            got = candidate_distribution(p, order[:n].tolist(), logits[order[:n]].tolist(), normalizer, complete=n == 4000)
            if got is None:  # only when the candidates do not reach what the filters keep, or top-k
                assert n == 256 and (len(want_ids) >= 256 or p.top_k > 256)
                continue
            assert got[0] == want_ids.tolist()
            np.testing.assert_allclose(got[1], want_probs, rtol=1e-6, atol=1e-12)
