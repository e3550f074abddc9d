"""Speculative decoding with mask-based rewind: the pure helpers, and output token-identical
to greedy decoding in one process (mask and trim rewind, lookup and model drafters). (Across
stage processes, the rewind carried in the next step's frame:
tests/e2e/test_stage_processes.py.)"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.draft_model import ModelDrafter
from dataplane.runtime.stateful import StageRunner
from zctl.engine.drafting import (
    LookupDrafter,
    StepCost,
    accept_prefix,
    adapt_k,
    estimate_acceptance,
    expected_tokens,
    fit_step_cost,
    lookup_draft,
    periodic_continuation,
)
from zctl.engine.executor import InlineExecutor
from zctl.engine.scheduler import generate_greedy, generate_speculative
from zctl.engine.stats import SpeculativeStats

EXACT = RuntimeSpec(precision="f32", kv_cache_precision="f32")
REPEAT = [0, 11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12, 13]
PROMPTS = [[0, 17, 42, 99, 5, 230, 7], REPEAT, [0, 300, 301, 302]]
N = 24


# -- pure helpers ------------------------------------------------------------------------

def test_accept_prefix() -> None:
    assert accept_prefix([], [7]) == 0
    assert accept_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert accept_prefix([1, 2, 3], [1, 9, 3, 4]) == 1
    assert accept_prefix([5, 2], [1, 2, 3]) == 0
    assert accept_prefix(np.array([4, 4]), np.array([4, 4, 4])) == 2
    with pytest.raises(ValueError):
        accept_prefix([1, 2, 3], [1, 2])


def test_lookup_draft() -> None:
    assert lookup_draft([1, 2, 3, 4], 3) == []  # nothing repeats
    assert lookup_draft([], 3) == [] and lookup_draft([1, 1], 0) == []
    # the longest suffix n-gram wins over a more recent shorter one
    assert lookup_draft([1, 2, 3, 7, 8, 9, 3, 5, 1, 2, 3], 2) == [7, 8]
    # the most recent occurrence of the n-gram wins
    assert lookup_draft([1, 2, 5, 6, 1, 2, 8, 9, 1, 2], 2) == [8, 9]
    # up to k tokens, periodic extension past the end of the history
    assert lookup_draft([5, 1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]
    assert lookup_draft([4, 4, 4], 3) == [4, 4, 4]
    assert lookup_draft([1, 2, 3, 1, 2], 2, max_ngram=1) == [3, 1]
    assert lookup_draft([1, 2, 9, 2], 2, min_ngram=2) == []


def test_periodic_continuation() -> None:
    assert periodic_continuation([9, 1, 2, 3], 3, 7) == [1, 2, 3, 1, 2, 3, 1]
    assert periodic_continuation([5, 4], 1, 3) == [4, 4, 4]
    assert periodic_continuation([5, 4], 2, 0) == []
    for bad in (0, 3):
        with pytest.raises(ValueError):
            periodic_continuation([5, 4], bad, 2)


def test_adapt_k_follows_the_cost_model() -> None:
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    lan, wan = StepCost(step_ms=25, token_ms=2), StepCost(step_ms=125, token_ms=2)
    assert adapt_k(0.0, lan) == 0  # nothing is ever accepted: do not draft
    assert 5 <= adapt_k(0.8, lan) <= 7  # the paper's LAN range
    assert adapt_k(0.8, wan) >= 10  # >= 50 ms per hop: longer drafts
    assert adapt_k(0.8, lan) <= adapt_k(0.9, lan)
    assert adapt_k(1.0, StepCost(10, 0), k_max=12) == 12  # free verification: draft all
    assert adapt_k(0.8, StepCost(10, 50), k_min=1) == 1
    assert adapt_k(0.8, StepCost(25, 2, draft_ms=10)) < adapt_k(0.8, lan)  # costly drafter
    assert estimate_acceptance(0, 0) == 0.5 and estimate_acceptance(98, 0) > 0.98
    assert estimate_acceptance(3, 3, weight=0) == 0.5
    fit = fit_step_cost([1, 3, 5, 1], [10.0, 14.0, 18.0, 10.0])
    assert fit is not None and fit.step_ms == pytest.approx(10) and fit.token_ms == pytest.approx(2)
    assert fit_step_cost([2, 2], [1.0, 2.0]) is None


# -- in one process ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def export2(tiny_exports):
    return tiny_exports.get([(0, 2), (2, 4)])


@pytest.fixture(scope="module")
def chains(export2) -> dict[str, LocalChain]:
    return {mode: LocalChain.load(str(export2), EXACT, rewind=mode) for mode in ("mask", "trim")}


@pytest.fixture(scope="module")
def expected(chains) -> list[list[int]]:
    return [list(generate_greedy(chains["mask"], p, N, prefill_chunk=4)) for p in PROMPTS]


def speculate(pipe, prompt, n=N, k=4, **kw) -> tuple[list[int], SpeculativeStats]:
    stats = SpeculativeStats()
    tokens = list(generate_speculative(pipe, prompt, n, k=k, stats=stats, prefill_chunk=4, **kw))
    return tokens, stats


class ScriptedDrafter:
    """Proposes the true greedy continuation with one token spoiled per proposal, the
    spoiled index cycling 0..k, so every accept count (none, some, all + bonus) and every
    rewind length 0..k occurs. It also checks the history it is given."""

    replayable = False

    def __init__(self, prompt: list[int], greedy: list[int], check: bool = True) -> None:
        self.full, self.check, self.calls, self.counts = prompt + greedy, check, 0, []

    def propose(self, history, k):
        assert not self.check or list(history) == self.full[:len(history)]
        draft = self.full[len(history):len(history) + k]
        bad = self.calls % (k + 1)
        self.calls += 1
        if bad < len(draft):
            draft[bad] = (draft[bad] + 1) % 384
        return draft

    def accept(self, n: int) -> None:
        self.counts.append(n)


@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_speculative_equals_greedy(mode, chains, expected) -> None:
    accepted = 0
    for prompt, want in zip(PROMPTS, expected, strict=True):
        got, stats = speculate(chains[mode], prompt)  # lookup drafting
        assert got == want
        assert stats.new_tokens == N and stats.accepted <= stats.proposed
        assert stats.steps == len(stats.fed) == len(stats.step_ms) == N - 1 - stats.accepted
        accepted += stats.accepted
    assert accepted > 0  # drafts were accepted: the test is not plain greedy in disguise
    for prompt, want in zip(PROMPTS, expected, strict=True):
        drafter = ScriptedDrafter(prompt, want)
        got, stats = speculate(chains[mode], prompt, drafter=drafter)
        assert got == want
        assert set(drafter.counts[:5]) == {0, 1, 2, 3, 4} and stats.rejections > 0
        assert stats.steps < N // 2


def test_stop_ids_and_short_limits_match_greedy(chains, expected) -> None:
    chain = chains["mask"]
    want = expected[1]
    stop = want[N // 2]
    cut = want[:want.index(stop) + 1]
    assert speculate(chain, REPEAT, stop_ids=[stop])[0] == cut
    for n in (1, 2, 5):
        assert speculate(chain, REPEAT, n=n)[0] == want[:n]
    assert speculate(chain, REPEAT, k=0)[0] == want  # k = 0 is greedy
    assert speculate(chain, REPEAT, k=9)[0] == want


def test_adaptive_k_still_matches_greedy(chains, expected) -> None:
    got, stats = speculate(chains["mask"], REPEAT, k=8, cost=StepCost(step_ms=20, token_ms=1))
    assert got == expected[1] and stats.accepted > 0


class SkewedRewind(InlineExecutor):
    """A LocalChain whose carried rewinds are off by ``delta``: the output must change."""

    def __init__(self, chain: LocalChain, delta: int) -> None:
        super().__init__()
        self.chain, self.delta, self.num_stages = chain, delta, chain.num_stages
        self.open, self.reset = chain.open, chain.reset

    def compute(self, step):
        mask_tail = step.mask_tail
        return self.chain.compute(replace(step, mask_tail=mask_tail + self.delta if mask_tail
                                          else 0))


@pytest.mark.parametrize("delta", [-1, 1])
def test_an_off_by_one_rewind_changes_the_output(delta, chains, expected) -> None:
    for prompt, want in zip(PROMPTS, expected, strict=True):
        drafter = ScriptedDrafter(prompt, want, check=False)
        got, stats = speculate(SkewedRewind(chains["mask"], delta), prompt, drafter=drafter)
        assert stats.rejections > 0  # the rewind was exercised
        assert got != want


class RewindFirst(InlineExecutor):
    """A LocalChain whose steps' rewinds go through ``rewind()`` before the step."""

    def __init__(self, chain: LocalChain) -> None:
        super().__init__()
        self.chain, self.num_stages, self.rewinds = chain, chain.num_stages, 0
        self.open, self.reset = chain.open, chain.reset

    def compute(self, step):
        if step.mask_tail:
            self.rewinds += 1
            self.chain.rewind(step.stream_id, step.mask_tail)
        return self.chain.compute(replace(step, mask_tail=0))


