"""tools.decode.overhead: the figures it derives from a run."""

from __future__ import annotations


def test_host_ms_per_token_is_decode_time_minus_stage_time() -> None:
    from tools.decode.overhead import host_ms_per_token
    from zctl.engine.stats import GenerationStats

    stats = GenerationStats(new_tokens=3, decode_ms=30.0, stage_ms=[[6.0, 7.5], [6.5, 7.0]])
    assert host_ms_per_token(stats) == 30.0 / 2 - 13.5
    assert host_ms_per_token(GenerationStats(new_tokens=1)) == 0.0
