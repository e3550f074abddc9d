"""Profiling a node: its profiles kept by shape, format, device and OpenVINO version; the
synthetic stages it times, within its budget."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from controlplane.cpu_quota import CpuQuota
from controlplane.planner.measured import Measurement, read_profile
from controlplane.planner.presets import PRESETS
from controlplane.planner.profile import GRAPH_VERSION, ProfileError, ProfileKey
from controlplane.planner.shape import ModelShape
from controlplane.profile_store import NOT_PROFILED, ProfileStore, profile_name
from controlplane.profiling import (
    Deadline,
    cpu_per_wall,
    extra_layers,
    layer_shape,
    measure,
)

SMOL = PRESETS["smollm2-135m"]
TINY = ModelShape("tiny", num_layers=4, hidden=64, intermediate=128, heads=4, kv_heads=2,
                  head_dim=16, vocab=384, tied_embeddings=True)  # tools/harness/random_llama's
VERSION = "2026.4.1-test"


def _measurement(shape: ModelShape = SMOL, weights: str = "int4", device: str = "CPU",
                 openvino: str = VERSION, graph: int = GRAPH_VERSION,
                 int8_form: str | None = None, exact_experts: bool = False) -> Measurement:
    rows = (1e-4, 2e-4, 3e-4, 4e-4)
    return Measurement(ProfileKey(shape.fingerprint(), weights, device, openvino, graph,
                                  int8_form, exact_experts), 2,
                       rows, tuple(3 * r for r in rows), tuple(10 * r for r in rows), 128, 1e-3,
                       5e-3, 1 << 20, 5 << 20, 8 << 30, engine_s=tuple(r / 2 for r in rows),
                       frame_s=tuple(r / 4 for r in rows),
                       rounds=3, seconds=1.5)


def test_a_profile_is_kept_by_shape_format_and_device_and_used_again(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path, openvino=VERSION)
    assert store.load(SMOL, "int4", "CPU") == (None, NOT_PROFILED)
    record, path = store.save(SMOL, _measurement())
    assert path.parent == tmp_path / "profiles" and read_profile(path) == record
    assert store.load(SMOL, "int4", "CPU") == (record, "")
    assert store.load(SMOL, "int8", "CPU") == (None, NOT_PROFILED)
    assert store.load(PRESETS["llama-3.1-8b"], "int4", "CPU") == (None, NOT_PROFILED)
    assert json.loads(path.read_text())["measurement"]["extra_layers"] == 2
    assert len({profile_name(SMOL.fingerprint(), w, d, v) for w in ("int4", "int8")
                for d in ("CPU", "GPU.0") for v in (VERSION, "2025.1.0")}) == 8


def test_a_profile_of_one_int8_form_is_not_used_for_the_other(tmp_path: Path) -> None:
    """An int8 export in i8 groups (the default) and one in u8 per channel (older, or
    static) are profiled apart: kept in files of their own, and a file of one is stale for
    the other."""
    store = ProfileStore(tmp_path, openvino=VERSION)
    groups, groups_path = store.save(SMOL, _measurement(weights="int8", int8_form="i8-groups"))
    channels, channels_path = store.save(SMOL, _measurement(weights="int8",
                                                            int8_form="u8-channel"))
    assert groups_path != channels_path and groups.int8_form == "i8-groups"
    assert store.load(SMOL, "int8", "CPU") == (groups, "")
    assert store.load(SMOL, "int8", "CPU", int8_form="i8-groups") == (groups, "")
    assert store.load(SMOL, "int8", "CPU", int8_form="u8-channel") == (channels, "")
    os.replace(channels_path, groups_path)
    record, why = store.load(SMOL, "int8", "CPU")
    assert record is None and "INT8 form 'u8-channel', not 'i8-groups'" in why
    # a record naming no form is its format's default (int4: its head per channel)
    int4, _ = store.save(SMOL, _measurement())
    assert store.load(SMOL, "int4", "CPU", int8_form="u8-channel") == (int4, "")
    with pytest.raises(ValueError, match="unknown INT8 form 'i4-groups'"):
        store.load(SMOL, "int8", "CPU", int8_form="i4-groups")


def test_a_profile_of_exact_experts_is_not_used_for_experts_in_the_format(
        tmp_path: Path) -> None:
    """An export with exact experts (zctl export --exact-experts) is profiled apart from
    one whose experts are in the weight format: its own file, stale for the other."""
    moe = PRESETS["gpt-oss-20b"]
    store = ProfileStore(tmp_path, openvino=VERSION)
    plain, plain_path = store.save(moe, _measurement(moe))
    exact, exact_path = store.save(moe, _measurement(moe, exact_experts=True))
    assert exact.exact_experts and not plain.exact_experts
    assert "-exact-experts-" in exact_path.name and exact_path != plain_path
    assert store.load(moe, "int4", "CPU") == (plain, "")
    assert store.load(moe, "int4", "CPU", exact_experts=True) == (exact, "")
    assert exact.layer_bytes > plain.layer_bytes  # at least their weights' estimate
    os.replace(exact_path, plain_path)
    record, why = store.load(moe, "int4", "CPU")
    assert record is None and "exact experts, not experts in the weight format" in why


def test_a_profile_measured_under_another_cpu_quota_than_the_node_s_now_is_stale(
        tmp_path: Path) -> None:
    from dataclasses import replace

    store = ProfileStore(tmp_path, openvino=VERSION)
    record, _ = store.save(SMOL, replace(_measurement(), cpu_share=0.5, quota_period_s=0.02))
    assert store.load(SMOL, "int4", "CPU", 0.5) == (record, "")
    assert store.load(SMOL, "int4", "CPU", None) == (record, "")  # the quota now not known
    assert store.load(SMOL, "int4", "CPU", 0.0) == (
        None, "its profile is stale (measured under a CPU quota of 0.5 cores, now under no "
              "CPU quota)")
    store.save(SMOL, _measurement())
    assert "now under a CPU quota of 2 cores" in store.load(SMOL, "int4", "CPU", 2.0)[1]


def test_a_profile_of_another_openvino_version_is_stale_and_kept_for_that_version(
        tmp_path: Path) -> None:
    """Profiles are kept per OpenVINO version: a node upgraded measures again beside the old
    version's file, which serves again when the node goes back to that version."""
    old_store = ProfileStore(tmp_path, openvino="2025.1.0")
    old, old_path = old_store.save(SMOL, _measurement(openvino="2025.1.0"))
    store = ProfileStore(tmp_path, openvino=VERSION)
    record, why = store.load(SMOL, "int4", "CPU")
    assert record is None
    assert why == ("its profile is stale (measured with OpenVINO '2025.1.0' only, not "
                   "'2026.4.1-test')")
    new, new_path = store.save(SMOL, _measurement())
    assert new_path != old_path and old_path.is_file()
    assert store.load(SMOL, "int4", "CPU") == (new, "")
    assert old_store.load(SMOL, "int4", "CPU") == (old, "")
    assert store.load(SMOL, "int8", "CPU") == (None, NOT_PROFILED)  # other formats: none