def test_rewind_on_its_own_and_compaction(export2, chains, expected) -> None:
    pipe = RewindFirst(chains["mask"])
    got, stats = speculate(pipe, REPEAT)
    assert got == expected[1] and pipe.rewinds == stats.rejections > 0
    compacting = LocalChain.load(str(export2), EXACT, compact_threshold=1)
    worst = 0
    for prompt, want in zip(PROMPTS, expected, strict=True):
        got = []
        for token in generate_speculative(compacting, prompt, N, k=4, prefill_chunk=4):
            got.append(token)
            slots = compacting.runners[0].streams.get(0)  # closed after the last token
            if slots is not None:
                worst = max(worst, slots.physical - slots.logical)
        assert got == want
    assert compacting.compactions > 0
    assert worst <= 1 + 4
    with pytest.raises(ValueError):
        LocalChain.load(str(export2), EXACT, rewind="undo")


def test_model_drafter(tiny_exports, chains, expected) -> None:
    # the target itself as a 1-stage draft model: every draft is accepted
    drafter = ModelDrafter(StageRunner(tiny_exports.get([(0, 4)]), 0, EXACT))
    for prompt, want in zip(PROMPTS, expected, strict=True):
        got, stats = speculate(chains["mask"], prompt, drafter=drafter)
        assert got == want
        assert stats.accepted == stats.proposed > 0 and stats.rejections == 0
    # a drafter that disagrees gets rejected, and the output still matches
    class Wrong(LookupDrafter):
        def propose(self, history, k):
            return [(t + 1) % 384 for t in super().propose(history, k)]
    got, stats = speculate(chains["mask"], REPEAT, drafter=Wrong())
    assert got == expected[1] and stats.rejections > 0
