"""Step padding (dataplane.runtime.step_shapes): which padding a step takes, and the limit measured
from what a change of shape costs against what a token costs."""

from __future__ import annotations

import pytest

from dataplane.runtime.step_shapes import (
    ShapeKeeper,
    bucket_pad,
    measure_padding_limit,
    padding_limit,
)


def test_a_step_is_padded_up_to_the_recent_largest_within_the_limit() -> None:
    keeper = ShapeKeeper(limit=7, window=3)
    assert [keeper.pad(t) for t in (8, 7, 1, 8, 4, 3)] == [0, 1, 7, 0, 4, 5]


def test_padding_stops_once_the_larger_steps_left_the_window() -> None:
    keeper = ShapeKeeper(limit=7, window=2)
    assert [keeper.pad(t) for t in (8, 6, 6, 6)] == [0, 2, 2, 0]


def test_no_padding_beyond_the_limit_or_with_limit_zero() -> None:
    keeper = ShapeKeeper(limit=4)
    assert [keeper.pad(t) for t in (64, 8, 57, 52, 6)] == [0, 0, 0, 0, 2]  # 52 to 57: 5
    assert [ShapeKeeper().pad(t) for t in (8, 1)] == [0, 0]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="limit"):
        ShapeKeeper(limit=-1)
    with pytest.raises(ValueError, match="window"):
        ShapeKeeper(window=0)


def test_the_limit_is_a_change_over_a_token() -> None:
    assert padding_limit(same_ms=4.0, changed_ms=7.0, token_ms=0.4, cap=32) == 7
    assert padding_limit(same_ms=4.0, changed_ms=7.0, token_ms=0.01, cap=16) == 16
    assert padding_limit(same_ms=40.0, changed_ms=42.0, token_ms=0.1, cap=32) == 0  # 5%
    assert padding_limit(same_ms=10.0, changed_ms=11.4, token_ms=0.1, cap=32) == 0  # 14%
    assert padding_limit(same_ms=4.0, changed_ms=9.0, token_ms=0.0, cap=32) == 0


class FakeStage:
    """Steps that cost ``base + per_token * tokens`` ms, ``change`` ms more when the token
    count differs from the step before, on a clock of its own."""

    def __init__(self, base: float, per_token: float, change: float) -> None:
        self.base, self.per_token, self.change = base, per_token, change
        self.now, self.last = 0.0, None

    def clock(self) -> float:
        return self.now

    def step(self, tokens: int) -> None:
        cost = self.base + self.per_token * tokens + (self.change if tokens != self.last else 0)
        self.now += cost / 1e3
        self.last = tokens


@pytest.mark.parametrize(("change", "want"), [(3.0, 10), (0.0, 0), (30.0, 16)])
def test_the_measured_limit_follows_the_stage(change, want) -> None:
    stage = FakeStage(base=2.0, per_token=0.3, change=change)
    assert measure_padding_limit(stage.step, cap=16, clock=stage.clock) == want


def test_the_small_step_may_be_two_tokens() -> None:
    """(A stage with a one-token graph times the dynamic graph's changes from 2 tokens.)"""
    stage = FakeStage(base=2.0, per_token=0.3, change=3.0)
    sizes = []
    plain_step = stage.step

    def step(tokens: int) -> None:
        sizes.append(tokens)
        plain_step(tokens)

    assert measure_padding_limit(step, cap=16, clock=stage.clock, small=2) == 10
    assert set(sizes) == {2, 8}
    for bad in (0, 8):
        with pytest.raises(ValueError, match="small step takes 1 to 7 tokens"):
            measure_padding_limit(step, cap=16, small=bad)


def test_steps_slowed_by_another_process_do_not_hide_the_change() -> None:
    """Every third step 5 ms slower (a second stage warming up on the same cores): the
    quickest steps of each kind still show the change."""
    stage = FakeStage(base=2.0, per_token=0.3, change=3.0)
    plain_step, count = stage.step, [0]

    def busy_step(tokens: int) -> None:
        count[0] += 1
        plain_step(tokens)
        if count[0] % 3 == 0:
            stage.now += 5.0 / 1e3

    assert measure_padding_limit(busy_step, cap=16, clock=stage.clock) == 10


def test_steps_over_64_tokens_are_padded_to_their_bucket() -> None:
    assert [bucket_pad(t) for t in (1, 16, 63, 64)] == [0, 0, 0, 0]
    assert [bucket_pad(t) for t in (65, 71, 72, 127, 128)] == [7, 1, 0, 1, 0]  # by 8
    assert [bucket_pad(t) for t in (129, 143, 144, 256, 257)] == [15, 1, 0, 0, 15]  # by 16
    assert bucket_pad(257, most=8) == 7  # a smaller scratch block: smaller buckets
    assert bucket_pad(70, buckets=((32, 4),)) == 2