def test_a_profile_file_that_says_another_openvino_version_than_its_name_is_stale(
        tmp_path: Path) -> None:
    old_store = ProfileStore(tmp_path, openvino="2025.1.0")
    _, old_path = old_store.save(SMOL, _measurement(openvino="2025.1.0"))
    store = ProfileStore(tmp_path, openvino=VERSION)
    os.replace(old_path, store.path(SMOL, "int4", "CPU"))
    record, why = store.load(SMOL, "int4", "CPU")
    assert record is None
    assert "stale" in why and "OpenVINO '2025.1.0', not '2026.4.1-test'" in why


def test_a_profile_file_that_says_another_shape_is_stale(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path, openvino=VERSION)
    _, path = store.save(SMOL, _measurement())
    raw = json.loads(path.read_text())
    raw["shape"] = "h1-i1-a1/1x1-v1"
    path.write_text(json.dumps(raw))
    record, why = store.load(SMOL, "int4", "CPU")
    assert record is None and "stale" in why and "shape" in why


def test_a_profile_of_another_layer_graph_is_stale(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path, openvino=VERSION)
    store.save(SMOL, _measurement(graph=GRAPH_VERSION - 1))
    record, why = store.load(SMOL, "int4", "CPU")
    assert record is None
    assert why == f"its profile is stale (it timed layer graph {GRAPH_VERSION - 1}, not {GRAPH_VERSION})"


