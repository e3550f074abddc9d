"""Sampling and lossless speculative sampling: the distributions are exact (checked against
the closed form with fixed seeds), and top_k=1 sampling reproduces greedy on real stages."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from zctl.engine.drafting import LookupDrafter
from zctl.engine.executor import InlineExecutor, StepReply
from zctl.engine.sampling import SamplingParams, draw, speculative_sample, target_probs
from zctl.engine.scheduler import generate_greedy, generate_speculative, run_sessions
from zctl.engine.sessions import DecodeSession


def tv(empirical: Counter, exact: dict, n: int) -> float:
    keys = set(empirical) | set(exact)
    return 0.5 * sum(abs(empirical.get(k, 0) / n - exact.get(k, 0.0)) for k in keys)


def test_target_probs_temperature_top_k_top_p() -> None:
    logits = np.log(np.array([[0.1, 0.2, 0.3, 0.4]]))
    assert np.allclose(target_probs(logits, SamplingParams(1.0)), [[0.1, 0.2, 0.3, 0.4]])
    cold = target_probs(logits, SamplingParams(0.5))[0]
    assert np.allclose(cold, np.array([0.01, 0.04, 0.09, 0.16]) / 0.30)
    assert np.allclose(target_probs(logits, SamplingParams(1.0, top_k=2)), [[0, 0, 3 / 7, 4 / 7]])
    # top_p keeps the smallest prefix (by probability) whose mass reaches top_p
    assert np.allclose(target_probs(logits, SamplingParams(1.0, top_p=0.7)), [[0, 0, 3 / 7, 4 / 7]])
    assert np.allclose(target_probs(logits, SamplingParams(1.0, top_p=0.71)),
                       [[0, 2 / 9, 3 / 9, 4 / 9]])
    assert np.allclose(target_probs(logits, SamplingParams(1.0, top_p=0.3)), [[0, 0, 0, 1]])
    # min_p keeps the tokens at least that fraction as likely as the most likely one
    assert np.allclose(target_probs(logits, SamplingParams(1.0, min_p=0.5)),
                       [[0, 2 / 9, 3 / 9, 4 / 9]])  # 0.1 < 0.5 * 0.4
    assert np.allclose(target_probs(logits, SamplingParams(1.0, min_p=0.7)),
                       [[0, 0, 3 / 7, 4 / 7]])
    assert np.allclose(target_probs(logits, SamplingParams(1.0, min_p=1.0)), [[0, 0, 0, 1]])
    assert np.allclose(target_probs(logits, SamplingParams(1.0, top_k=3, min_p=0.6)),
                       [[0, 0, 3 / 7, 4 / 7]])  # after top-k: 0.2 / 0.9 < 0.6 * 0.4 / 0.9
    for bad in ({"temperature": -1.0}, {"temperature": float("nan")}, {"top_k": -2},
                {"top_p": 0.0}, {"top_p": 1.5}, {"min_p": -0.1}, {"min_p": 1.5}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError):
        target_probs(logits, SamplingParams(0.0))


def test_draw_follows_the_distribution() -> None:
    rng = np.random.default_rng(1)
    p = np.array([0.5, 0.0, 0.25, 0.25])
    counts = Counter(draw(p, rng) for _ in range(20000))
    assert counts[1] == 0 and tv(counts, dict(enumerate(p)), 20000) < 0.02


def test_a_top_k_replys_row_and_ties_at_the_kth_token() -> None:
    # a top-k reply's row: log-probabilities on its tokens, -inf on the rest of the vocabulary
    row = np.full((2, 1000), -np.inf)
    row[:, [7, 400, 999]] = np.log([0.2, 0.5, 0.3])
    want = np.zeros(1000)
    want[[7, 400, 999]] = [0.2, 0.5, 0.3]
    assert np.allclose(target_probs(row, SamplingParams(1.0)), [want, want])
    two = target_probs(row, SamplingParams(1.0, top_k=2))[0]
    assert np.allclose(two[[400, 999]], [5 / 8, 3 / 8]) and two.sum() == pytest.approx(1.0)
    assert np.count_nonzero(target_probs(row, SamplingParams(1.0, top_k=5))) == 6  # 3 a row
    tied = np.log(np.array([[0.1, 0.3, 0.3, 0.3]]))
    assert np.allclose(target_probs(tied, SamplingParams(1.0, top_k=2)), [[0, 1 / 3, 1 / 3, 1 / 3]])


def test_draw_takes_the_token_a_sum_over_the_whole_row_would() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        p = np.where(rng.random(5000) < 0.01, rng.random(5000), 0.0)
        p /= p.sum()
        seed = int(rng.integers(1 << 30))
        cdf = np.cumsum(p)
        x = np.random.default_rng(seed).random() * cdf[-1]
        whole = int(min(np.searchsorted(cdf, x, side="right"), p.size - 1))
        assert draw(p, np.random.default_rng(seed)) == whole


@pytest.mark.parametrize("stochastic_draft", [False, True])
def test_speculative_sample_keeps_the_target_distribution(stochastic_draft: bool) -> None:
    """First emitted token ~ p0; the second, given the first was the accepted draft, ~ p1."""
    gen = np.random.default_rng(7)
    probs = gen.dirichlet(np.ones(5), size=3)  # K = 2 drafts + the bonus
    q = gen.dirichlet(np.ones(5), size=2)
    rng = np.random.default_rng(11)
    first, second, n_trials = Counter(), Counter(), 30000
    accepted = 0
    for _ in range(n_trials):
        draft = ([draw(q[0], rng), draw(q[1], rng)] if stochastic_draft else [1, 3])
        n, token = speculative_sample(draft, probs, rng, q if stochastic_draft else None)
        emitted = [*draft[:n], token]
        first[emitted[0]] += 1
        accepted += n
        if not stochastic_draft and emitted[0] == 1:
            second[emitted[1]] += 1
    assert tv(first, dict(enumerate(probs[0])), n_trials) < 0.015
    if not stochastic_draft:
        assert tv(second, dict(enumerate(probs[1])), sum(second.values())) < 0.02
    assert accepted > 0
    with pytest.raises(ValueError):
        speculative_sample([1, 2], probs[:2], rng)


class TableModel(InlineExecutor):
    """A fake pipeline over a vocabulary of V tokens: logits of the token after t at position
    p are a fixed random row; replies carry logits when asked."""

    num_stages, V = 1, 4

    def __init__(self) -> None:
        super().__init__()
        self.table = np.random.default_rng(3).normal(size=(self.V, 64, self.V)) * 1.5

    def open(self, stream_id: int) -> None:
        pass

    def reset(self, stream_id: int, long_rope: bool = False) -> None:
        pass

    def close_stream(self, stream_id: int) -> None:
        pass

    def compute(self, step):
        rows = self.table[np.asarray(step.token_ids), np.asarray(step.positions)]
        rows = rows if step.logits_idx is not None else rows[-1:]
        return StepReply(tokens=rows.argmax(-1), logits=rows if step.want_logits else None)


def test_speculative_sampling_session_matches_the_exact_joint_distribution() -> None:
    """Tokens 2 and 3 (the first verify step: a draft checked by rejection sampling) have
    exactly the joint distribution of sampling from the target alone."""
    model, params = TableModel(), SamplingParams(1.0)
    prompt = [1, 2, 1, 2, 1, 2, 1]  # repetitive: the lookup drafter proposes
    pos = len(prompt)

    def p(token: int, position: int) -> np.ndarray:
        return target_probs(model.table[token, position], params)

    exact: dict[tuple[int, int], float] = Counter()
    for t1 in range(4):
        for t2 in range(4):
            for t3 in range(4):
                exact[t2, t3] += p(prompt[-1], pos - 1)[t1] * p(t1, pos)[t2] * p(t2, pos + 1)[t3]
    for k in (0, 3):
        sessions = [DecodeSession(i, prompt, 3, k=k, drafter=LookupDrafter(),
                                  sampling=SamplingParams(1.0, seed=i)) for i in range(6000)]
        for session in sessions:
            for update in run_sessions(model, [session]):
                assert update.session.error is None
        joint = Counter(tuple(s.emitted[1:]) for s in sessions)
        assert tv(joint, exact, len(sessions)) < 0.04, k
        if k:
            accepted = sum(s.spec.accepted for s in sessions)
            assert 50 < accepted < sum(s.spec.proposed for s in sessions)  # both paths taken


def test_same_seed_same_output() -> None:
    model = TableModel()
    runs = [list(generate_speculative(model, [1, 2, 1, 2], 12, k=2,
                                      sampling=SamplingParams(0.8, seed=5))) for _ in range(2)]
    assert runs[0] == runs[1]


def test_top_k_one_sampling_equals_greedy_on_real_stages(tiny_exports) -> None:
    chain = LocalChain.load(str(tiny_exports.get([(0, 2), (2, 4)])),
                            RuntimeSpec(precision="f32", kv_cache_precision="f32"))
    prompt = [0, 11, 12, 13, 14, 11, 12, 13, 14, 11]
    want = list(generate_greedy(chain, prompt, 16))
    one_hot = SamplingParams(temperature=0.7, top_k=1, seed=0)
    assert list(generate_speculative(chain, prompt, 16, k=0, sampling=one_hot)) == want
    assert list(generate_speculative(chain, prompt, 16, k=4, sampling=one_hot)) == want
