"""A measured profile's arithmetic (per layer by difference), its file, a link's figures."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from controlplane.planner.measured import (
    FLOOR_S,
    MAX_BPS,
    PROFILE_FORMAT,
    LinkSample,
    Measurement,
    hop_round_trip,
    link_from_samples,
    prefill_rate,
    profile_dict,
    profile_from,
    profile_of,
    profile_record,
    read_profile,
    rising,
)
from controlplane.planner.memory import layer_weight_bytes
from controlplane.planner.presets import PRESETS
from controlplane.planner.profile import GRAPH_VERSION, ProfileError, ProfileKey
from controlplane.planner.timing import Pipeline, Stage, chunk_s

SMOL = PRESETS["smollm2-135m"]
KEY = ProfileKey(SMOL.fingerprint(), "int4", "CPU", "2026.4.1", GRAPH_VERSION)
MS = 1e-3


def _measurement(**changes: object) -> Measurement:
    """Stages that are exactly a call of 0.1 ms, layers of 0.2 + 0.05 x rows ms and a head
    of 1 + 0.1 x rows ms; a 4-layer second stage (k = 3)."""
    rows = (1, 2, 4, 8)
    layer = [0.2 * MS + 0.05 * MS * r for r in rows]
    base = tuple(0.1 * MS + v for v in layer)
    values = dict(
        key=KEY, extra_layers=3, base_s=base,
        more_s=tuple(0.1 * MS + 4 * v for v in layer),
        head_s=tuple(b + 1 * MS + 0.1 * MS * r for b, r in zip(base, rows, strict=True)),
        prompt_tokens=128, base_prompt_s=2 * MS, more_prompt_s=2 * MS + 3 * 8 * MS,
        base_bytes=10_000_000, more_bytes=10_000_000 + 3 * 5_000_000, free_memory=8 << 30,
        engine_s=(0.1 * MS, 0.12 * MS, 0.15 * MS, 0.2 * MS),
        frame_s=(0.05 * MS, 0.06 * MS, 0.07 * MS, 0.09 * MS))
    values.update(changes)
    return Measurement(**values)


def test_per_layer_figures_come_by_difference_so_the_call_separates_out() -> None:
    profile = profile_from(_measurement(), SMOL, "test")
    assert profile.decode_s == pytest.approx([0.25 * MS, 0.3 * MS, 0.4 * MS, 0.6 * MS])
    assert profile.call_s == pytest.approx(0.1 * MS)
    assert profile.head_decode_s == pytest.approx([1.1 * MS, 1.2 * MS, 1.4 * MS, 1.8 * MS])
    assert profile.layer_bytes == 5_000_000
    assert profile.key == KEY and profile.free_memory == 8 << 30


def test_the_frames_work_is_taken_as_timed_and_never_falls_as_rows_grow() -> None:
    profile = profile_from(_measurement(), SMOL, "test")
    assert profile.frame_decode_s == pytest.approx([0.05 * MS, 0.06 * MS, 0.07 * MS, 0.09 * MS])
    noisy = profile_from(_measurement(frame_s=(0.05 * MS, 0.04 * MS, 0.07 * MS, 0.06 * MS)),
                         SMOL, "test")
    assert noisy.frame_decode_s == pytest.approx([0.05 * MS, 0.05 * MS, 0.07 * MS, 0.07 * MS])
    assert profile_of(profile_record(profile)) == profile
    with pytest.raises(ProfileError, match="frame_s"):
        _measurement(frame_s=(0.05 * MS, 0.0, 0.07 * MS, 0.09 * MS))


def test_the_prefill_rate_is_what_the_planner_predicts_the_prompt_back_with() -> None:
    profile = profile_from(_measurement(), SMOL, "test")
    stage = Stage("a", profile, 0, 1)
    pipe = Pipeline(SMOL, (stage,), (), None)
    # one layer's prefill of the 128-token prompt, as the planner predicts it, is the
    # measured one: 8 ms a layer (24 ms over the 3 extra layers)
    predicted = chunk_s(pipe, 0, 128, 0, final=False) - profile.call_s - profile.engine_s(1)
    assert predicted == pytest.approx(8 * MS, rel=1e-9)
    assert prefill_rate(8 * MS, profile.decode_s[0], 128, SMOL) == profile.prefill_tokens_per_s


def test_noise_never_makes_a_figure_fall_as_rows_grow_nor_go_below_a_microsecond() -> None:
    assert rising([3.0, 2.0, 4.0, -1.0]) == (3.0, 3.0, 4.0, 4.0)
    assert rising([-5.0, 0.0]) == (FLOOR_S, FLOOR_S)
    noisy = _measurement(more_s=(0.0011, 0.0010, 0.0020, 0.0030), head_s=(0.0001,) * 4)
    profile = profile_from(noisy, SMOL, "test")
    assert list(profile.decode_s) == sorted(profile.decode_s)
    assert min(profile.head_decode_s) >= FLOOR_S


def test_a_layer_never_takes_less_memory_than_its_weights() -> None:
    profile = profile_from(_measurement(more_bytes=10_000_000), SMOL, "test")
    assert profile.layer_bytes == pytest.approx(layer_weight_bytes(SMOL, "int4"), abs=1)


def test_a_measurement_of_another_shape_or_with_impossible_figures_is_refused() -> None:
    with pytest.raises(ProfileError, match="cannot profile"):
        profile_from(_measurement(), PRESETS["llama-3.1-8b"], "test")
    with pytest.raises(ProfileError, match="base_s"):
        _measurement(base_s=(1.0, float("nan"), 1.0, 1.0))
    with pytest.raises(ProfileError, match="extra_layers"):
        _measurement(extra_layers=0)


def test_a_profile_file_round_trips_and_names_its_key(tmp_path: Path) -> None:
    record = profile_record(profile_from(_measurement(), SMOL, "test"), 1.0, 2.0)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_dict(record, _measurement())))
    assert read_profile(path) == record
    assert profile_of(record).key == KEY


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "not JSON"),
    ("[1, 2]", "not a profile"),
    (json.dumps({"format": "other"}), "not a profile zctl node profile wrote"),
    (json.dumps({"format": PROFILE_FORMAT, "shape": "x"}), "missing required field"),
])
def test_a_corrupt_profile_file_gets_a_clear_error_naming_it(tmp_path: Path, text: str,
                                                            message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match=message) as caught:
        read_profile(path)
    assert str(path) in str(caught.value)


def test_a_profile_file_with_impossible_figures_is_refused(tmp_path: Path) -> None:
    record = profile_record(profile_from(_measurement(), SMOL, "test"))
    raw = profile_dict(replace(record, decode_s=[0.003, 0.002, 0.001, 0.0005]))
    path = tmp_path / "falling.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ProfileError, match="must not fall"):
        read_profile(path)
    with pytest.raises(ProfileError, match="cannot read"):
        read_profile(tmp_path / "missing.json")


def _samples(rtt: float, forward_bps: float, backward_bps: float) -> list[LinkSample]:
    small = 8
    out = [LinkSample(small, small, rtt) for _ in range(5)]
    for size in (10_000, 100_000, 1_000_000):
        out += [LinkSample(size, small, rtt + size / forward_bps)] * 3
        out += [LinkSample(small, size, rtt + size / backward_bps)] * 3
    return out


def test_a_link_s_round_trip_and_each_way_s_bandwidth_come_from_its_samples() -> None:
    link = link_from_samples(_samples(0.002, 50e6, 100e6))
    assert link.rtt_s == pytest.approx(0.002)
    assert link.forward_bps == pytest.approx(50e6, rel=1e-4)
    assert link.backward_bps == pytest.approx(100e6, rel=1e-4)


def test_a_link_s_round_trip_is_the_median_of_its_pings() -> None:
    # each ping after an idle gap: the receiver's wake-up is in most, and a pipeline's hops
    # take their median, not their best moments
    pings = [LinkSample(8, 8, s) for s in (1e-4, 3e-4, 4e-4, 5e-4, 9e-4)]
    sized = [LinkSample(80_000, 8, 1e-3 + 80_000 / 1e9)] * 3
    assert link_from_samples(pings + sized).rtt_s == pytest.approx(4e-4)


def test_a_hop_is_the_idle_round_trip_less_half_an_awake_one() -> None:
    # of an idle round trip only the way out wakes an idle receiver; a pipeline's hop is
    # such a way, so twice it is what the link's round trip stands for
    idle = [LinkSample(8, 8, s) for s in (5e-4, 6e-4, 7e-4)]
    awake = [LinkSample(8, 8, s, idle=False) for s in (1e-4, 2e-4, 3e-4)]
    sized = [LinkSample(80_000, 8, 2e-4 + 80_000 / 1e9, idle=False)] * 3
    link = link_from_samples(idle + awake + sized)
    assert link.rtt_s == pytest.approx(2 * 6e-4 - 2e-4)
    assert link.latency_s(0) == pytest.approx(6e-4 - 2e-4 / 2)
    # the bandwidth's slope is over the awake round trip, as the sized ones follow it
    assert link.forward_bps == pytest.approx(1e9, rel=1e-3)


def test_a_hop_s_round_trip_is_never_under_an_awake_one() -> None:
    assert hop_round_trip(1e-4, 3e-4) == pytest.approx(3e-4)
    assert hop_round_trip(4e-4, 2e-4) == pytest.approx(6e-4)
    assert hop_round_trip(4e-4, None) == pytest.approx(4e-4)  # no awake one timed


def test_a_busy_moment_does_not_move_a_link_s_figures() -> None:
    samples = _samples(0.001, 20e6, 20e6) + [LinkSample(8, 8, 0.5)]
    assert link_from_samples(samples).rtt_s == pytest.approx(0.001)


def test_a_link_faster_than_the_probe_can_tell_is_capped_not_infinite() -> None:
    flat = [LinkSample(8, 8, 1e-4)] * 3 + [LinkSample(1_000_000, 8, 1e-4)] * 3 + [
        LinkSample(8, 1_000_000, 1e-4)] * 3
    link = link_from_samples(flat)
    assert link.forward_bps == MAX_BPS and link.backward_bps == MAX_BPS


def test_no_samples_make_no_link() -> None:
    with pytest.raises(ProfileError, match="no probe"):
        link_from_samples([])


def test_a_profile_keeps_the_cpu_quota_it_ran_under_and_its_steps_cpu_use(tmp_path: Path) -> None:
    measured = _measurement(cpu_share=0.5, quota_period_s=0.02, cpu_per_wall=1.25)
    profile = profile_from(measured, SMOL, "test")
    assert (profile.cpu_share, profile.quota_period_s, profile.cpu_per_wall) == (0.5, 0.02, 1.25)
    record = profile_record(profile)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_dict(record, measured)))
    assert read_profile(path) == record and profile_of(record) == profile
    with pytest.raises(ProfileError, match="share must be a number >= 0"):
        _measurement(cpu_share=-1.0, quota_period_s=0.02)
    with pytest.raises(ProfileError, match="needs a positive period"):
        profile_of(replace(record, quota_period_s=0.0))


def test_a_profile_keeps_its_reference_workload_s_time(tmp_path: Path) -> None:
    measured = _measurement()
    record = replace(profile_record(profile_from(measured, SMOL, "test")), reference_s=0.004)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_dict(record, measured)))
    assert read_profile(path).reference_s == 0.004
    with pytest.raises(ProfileError, match="reference_s must be >= 0"):
        profile_of(replace(record, reference_s=-1.0))


def test_a_profile_cached_before_quotas_were_read_loads_as_under_none(tmp_path: Path) -> None:
    raw = profile_dict(profile_record(profile_from(_measurement(), SMOL, "test")))
    for name in ("cpu_share", "quota_period_s", "cpu_per_wall"):
        del raw[name]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(raw))
    profile = profile_of(read_profile(path))
    assert (profile.cpu_share, profile.cpu_per_wall) == (0.0, 0.0)
    assert profile.busy_s(5 * MS) == profile.alone_s(5 * MS) == 5 * MS
