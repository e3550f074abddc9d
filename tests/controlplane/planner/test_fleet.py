"""Fleet files: the example fleets load, and every error names the file, the PC and the field."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from controlplane.planner.fleet import FleetError, fleet_from_dict, load_fleet
from controlplane.planner.presets import PRESETS
from controlplane.planner.profile import GRAPH_VERSION
from controlplane.planner.references import ENGINE_FIXED_S, ENGINE_ROW_S
from controlplane.planner.search import PlanRequest, plan

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "fleets"
PC = {"name": "pc", "memory_gb": 16, "profile": "laptop"}


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_every_example_fleet_loads_and_plans(path: Path) -> None:
    fleet = load_fleet(path)
    shape = PRESETS["llama-3.1-8b"]
    result = plan(PlanRequest(shape, "int4", fleet.profiles(shape, "int4"), fleet.links(),
                              head=fleet.head))
    assert result.placements[0].score > 0


def test_the_four_pcs_are_unequal_and_plan_70b_well_within_two_seconds() -> None:
    started = time.monotonic()
    fleet = load_fleet(EXAMPLES / "four-pcs.toml")
    shape = PRESETS["llama-3.1-70b"]
    result = plan(PlanRequest(shape, "int4", fleet.profiles(shape, "int4"), fleet.links(),
                              head=fleet.head, streams=8))
    assert time.monotonic() - started < 2.0
    assert len({pc.speed.name for pc in fleet.pcs}) == 4
    assert len({pc.memory for pc in fleet.pcs}) == 4
    assert {pc.access.name for pc in fleet.pcs} == {"ethernet", "wifi"}
    assert result.placements[0].nodes[0] == "desktop"


def test_a_measured_link_overrides_the_access_links() -> None:
    fleet = load_fleet(EXAMPLES / "three-desktops.toml")
    links = fleet.links()
    assert links.link("a", "c").rtt_s == pytest.approx(0.4e-3)
    assert links.link("c", "a").forward_bps == pytest.approx(940e6 / 8)
    assert links.link("a", "b").rtt_s == pytest.approx(0.3e-3)
    assert fleet.pcs[2].speed.weight_bps == pytest.approx(33e9)


def test_a_pcs_own_figures_may_give_the_coordinators_step_else_the_xeon_cores() -> None:
    speed = {"weight_gbps": 10, "compute_gmacs": 10, "layer_fixed_ms": 0.1,
             "row_fixed_ms": 0.01, "call_ms": 0.2}
    fleet = fleet_from_dict({"pc": [
        {"name": "own", "memory_gb": 8, "speed": {**speed, "engine_fixed_ms": 0.5,
                                                  "engine_row_ms": 0.1}},
        {"name": "default", "memory_gb": 8, "speed": speed}]}, "fleet.toml")
    own, default = (pc.profile(PRESETS["smollm2-135m"], "int4") for pc in fleet.pcs)
    assert own.engine_s(1) == pytest.approx(0.6e-3) and own.engine_s(8) == pytest.approx(1.3e-3)
    assert default.engine_s(1) == pytest.approx(ENGINE_FIXED_S + ENGINE_ROW_S)
    with pytest.raises(FleetError, match="engine_row_ms must be >= 0"):
        fleet_from_dict({"pc": [{"name": "pc", "memory_gb": 8, "speed": {
            **speed, "engine_row_ms": -1}}]}, "fleet.toml")


@pytest.mark.parametrize("raw, message", [
    ({}, r"no \[\[pc\]\] entries"),
    ({"pc": [{"memory_gb": 8, "profile": "laptop"}]}, "pc #1: name is missing"),
    ({"pc": [{**PC, "memory_gb": "16"}]}, "pc 'pc': memory_gb must be a number"),
    ({"pc": [{**PC, "memory_gb": 0}]}, "pc 'pc': memory_gb must be positive"),
    ({"pc": [{"name": "pc", "profile": "laptop"}]}, "pc 'pc': memory_gb is missing"),
    ({"pc": [{**PC, "free_gb": 20}]}, "pc 'pc': free_gb .20. is more than memory_gb"),
    ({"pc": [{"name": "pc", "memory_gb": 8}]}, "pc 'pc': no profile: give profile = one of"),
    ({"pc": [{**PC, "profile": "cray"}]}, "pc 'pc': profile 'cray' is not a reference"),
    ({"pc": [{**PC, "speed": {"weight_gbps": 1}}]}, "pc 'pc': give profile or a .speed. table"),
    ({"pc": [{"name": "pc", "memory_gb": 8, "speed": {"weight_gbps": 10}}]},
     "pc 'pc': speed: compute_gmacs is missing"),
    ({"pc": [{"name": "pc", "memory_gb": 8, "speed": {
        "weight_gbps": 10, "compute_gmacs": 10, "layer_fixed_ms": -1, "row_fixed_ms": 0,
        "call_ms": 0}}]}, "pc 'pc': speed: layer_fixed_ms must be >= 0"),
    ({"pc": [{**PC, "link": "tin-can"}]}, "pc 'pc': link 'tin-can' is not a reference link"),
    ({"pc": [{**PC, "link": {"rtt_ms": 1, "up_mbit_s": 10}}]},
     "pc 'pc': link: down_mbit_s is missing"),
    ({"pc": [{**PC, "colour": "red"}]}, "pc 'pc': unknown field.s. colour"),
    ({"pc": [{**PC, "cpu_share": 0}]}, "pc 'pc': cpu_share must be positive"),
    ({"pc": [{**PC, "cpu_share": "half"}]}, "pc 'pc': cpu_share must be a number"),
    ({"pc": [{**PC, "cpu_share": 0.5, "quota_period_ms": -1}]},
     "pc 'pc': quota_period_ms must be positive"),
    ({"pc": [{**PC, "quota_period_ms": 20}]}, "pc 'pc': quota_period_ms is given without cpu_share"),
    ({"pc": [PC, PC]}, "pc 'pc' is listed more than once"),
    ({"pc": [PC], "head": "other"}, "head 'other' is not a pc of the fleet"),
    ({"pc": [PC, {**PC, "name": "b"}], "link": [{"between": ["pc", "z"], "rtt_ms": 1,
                                                 "mbit_s": 10}]},
     "link #1: between names 'z', which is not a pc"),
    ({"pc": [PC, {**PC, "name": "b"}], "link": [{"between": ["pc", "b"], "rtt_ms": 1}]},
     "link #1: mbit_s must be a number"),
    ({"pc": [PC, {**PC, "name": "b"}], "link": [
        {"between": ["pc", "b"], "rtt_ms": 1, "mbit_s": 10},
        {"between": ["b", "pc"], "rtt_ms": 1, "mbit_s": 10}]}, "link #2: .* given twice"),
])
def test_a_bad_fleet_names_the_file_pc_and_field(raw: dict, message: str) -> None:
    with pytest.raises(FleetError, match=f"^fleet.toml: {message}"):
        fleet_from_dict(raw, "fleet.toml")


def test_unreadable_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(FleetError, match="cannot read it"):
        load_fleet(tmp_path / "none.toml")
    (tmp_path / "bad.toml").write_text("[[pc]\nname = ")
    with pytest.raises(FleetError, match="bad.toml: not valid TOML"):
        load_fleet(tmp_path / "bad.toml")


# -- a PC's measured profile ---------------------------------------------------------------
def _profile_file(path: Path, shape_name: str = "smollm2-135m", weights: str = "int4",
                  device: str = "CPU", exact_experts: bool = False) -> Path:
    import json

    from controlplane.planner.measured import profile_dict
    from controlplane.records import ProfileRecord

    record = ProfileRecord(PRESETS[shape_name].fingerprint(), weights, device, "2026.4.1",
                           [2e-4, 2.5e-4, 3e-4, 4e-4], [1e-3, 1.1e-3, 1.2e-3, 1.4e-3], 2e4,
                           1e-4, 2 << 20, 6 << 30, graph=GRAPH_VERSION,
                           engine_decode_s=[1e-4, 1.2e-4, 1.5e-4, 2e-4],
                           exact_experts=exact_experts)
    path.write_text(json.dumps(profile_dict(record)))
    return path


def test_a_pc_may_name_a_measured_profile_file_relative_to_the_fleet_file(tmp_path: Path) -> None:
    _profile_file(tmp_path / "desk.json")
    raw = {"pc": [{"name": "desk", "profile": "desk.json"},
                  {"name": "lap", "memory_gb": 16, "profile": "laptop", "free_gb": 10}]}
    fleet = fleet_from_dict(raw, str(tmp_path / "fleet.toml"))
    shape = PRESETS["smollm2-135m"]
    profiles = fleet.profiles(shape, "int4")
    assert profiles["desk"].decode_s[0] == 2e-4 and profiles["desk"].free_memory == 6 << 30
    assert profiles["lap"].key.openvino == "reference" and fleet.profiled
    result = plan(PlanRequest(shape, "int4", profiles, fleet.links(), head="desk"))
    assert result.placements[0].score > 0
    raw["pc"][0]["free_gb"] = 2
    assert fleet_from_dict(raw, str(tmp_path / "f.toml")).profiles(shape, "int4")[
        "desk"].free_memory == 2 << 30


def test_a_measured_profile_plans_only_what_it_was_measured_for(tmp_path: Path) -> None:
    from controlplane.planner.profile import ProfileError

    _profile_file(tmp_path / "desk.json")
    fleet = fleet_from_dict({"pc": [{"name": "desk", "profile": "desk.json"}]},
                            str(tmp_path / "fleet.toml"))
    with pytest.raises(ProfileError, match="desk.json was measured for weights 'int4', not "
                                           "'int8'"):
        fleet.profiles(PRESETS["smollm2-135m"], "int8")
    with pytest.raises(ProfileError, match="shape"):
        fleet.profiles(PRESETS["llama-3.1-8b"], "int4")
    with pytest.raises(ProfileError, match="desk.json was measured for experts in the weight "
                                           "format, not exact experts: .*--exact-experts"):
        fleet.profiles(PRESETS["smollm2-135m"], "int4", exact_experts=True)
    _profile_file(tmp_path / "exact.json", "gpt-oss-20b", exact_experts=True)
    exact = fleet_from_dict({"pc": [{"name": "desk", "profile": "exact.json"}]},
                            str(tmp_path / "fleet.toml"))
    assert exact.profiles(PRESETS["gpt-oss-20b"], "int4", exact_experts=True)[
        "desk"].key.exact_experts
    with pytest.raises(ProfileError, match="exact experts, not experts in the weight format"):
        exact.profiles(PRESETS["gpt-oss-20b"], "int4")
    gpu = fleet_from_dict({"pc": [{"name": "desk", "profile": "desk.json", "device": "GPU"}]},
                          str(tmp_path / "fleet.toml"))
    with pytest.raises(ProfileError, match="profiles CPU, not its device GPU"):
        gpu.profiles(PRESETS["smollm2-135m"], "int4")


@pytest.mark.parametrize(("content", "message"), [
    (None, "pc 'desk': profile: .*missing.json: cannot read it"),
    ("{oops", "pc 'desk': profile: .*not JSON"),
    ('{"format": "zctl-node-profile/2", "shape": 3}', "pc 'desk': profile: .*shape must be"),
    ('{"format": "zctl-node-profile/1", "shape": "x"}',
     "pc 'desk': profile: .*bad.json: its profile is stale .*older zctl.*profile it again"),
])
def test_a_fleet_naming_a_missing_or_corrupt_profile_says_which(tmp_path: Path,
                                                                content: str | None,
                                                                message: str) -> None:
    name = "missing.json" if content is None else "bad.json"
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(FleetError, match=message):
        fleet_from_dict({"pc": [{"name": "desk", "profile": name}]}, str(tmp_path / "f.toml"))


def test_a_pc_may_state_the_cpu_quota_it_is_held_to(tmp_path: Path) -> None:
    _profile_file(tmp_path / "old.json")
    shape = PRESETS["smollm2-135m"]
    raw = {"pc": [{**PC, "cpu_share": 0.5},
                  {"name": "old", "profile": "old.json", "cpu_share": 0.25,
                   "quota_period_ms": 20},
                  {**PC, "name": "free"}]}
    profiles = fleet_from_dict(raw, str(tmp_path / "fleet.toml")).profiles(shape, "int4")
    assert (profiles["pc"].cpu_share, profiles["pc"].quota_period_s) == (0.5, 0.1)  # 100 ms
    assert (profiles["old"].cpu_share, profiles["old"].quota_period_s) == (0.25, 0.02)
    assert profiles["free"].cpu_share == 0.0
    step = profiles["pc"].layer_s(1) * 10
    assert profiles["pc"].busy_s(step) == pytest.approx(2 * profiles["free"].busy_s(step))