def test_a_profile_an_older_zctl_wrote_is_stale_and_says_what_it_lacks(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path, openvino=VERSION)
    _, path = store.save(SMOL, _measurement())
    raw = json.loads(path.read_text())
    for name in ("graph", "engine_decode_s"):
        raw.pop(name)
    raw["format"] = "zctl-node-profile/1"  # what such a file says
    path.write_text(json.dumps(raw))
    record, why = store.load(SMOL, "int4", "CPU")
    assert record is None
    assert why.startswith("its profile is stale (format zctl-node-profile/1, of an older zctl, "
                          "without the coordinator's step")
    raw["format"] = "zctl-node-profile/2"  # the fields alone missing: stale all the same
    path.write_text(json.dumps(raw))
    record, why = store.load(SMOL, "int4", "CPU")
    assert record is None and why.startswith("its profile is stale (it was measured by an older")


def test_a_damaged_profile_file_is_measured_again_not_fatal(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path, openvino=VERSION)
    _, path = store.save(SMOL, _measurement())
    path.write_text("{\"format\": \"zctl-node-profile/1\", \"decode_s\": [")
    record, why = store.load(SMOL, "int4", "CPU")
    assert record is None and "damaged" in why and str(path) in why


def test_the_second_stage_holds_some_64_mb_of_extra_layers_fewer_when_memory_is_short() -> None:
    assert extra_layers(SMOL, "int4", 16 << 30) == 28
    assert extra_layers(PRESETS["llama-3.1-8b"], "int4", 16 << 30) == 1
    assert extra_layers(TINY, "fp32", 16 << 30) == 32
    with pytest.raises(ProfileError, match="needs ~.* GB"):
        extra_layers(PRESETS["llama-3.1-70b"], "int4", 2 << 30)


def test_a_slow_machine_builds_fewer_extra_layers_so_its_profile_fits_its_budget() -> None:
    """The (1 + k)-layer stage may take what the budget has left but TIMING_SHARE of it,
    each layer as long to build as the one-layer stage took: SmolLM2's 28 extra layers on a
    fast machine or at half a core, ~13 at a quarter of a core (its one-layer stage built in
    1.1 s, 27 s left), never none."""
    from controlplane.profiling import TIMING_SHARE, extra_layers_in_time

    assert TIMING_SHARE * 30.0 >= 10.0  # two rounds and the coordinator's step
    assert min(extra_layers(SMOL, "int4", 16 << 30), extra_layers_in_time(0.25, 29.0, 30.0),
               extra_layers_in_time(0.55, 28.5, 30.0)) == 28
    assert extra_layers_in_time(1.1, 27.0, 30.0) == 12
    assert extra_layers_in_time(5.0, 12.0, 30.0) == 1  # no room: one, never none
    assert extra_layers_in_time(0.0, 29.0, 30.0) > 32


def test_what_cannot_be_profiled_says_why() -> None:
    with pytest.raises(ProfileError, match="budget must be positive"):
        Deadline(0.0, time.perf_counter)
    ticks = iter([0.0, 5.0])
    deadline = Deadline(1.0, lambda: next(ticks))
    with pytest.raises(ProfileError, match="whole budget of 1 s building"):
        deadline.check("building")
    with pytest.raises(ProfileError, match="unknown INT8 form 'i4-groups'"):
        measure(TINY, "int8", "CPU", 5.0, int8_form="i4-groups")
    with pytest.raises(ProfileError, match="tiny: exact experts, but it has no mixture of "
                                           "experts"):
        measure(TINY, "int4", "CPU", 5.0, exact_experts=True)


