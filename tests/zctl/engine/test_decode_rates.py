"""DecodeRateMeter: decode tokens and time counted for the number of streams decoding when
each interval began; idle time not counted; a reset starts again."""

from __future__ import annotations

import pytest

from zctl.engine.decode_rates import DecodeRate, DecodeRateMeter


def test_each_interval_counts_for_the_streams_decoding_when_it_began() -> None:
    meter = DecodeRateMeter()
    meter.observe(10.0, 0, 1)          # one stream decodes from 10 s
    meter.observe(11.0, 50, 2)         # 50 tokens in that second; a second stream joins
    meter.observe(12.5, 120, 2)        # 1.5 s at two streams: 120 tokens
    meter.observe(13.0, 40, 0)         # 0.5 s more at two, then none decode
    meter.observe(20.0, 0, 1)          # idle time: not counted
    assert meter.rates() == [DecodeRate(1, 50, 1.0), DecodeRate(2, 160, 2.0)]
    assert [r.tok_s for r in meter.rates()] == [50.0, 80.0]


def test_a_stream_count_is_reported_once_a_second_was_spent_at_it() -> None:
    meter = DecodeRateMeter()
    meter.observe(0.0, 0, 3)
    meter.observe(0.4, 10, 3)
    assert meter.rates() == [] and meter.rates(min_seconds=0.0) == [DecodeRate(3, 10, 0.4)]
    meter.observe(1.0, 15, 3)
    assert meter.rates() == [DecodeRate(3, 25, 1.0)]


def test_reset_starts_again_and_drops_the_interval_running() -> None:
    meter = DecodeRateMeter()
    meter.observe(0.0, 0, 1)
    meter.observe(2.0, 100, 1)
    meter.reset()
    meter.observe(3.0, 30, 1)  # the tokens since the last observation: before the reset
    assert meter.rates(0.0) == []
    meter.observe(5.0, 40, 1)
    assert meter.rates() == [DecodeRate(1, 40, 2.0)]


def test_time_that_does_not_advance_counts_nothing() -> None:
    meter = DecodeRateMeter()
    meter.observe(5.0, 0, 2)
    meter.observe(5.0, 7, 2)
    assert meter.rates(0.0) == []
    assert DecodeRate(2, 0, 0.0).tok_s == 0.0


def test_negative_figures_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        DecodeRateMeter().observe(0.0, -1, 1)
    with pytest.raises(ValueError, match=">= 0"):
        DecodeRateMeter().observe(0.0, 1, -1)
