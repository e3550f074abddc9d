"""A step on a node held to a CPU quota, alone and back to back, and what it does to a
pipeline's predicted tok/s at 1 and N streams."""

from __future__ import annotations

import dataclasses

import pytest

from controlplane.planner.presets import PRESETS
from controlplane.planner.profile import ProfileError
from controlplane.planner.quota import alone_step_s, busy_scale, busy_step_s, check_quota
from controlplane.planner.references import REFERENCE_LINKS, XEON_CORE, derive_profile
from controlplane.planner.timing import (
    Pipeline,
    Stage,
    grouped,
    step_times,
    stream_s,
    stream_tok_s,
    throughput,
    ttft,
)

MS = 1e-3
SMOL = PRESETS["smollm2-135m"]
LOOP = REFERENCE_LINKS["loopback"].to(REFERENCE_LINKS["loopback"])


def test_a_step_within_one_period_s_quota_runs_at_its_own_speed() -> None:
    # half a core per 20 ms: 10 ms of CPU a period; a 7.6 ms one-core step fits
    assert alone_step_s(7.6 * MS, 1.0, 0.5, 20 * MS) == pytest.approx(7.6 * MS)
    assert alone_step_s(10 * MS, 1.0, 0.5, 20 * MS) == pytest.approx(10 * MS)  # exactly
    assert alone_step_s(7.6 * MS, 1.0, 0.0, 0.0) == 7.6 * MS  # no quota


def test_a_step_beyond_a_period_s_quota_waits_out_each_period_it_exhausts() -> None:
    # 25 ms of one core's CPU at 10 ms a period: runs 10, waits 10, runs 10, waits 10, runs 5
    assert alone_step_s(25 * MS, 1.0, 0.5, 20 * MS) == pytest.approx(45 * MS)
    # two cores busy: 10 ms of CPU take 5 ms; 25 ms of CPU (12.5 wall) wait 15 ms twice
    assert alone_step_s(12.5 * MS, 2.0, 0.5, 20 * MS) == pytest.approx(42.5 * MS)
    # a thread that keeps a core a quarter busy never uses a period's quota in the period
    assert alone_step_s(60 * MS, 0.25, 0.5, 20 * MS) == pytest.approx(60 * MS)


def test_a_step_many_periods_long_takes_its_cpu_time_over_the_share() -> None:
    wall = 2.0
    for share in (0.25, 0.5, 0.8):
        assert alone_step_s(wall, 1.0, share, 20 * MS) == pytest.approx(wall / share, rel=0.02)


def test_back_to_back_a_node_steps_no_faster_than_its_cpu_time_over_the_share() -> None:
    # 7.6 ms steps fit a period alone, but one after another half a core gives one each 15.2
    assert busy_step_s(7.6 * MS, 1.0, 0.5, 20 * MS) == pytest.approx(15.2 * MS)
    assert busy_step_s(7.6 * MS, 1.6, 0.5, 20 * MS) == pytest.approx(7.6 * 1.6 / 0.5 * MS)
    assert busy_step_s(7.6 * MS, 0.0, 0.5, 20 * MS) == pytest.approx(15.2 * MS)  # one core
    assert busy_step_s(7.6 * MS, 1.0, 2.0, 20 * MS) == pytest.approx(7.6 * MS)  # 2 cores
    assert busy_step_s(7.6 * MS, 1.0, 0.0, 0.0) == 7.6 * MS
    assert (busy_scale(1.0, 0.5), busy_scale(1.6, 0.5), busy_scale(1.0, 2.0),
            busy_scale(1.0, 0.0)) == (2.0, pytest.approx(3.2), 1.0, 1.0)


@pytest.mark.parametrize(("share", "period", "rho", "message"), [
    (-0.5, 0.1, 1.0, "share must be a number >= 0"),
    (float("nan"), 0.1, 1.0, "share must be a number >= 0"),
    (0.5, 0.0, 1.0, "needs a positive period"),
    (0.5, 0.1, -1.0, "CPU per wall second must be a number >= 0"),
])
def test_an_impossible_quota_is_refused(share: float, period: float, rho: float,
                                        message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_quota(share, period, rho)
    profile = derive_profile(XEON_CORE, SMOL, "int4", 8 << 30)
    with pytest.raises(ProfileError, match=message):
        dataclasses.replace(profile, cpu_share=share, quota_period_s=period, cpu_per_wall=rho)


def _pipe(share: float, rho: float = 1.0, period: float = 20 * MS) -> Pipeline:
    """SmolLM2 on two Xeon-core nodes, the second held to ``share`` cores."""
    fast = derive_profile(XEON_CORE, SMOL, "int4", 8 << 30)
    slow = dataclasses.replace(fast, cpu_share=share, quota_period_s=period, cpu_per_wall=rho)
    return Pipeline(SMOL, (Stage("a", fast, 0, 15), Stage("b", slow, 15, 30)), (LOOP,), LOOP)


def test_one_stream_pays_the_quota_only_when_its_cycle_is_shorter_than_the_share_allows() -> None:
    free = step_times(_pipe(0.0), 1)
    b = free.stage_s[1]
    # a quota the cycle's idle time covers: no change
    roomy = _pipe(b / free.cycle_s * 1.05)
    assert stream_tok_s(roomy) == pytest.approx(1 / free.cycle_s)
    # half a core: the slowed node's steps come each cycle, which is shorter than 2 x b
    assert free.cycle_s < 2 * b
    held = step_times(_pipe(0.5), 1)
    assert held.stage_s == free.stage_s  # each step alone still fits a period's quota
    assert held.busy_s[1] == pytest.approx(2 * b)
    assert stream_s(held) == pytest.approx(2 * b)
    assert stream_tok_s(_pipe(0.5)) == pytest.approx(1 / (2 * b))
    assert grouped(_pipe(0.5), 1, 1).tok_s == pytest.approx(1 / (2 * b))


def test_n_streams_are_bounded_by_the_slowed_node_s_cpu_time_over_its_share() -> None:
    for streams in (2, 8):
        free, held = throughput(_pipe(0.0), streams), throughput(_pipe(0.5), streams)
        times = step_times(_pipe(0.5), held.rows)
        wall = step_times(_pipe(0.0), held.rows).stage_s[1]
        assert times.busy_s[1] == pytest.approx(2 * wall)  # (at 8 rows, over a period alone)
        assert held.tok_s == pytest.approx(
            streams / max(times.cycle_s, held.groups * 2 * wall))
        assert held.tok_s < free.tok_s
    # a node whose steps keep 1.5 cores busy uses its share three times as fast as its time
    times = step_times(_pipe(0.5, rho=1.5), 4)
    assert times.bottleneck_s == pytest.approx(3 * step_times(_pipe(0.0), 4).stage_s[1])


def test_a_prompt_s_chunks_on_a_slowed_node_take_their_cpu_time_over_its_share() -> None:
    assert ttft(_pipe(0.25)).seconds > 2 * ttft(_pipe(0.0)).seconds
