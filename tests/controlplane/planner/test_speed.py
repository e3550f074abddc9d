"""A profile taken at another host speed: the bounded factor, the profile scaled by it,
and a running cluster's fleet planned at each node's speed now."""

from __future__ import annotations

from dataclasses import replace

import pytest

from controlplane.planner.cluster_fleet import cluster_fleet, usable_profile
from controlplane.planner.presets import PRESETS
from controlplane.planner.profile import GRAPH_VERSION, NodeProfile, ProfileKey
from controlplane.planner.speed import MAX_FACTOR, at_speed, speed_factor
from controlplane.planner.timing import Pipeline, Stage, stream_tok_s
from controlplane.records import (
    ClusterStatus,
    DeviceInfo,
    LinkStatus,
    NodeStatus,
    ProfileRecord,
    StageStatus,
)

SMOL = PRESETS["smollm2-135m"]


def _profile() -> NodeProfile:
    return NodeProfile(ProfileKey("s", "int4", "CPU", "ov", GRAPH_VERSION),
                       (2e-4, 2.5e-4, 3e-4, 4e-4), (1e-3, 1.1e-3, 1.2e-3, 1.5e-3), 2e4, 1e-4,
                       (3e-4, 4e-4, 5e-4, 6e-4), 2 << 20, 9 << 30,
                       frame_decode_s=(5e-5, 6e-5, 7e-5, 8e-5), cpu_share=0.5,
                       quota_period_s=0.1, cpu_per_wall=1.1)


def test_the_factor_is_the_reference_now_over_then_within_its_bound() -> None:
    assert speed_factor(0.004, 0.005) == pytest.approx(1.25)
    assert speed_factor(0.005, 0.004) == pytest.approx(1 / 1.25)
    assert speed_factor(0.001, 0.050) == MAX_FACTOR  # a reference held up by something else
    assert speed_factor(0.050, 0.001) == 1 / MAX_FACTOR
    assert speed_factor(0.0, 0.004) == speed_factor(0.004, 0.0) == 1.0  # one not timed


@pytest.mark.parametrize("profiled, now, bound", [(-1e-3, 1e-3, 2.0), (1e-3, float("nan"), 2.0),
                                                  (1e-3, 1e-3, 0.5)])
def test_impossible_times_or_bounds_are_refused(profiled: float, now: float,
                                                bound: float) -> None:
    with pytest.raises(ValueError, match="time|bound"):
        speed_factor(profiled, now, bound)


def test_a_slower_host_scales_every_step_time_and_the_prompt_rate() -> None:
    profile = _profile()
    slow = at_speed(profile, 1.5)
    for name in ("decode_s", "head_decode_s", "engine_decode_s", "frame_decode_s"):
        assert getattr(slow, name) == pytest.approx([v * 1.5 for v in getattr(profile, name)])
    assert slow.call_s == pytest.approx(1.5e-4)
    assert slow.prefill_tokens_per_s == pytest.approx(2e4 / 1.5)
    # what is not a time of the host's CPU stays: memory, the quota, the key
    assert (slow.layer_bytes, slow.free_memory, slow.cpu_share, slow.quota_period_s,
            slow.cpu_per_wall, slow.key) == (profile.layer_bytes, profile.free_memory, 0.5,
                                             0.1, 1.1, profile.key)
    assert at_speed(profile, 1.0) is profile
    with pytest.raises(ValueError, match="positive"):
        at_speed(profile, 0.0)


def test_a_pipeline_on_a_host_twice_as_fast_predicts_its_stages_twice_as_fast() -> None:
    profile = replace(_profile(), cpu_share=0.0, quota_period_s=0.0)

    def tok_s(factor: float) -> float:
        node = at_speed(profile, factor)
        return stream_tok_s(Pipeline(SMOL, (Stage("a", node, 0, 30),), (), None))

    assert tok_s(0.5) == pytest.approx(2 * tok_s(1.0))


def _node(node_id: str, factor: float, **kw: object) -> NodeStatus:
    record = ProfileRecord(SMOL.fingerprint(), "int4", "CPU", "ov", [2e-4, 2.5e-4, 3e-4, 4e-4],
                           [1e-3] * 4, 2e4, 1e-4, 2 << 20, 9 << 30, graph=GRAPH_VERSION,
                           engine_decode_s=[1e-4] * 4, reference_s=0.004)
    return NodeStatus(node_id, "h", "serving", None, "tcp://h:1", 0.1, [DeviceInfo("CPU")],
                      4 << 30, 8 << 30, "ov", "z", 1, profile=record, profile_state="kept",
                      speed_factor=factor, **kw)


def test_a_running_cluster_is_planned_at_each_node_s_speed_now_and_says_so() -> None:
    status = ClusterStatus("c", "s", "tcp://c:5550", 7, "ov", "z", "/x", "smollm2-135m",
                           "serving", 1, 1.0, "", [_node("c", 1.0, local=True), _node("a", 1.5)],
                           [StageStatus(0, 0, 30, "h", 1 << 30, "c", "serving")], [], {},
                           shape=SMOL, links=[LinkStatus("c", "a", 1e-3, 1e8, 1e8, [2316], 1.0)])
    fleet = cluster_fleet(status, SMOL, "int4")
    assert fleet.profiles["a"].decode_s == pytest.approx(
        [1.5 * v for v in fleet.profiles["c"].decode_s])
    assert [n for n in fleet.notes if "speed factor" in n] == [
        "node a runs at speed factor 1.50 (its reference workload's time now over when it was "
        "profiled): its profile's times are scaled by it"]
    profile, why = usable_profile(_node("b", 0.8), SMOL, "int4")
    assert profile is not None and not why and profile.call_s == pytest.approx(0.8e-4)