@pytest.mark.slow
def test_the_tiny_shape_is_profiled_for_real_within_its_budget(tmp_path: Path) -> None:
    budget = 20.0
    gaps: list[float] = []

    def sleep(seconds: float) -> None:  # each decode step after an idle gap
        gaps.append(seconds)
        time.sleep(seconds)

    start = time.perf_counter()
    measurement = measure(TINY, "int4", "CPU", budget, sleep=sleep,
                          quota=CpuQuota(1.5, 0.05))
    took = time.perf_counter() - start
    # a gap before every timed decode step: 3 stages, 4 row counts, 5 steps a round (the
    # last round cut short if the budget ran out in it)
    per_round = 3 * 4 * 5
    assert (measurement.rounds - 1) * per_round < len(gaps) <= measurement.rounds * per_round
    assert all(g > 0 for g in gaps)
    assert took < budget * 1.5 and measurement.seconds <= took
    assert measurement.rounds >= 2 and measurement.key.device == "CPU"
    record, path = ProfileStore(tmp_path).save(TINY, measurement)
    assert all(v > 0 for v in record.decode_s) and record.call_s >= 0
    assert all(0 < v < 0.05 for v in record.engine_decode_s)  # the coordinator's step
    assert record.engine_decode_s == sorted(record.engine_decode_s)
    assert all(0 < v < 0.05 for v in record.frame_decode_s)  # the frames around a step
    assert record.frame_decode_s == sorted(record.frame_decode_s)
    assert record.graph == GRAPH_VERSION
    # the quota it was told it runs under; its steps kept the process's threads busy
    assert (record.cpu_share, record.quota_period_s) == (1.5, 0.05)
    assert 0.05 < record.cpu_per_wall <= len(os.sched_getaffinity(0)) * 1.1
    assert record.layer_bytes > 0 and record.prefill_tokens_per_s > 0
    # the host's reference workload is timed by the node that holds the profile
    assert read_profile(path) == record and record.reference_s == 0


@pytest.mark.slow
def test_profiling_stops_at_its_budget() -> None:
    # past the budget no step or build starts: on a clock that moves 0.5 s at every reading,
    # a 6 s budget is spent after 12 readings whatever the machine's speed, and SmolLM2's
    # stages cannot be timed in them
    readings: list[float] = []

    def clock() -> float:
        readings.append(0.5 * len(readings))
        return readings[-1]

    with pytest.raises(ProfileError, match="budget"):
        measure(SMOL, "int4", "CPU", 6.0, clock=clock, sleep=lambda _s: None)
    spent = readings.index(next(r for r in readings if r >= 6.0))
    assert len(readings) - spent <= 6, readings  # a check at each loop it leaves, no step


def test_the_steps_cpu_use_is_cpu_seconds_per_wall_second_or_none() -> None:
    assert cpu_per_wall(0.03, 0.02) == 1.5
    assert cpu_per_wall(0.0, 0.02) == 0.0  # a CPU clock that did not move: not measured
    assert cpu_per_wall(0.01, 0.0) == 0.0


def test_the_coordinators_step_runs_fewer_steps_beside_a_slower_stage() -> None:
    from controlplane.profiling import ENGINE_MIN_STEPS, ENGINE_STEPS, engine_steps

    fast, slow, slowest = engine_steps(0.001), engine_steps(0.05), engine_steps(10.0)
    assert fast == ENGINE_STEPS and slowest == ENGINE_MIN_STEPS
    assert slowest <= slow < fast


TINY_MOE = ModelShape("tiny-moe", num_layers=4, hidden=64, intermediate=128, heads=4,
                      kv_heads=2, head_dim=16, vocab=384, experts=8, active_experts=2,
                      expert_intermediate=32, architecture="qwen3_moe")


@pytest.mark.slow
def test_a_mixture_of_experts_is_profiled_with_all_its_experts_held(tmp_path: Path) -> None:
    """Its synthetic layers hold every expert (their memory is the profile's) and compute
    the routed ones; a row group of 8 reads more experts than one row. Its experts exact
    here (an export with --exact-experts): a plan must ask for them so."""
    from controlplane.planner.measured import profile_of
    from controlplane.planner.profile import Links
    from controlplane.planner.search import PlanRequest, plan

    dims = layer_shape(PRESETS["qwen3-30b-a3b"])
    assert (dims.experts, dims.active_experts, dims.expert_intermediate) == (128, 8, 768)
    measurement = measure(TINY_MOE, "int4", "CPU", 15.0, exact_experts=True)
    record, _ = ProfileStore(tmp_path).save(TINY_MOE, measurement)
    assert record.shape == TINY_MOE.fingerprint() and all(v > 0 for v in record.decode_s)
    assert record.exact_experts and record.layer_bytes > 0
    best = plan(PlanRequest(TINY_MOE, "int4", {"pc": profile_of(record)}, Links({}),
                            top=1, exact_experts=True)).placements[0]
    assert best.ranges() == [(0, 4)] and best.tok_s > 0
