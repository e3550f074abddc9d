"""What a stream's KV costs against the stages' budget when sliding layers keep only
their window."""

from __future__ import annotations

import pytest

from zctl.engine.admission import SessionLimits, new_tokens_allowed
from zctl.engine.kv_cost import EVERY_TOKEN, KvCost
from zctl.engine.requests import RequestRefused

# Gemma 3 270M's 18 layers on 2 stages: 5 of every 6 layers slide
GEMMA = KvCost(stages=((2, 7), (1, 8)), sliding_tokens=1088)


def test_every_layer_keeping_every_token_costs_the_streams_tokens() -> None:
    assert [EVERY_TOKEN.tokens(t) for t in (0, 1, 32768)] == [0, 1, 32768]
    assert KvCost(((3, 0),), 64).tokens(1000) == 1000  # no sliding layer


def test_sliding_layers_cost_their_window_the_global_ones_every_token() -> None:
    # within the window every layer holds the whole stream
    assert GEMMA.tokens(1000) == 1000
    # past it the fuller stage in global layers costs the most: (2 x T + 7 x 1088) / 9
    assert GEMMA.tokens(32768) == -(-(2 * 32768 + 7 * 1088) // 9)
    assert GEMMA.tokens(32768) < 32768 // 3


@pytest.mark.parametrize("stages, kept", [(((0, 0),), 8), (((1, -1),), 8), (((1, 1),), 0)])
def test_a_stage_without_layers_or_a_window_of_nothing_is_refused(stages, kept) -> None:
    with pytest.raises(ValueError):
        KvCost(stages, kept)


def test_admission_counts_the_smaller_need() -> None:
    """A request the budget refuses when every layer keeps every token fits once sliding
    layers keep only their window."""
    limits = SessionLimits(max_context=32768, kv_budget_tokens=8192, vocab_size=50,
                           stop_ids=[2])
    with pytest.raises(RequestRefused, match="need more KV than a stage may hold"):
        new_tokens_allowed(20000, 100, limits)
    sliding = SessionLimits(32768, 8192, 50, [2], kv_cost=GEMMA)
    assert new_tokens_allowed(20000, 100, sliding) == 100
    with pytest.raises(RequestRefused):  # the global layers alone outgrow it
        new_tokens_allowed(32000, 700, SessionLimits(32768, 4096, 50, [2], kv_cost=GEMMA))
