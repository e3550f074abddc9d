"""The coordinator's placement by the planner (PipelinePlan with a StagePlanner), on the
tiny model's export in four one-layer stages and made-up members: who takes part and how
many stages each runs, the fallback without profiles, and re-plans (the gain threshold,
shards fetched while the pipeline serves, a re-plan that fails halfway)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from controlplane import membership as ms
from controlplane.messages import AssignStage, Enrol
from controlplane.placement import LayerCost, stage_needs
from controlplane.planner.export_shape import export_shape
from controlplane.planner.profile import GRAPH_VERSION
from controlplane.planner.search import PlanRequest, plan
from controlplane.records import LinkStatus, ProfileRecord, ReplanStatus
from controlplane.stage_planner import (
    IDLE,
    INLINE_NODES,
    SEARCHING,
    BackgroundSearch,
    PlannedStages,
    PlanUnusable,
    StagePlanner,
)
from controlplane.wiring import PipelinePlan
from dataplane.runtime.config import RuntimeSpec
from zctl.manifest import load_manifest

OV = "2025.3.0-test"
HEAD = "coord"
LAYER_BYTES = 100_000_000  # a profile's layer, large enough that memory decides the split
NOW = 1000.0
SETTLED = 2.0


@pytest.fixture(scope="module")
def export(tiny_exports) -> Path:
    return tiny_exports.get([(0, 1), (1, 2), (2, 3), (3, 4)])


def holding(layers: int) -> int:
    """Free RAM in which a node holds ``layers`` of the profile's layers, not one more."""
    return int(layers * 1.1 * LAYER_BYTES / 0.9)


class Fleet:
    """An export's PipelinePlan and the members it places on."""

    def __init__(self, export: Path, gain: float = 0.10) -> None:
        self.manifest = load_manifest(export)
        self.shape = export_shape(self.manifest, export)
        self.needs = stage_needs(self.manifest, export, LayerCost.from_export(self.manifest,
                                                                               export))
        self.planner = StagePlanner(self.manifest, self.shape, self.needs, HEAD, "CPU", OV, gain)
        self.now = 1000.0  # the wall clock the plan stamps re-plans with
        self.plan = PipelinePlan(self.manifest, self.needs, HEAD, RuntimeSpec(), expect_nodes=0,
                                 planner=self.planner, clock=lambda: self.now)
        self.members: dict[str, ms.Member] = {}

    def record(self, layer_s: float = 2e-3, **change: object) -> ProfileRecord:
        rec = ProfileRecord(self.shape.fingerprint(), self.manifest.weight_format, "CPU", OV,
                            [layer_s * (1 + 0.2 * i) for i in range(4)],
                            [layer_s * (1 + 0.2 * i) for i in range(4)], 5000.0, 3e-4,
                            LAYER_BYTES, 0, "test", measured_at=1.0, graph=GRAPH_VERSION,
                            engine_decode_s=[1e-4] * 4)
        return replace(rec, **change)  # type: ignore[arg-type]

    def add(self, node_id: str, layers: int, layer_s: float = 2e-3,
            record: ProfileRecord | None | str = "made", state: str = ms.IDLE) -> ms.Member:
        local = node_id == HEAD
        host = "10.0.0.1" if local else f"10.0.0.{len(self.members) + 2}"
        info = Enrol(node_id, host, f"tcp://{host}:6000", [], 64 << 30, holding(layers), OV,
                     "0.1.0", list(self.manifest.stage_hash(i) for i in range(4)) if local
                     else [])
        member = ms.Member(node_id, node_id.encode(), info, ms.READY if local else state, NOW,
                           local=local, shards=set(info.cached_shards))
        member.profile = self.record(layer_s) if record == "made" else record  # type: ignore[assignment]
        member.profile_state = "kept" if member.profile is not None else "not profiled yet"
        member.profile_answered = True
        self.members[node_id] = member
        return member

    def place(self) -> dict[int, str]:
        assert self.plan.try_plan(self.members, (), NOW)
        assert self.plan.plan is not None
        return dict(self.plan.plan)

    def serve(self) -> None:
        """Every planned node serves the current epoch (its shards held)."""
        assert self.plan.plan is not None
        for stage, node in self.plan.plan.items():
            member = self.members[node]
            member.shards.add(self.plan.hashes[stage])
        for member, msg in self.plan.assignments(self.members):
            member.state, member.ready_epoch = ms.SERVING, msg.epoch
        assert self.plan.state(self.members) == "serving"

    def rebalance(self) -> list[int]:
        return self.plan.rebalance(self.members, NOW, SETTLED)


def test_a_slow_node_is_left_out_with_the_planners_reason(export: Path) -> None:
    fleet = Fleet(export)
    fleet.add(HEAD, 2)
    fleet.add("fast", 2)
    fleet.add("slow", 4, layer_s=8e-3)  # 4x slower, room for the whole model
    assert fleet.place() == {0: HEAD, 1: HEAD, 2: "fast", 3: "fast"}
    assert set(fleet.plan.left_out) == {"slow"}
    assert fleet.plan.left_out["slow"]
    assert fleet.plan.placement_note.startswith("by the planner: predicted")
    assert fleet.members["slow"].stage is None  # a spare
    # placed by memory alone, the slow node would have taken a stage
    fallback = Fleet(export)
    fallback.add(HEAD, 2)
    fallback.add("fast", 2)
    fallback.add("slow", 4, layer_s=8e-3, record=None)
    assert "slow" in fallback.place().values()


def test_a_fast_node_is_given_more_stages(export: Path) -> None:
    fleet = Fleet(export)
    fleet.add(HEAD, 1, layer_s=8e-3)  # the coordinator: slow and small, it runs stage 0 only
    fleet.add("fast", 4)
    fleet.add("other", 2, layer_s=4e-3)
    assert fleet.place() == {0: HEAD, 1: "fast", 2: "fast", 3: "fast"}
    assert set(fleet.plan.left_out) == {"other"}


def test_without_every_profile_the_stages_are_placed_by_memory_and_it_says_why(
        export: Path, caplog: pytest.LogCaptureFixture) -> None:
    fleet = Fleet(export)
    fleet.add(HEAD, 4)
    fleet.add("a", 4)
    fleet.add("b", 4, record=None)
    fleet.members["b"].profile_state = "not profiled yet (zctl node join --no-profile)"
    with caplog.at_level(logging.INFO, "zctl.controlplane"):
        plan = fleet.place()
    assert sorted(set(plan.values())) == sorted([HEAD, "a", "b"])  # today's placement
    note = fleet.plan.placement_note
    assert note.startswith("by memory, not by the planner: node b has no profile")
    assert "--no-profile" in note and note in caplog.text
    assert fleet.plan.left_out == {}


def test_a_stale_profile_is_not_used_and_says_why(export: Path) -> None:
    fleet = Fleet(export)
    fleet.add(HEAD, 4)
    fleet.add("a", 4, record=fleet.record(weights="int4"))
    fleet.place()
    assert "node a's profile cannot be used" in fleet.plan.placement_note
    assert "weights 'int4'" in fleet.plan.placement_note


def test_an_explicit_placement_wins(export: Path) -> None:
    fleet = Fleet(export)
    fleet.plan = PipelinePlan(fleet.manifest, fleet.needs, HEAD, RuntimeSpec(), expect_nodes=0,
                              explicit={1: "slow"}, planner=fleet.planner)
    fleet.add(HEAD, 2)
    fleet.add("fast", 2)
    fleet.add("slow", 4, layer_s=8e-3)
    fleet.add("other", 2)  # pins place one stage per node
    assert fleet.place()[1] == "slow"
    assert fleet.plan.placement_note.startswith("explicit")


def test_the_first_placement_waits_briefly_for_the_profiles(export: Path) -> None:
    fleet = Fleet(export)
    fleet.add(HEAD, 4)
    late = fleet.add("a", 4)
    late.profile, late.profile_answered, late.enrolled_at = None, False, NOW - 1
    assert not fleet.plan.try_plan(fleet.members, (), NOW)
    late.profile, late.profile_answered = fleet.record(), True
    assert fleet.plan.try_plan(fleet.members, (), NOW)
    assert fleet.plan.placement_note.startswith("by the planner")


def test_cut_points_are_the_exports_stage_boundaries(export: Path) -> None:
    fleet = Fleet(export)
    assert fleet.planner.cuts == frozenset({1, 2, 3})
    with pytest.raises(ValueError, match="re-plan gain"):
        StagePlanner(fleet.manifest, fleet.shape, fleet.needs, HEAD, "CPU", OV, gain=-0.1)


def test_the_coordinator_searches_up_to_8_nodes_exactly(export: Path) -> None:
    from controlplane.stage_planner import COORDINATOR_EXACT_NODES

    fleet = Fleet(export)
    fleet.add(HEAD, 2)
    fleet.add("a", 2)
    req, _ = fleet.planner.request(list(fleet.members.values()), [])
    assert req.exact_nodes == COORDINATOR_EXACT_NODES == 8 and req.cuts == frozenset({1, 2, 3})


def large_fleet(export: Path) -> Fleet:
    """The coordinator and four nodes: more than are searched on the loop."""
    fleet = Fleet(export)
    fleet.add(HEAD, 1)
    for i, node in enumerate("abcd"):
        fleet.add(node, 1, layer_s=2e-3 * (1 + i / 10))
    assert len(fleet.members) > INLINE_NODES
    return fleet


def until(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.01)


def test_a_large_fleets_search_runs_off_the_loop_and_its_result_is_applied_on_it(
        export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fleet = large_fleet(export)
    members = list(fleet.members.values())
    memory = {m.node_id: fleet.plan.capacity(m).memory_bytes for m in members}
    expected = fleet.planner.place(members, (), memory)  # at once, as before
    release = threading.Event()
    placed = fleet.planner._placed

    def slow(*args: object) -> PlannedStages:
        assert release.wait(20.0)
        return placed(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(fleet.planner, "_placed", slow)
    start = time.monotonic()
    assert not fleet.plan.try_plan(fleet.members, (), NOW)  # searching: the loop goes on
    assert not fleet.plan.try_plan(fleet.members, (), NOW)
    assert time.monotonic() - start < 2.0  # generous: it waits for nothing
    assert fleet.planner.search.state == SEARCHING and fleet.plan.plan is None
    release.set()
    until(lambda: fleet.plan.try_plan(fleet.members, (), NOW))
    assert fleet.plan.plan == expected.stages and fleet.planner.search.state == IDLE
    assert fleet.plan.placement_note.startswith("by the planner")


def test_a_fleet_change_during_a_search_drops_its_stale_result(
        export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fleet = large_fleet(export)
    release = threading.Event()
    placed = fleet.planner._placed
    searched: list[frozenset[str]] = []

    def slow(req: PlanRequest, *args: object) -> PlannedStages:
        assert release.wait(20.0)
        searched.append(frozenset(req.profiles))
        return placed(req, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(fleet.planner, "_placed", slow)
    assert not fleet.plan.try_plan(fleet.members, (), NOW)
    fleet.add("e", 1, layer_s=1e-3)  # a fast node joins while the search runs
    assert not fleet.plan.try_plan(fleet.members, (), NOW)
    assert fleet.planner.search.dropped == 1
    release.set()
    until(lambda: fleet.plan.try_plan(fleet.members, (), NOW))
    assert "e" in searched[-1]  # the placement applied is the new fleet's
    assert "e" in fleet.plan.plan.values() or "e" in fleet.plan.left_out  # type: ignore[union-attr]


def test_a_background_search_gives_each_result_once_and_raises_what_it_raised() -> None:
    search: BackgroundSearch[int] = BackgroundSearch()
    assert search.take("k", lambda: 7) is None
    until(lambda: search._future is not None and search._future.done())
    assert search.take("k", lambda: 8) == 7 and search.state == IDLE

    def fails() -> int:
        raise PlanUnusable("no placement")

    assert search.take("k", fails) is None
    until(lambda: search._future is not None and search._future.done())
    with pytest.raises(PlanUnusable, match="no placement"):
        search.take("k", fails)
    search.close()


def joined_faster(export: Path, factor: float, gain: float = 0.10) -> Fleet:
    """A pipeline of the coordinator and ``a`` serving, and ``b`` joined: its layers
    ``factor`` times as fast as ``a``'s."""
    fleet = Fleet(export, gain)
    fleet.add(HEAD, 2)
    fleet.add("a", 2, layer_s=4e-3)
    assert fleet.place() == {0: HEAD, 1: HEAD, 2: "a", 3: "a"}
    fleet.serve()
    fleet.add("b", 2, layer_s=4e-3 / factor)
    return fleet


def test_a_re_plan_below_the_gain_threshold_is_logged_with_both_predictions(
        export: Path, caplog: pytest.LogCaptureFixture) -> None:
    fleet = joined_faster(export, 1.05)
    with caplog.at_level(logging.INFO, "zctl.controlplane"):
        assert fleet.rebalance() == []
    assert fleet.plan.pending is None and fleet.plan.plan == {0: HEAD, 1: HEAD, 2: "a", 3: "a"}
    note = fleet.plan.replan_note
    assert note.startswith("re-plan not applied: predicted") and "+10%" in note
    assert note in caplog.text
    assert fleet.plan.last_replan == ReplanStatus("not_applied", note, 1000.0, 1)
    assert "b" in fleet.plan.left_out
    # the same fleet is not planned again every tick
    caplog.clear()
    with caplog.at_level(logging.INFO, "zctl.controlplane"):
        fleet.rebalance()
    assert "re-plan" not in caplog.text


def planner_unusable(export: Path) -> Fleet:
    """A serving fleet joined by node b, whose profile is of another shape."""
    fleet = Fleet(export)
    fleet.add(HEAD, 2)
    fleet.add("a", 2, layer_s=4e-3)
    fleet.place()
    fleet.serve()
    fleet.add("b", 2, record=fleet.record(shape="another-shape"))
    return fleet


def test_a_planner_that_cannot_place_is_no_re_plan(export: Path) -> None:
    fleet = planner_unusable(export)
    fleet.rebalance()  # (a stage is given back by memory instead)
    unusable = fleet.plan.last_replan
    assert (unusable.kind, unusable.count) == ("unusable", 0)  # said, not counted
    assert unusable.note.startswith("no re-plan: node b's profile cannot be used")
    assert unusable.note in fleet.plan.describe()


def test_a_planner_that_can_place_again_says_the_plan_stands(export: Path) -> None:
    fleet = planner_unusable(export)
    fleet.rebalance()
    assert fleet.plan.last_replan.kind == "unusable"
    plan = dict(fleet.plan.plan)
    fleet.members["b"].profile = fleet.record(layer_s=40e-3, measured_at=2.0)  # far slower
    fleet.rebalance()
    kept = fleet.plan.last_replan
    assert fleet.plan.plan == plan and fleet.plan.pending is None
    assert (kept.kind, kept.count) == ("kept", 0)  # said, not counted
    assert kept.note.startswith("the plan stands: ")
    assert "no re-plan" not in fleet.plan.describe()
    assert "b" in fleet.plan.left_out


def test_a_lower_threshold_applies_the_same_re_plan(export: Path) -> None:
    fleet = joined_faster(export, 1.05, gain=0.01)
    fleet.rebalance()
    assert fleet.plan.pending == {0: HEAD, 1: HEAD, 2: "b", 3: "b"}


def test_a_worthwhile_re_plan_moves_shards_while_serving_then_switches(export: Path) -> None:
    fleet = joined_faster(export, 4.0)
    a = fleet.members["a"]
    fleet.rebalance()
    assert fleet.plan.pending == {0: HEAD, 1: HEAD, 2: "b", 3: "b"}
    planning = fleet.plan.last_replan
    assert (planning.kind, planning.time_s, planning.count) == ("planning", 1000.0, 1)
    assert planning.note.startswith("re-planning: predicted")
    assert fleet.plan.state(fleet.members) == "serving"  # the pipeline serves on meanwhile
    offers = fleet.plan.pending_offers(fleet.members)
    assert [(m.node_id, stage, quiet) for m, stage, quiet in offers] == [("b", 2, False)]
    assert fleet.rebalance() == []  # not before b holds its shards
    fleet.members["b"].shards.update(fleet.plan.hashes[2:])
    fleet.now = 1003.0
    assert fleet.rebalance() == [2, 3]
    assert fleet.plan.last_replan == ReplanStatus(
        "applied", planning.note.replace("re-planning", "re-planned"), 1003.0, 2)
    assert fleet.plan.plan == {0: HEAD, 1: HEAD, 2: "b", 3: "b"}
    assert fleet.plan.pending is None and fleet.plan.previous is not None
    assert fleet.plan.releases(fleet.members) == [a]  # a stops its stage: a spare
    assert fleet.plan.replan_note.startswith("re-planned")
    due = fleet.plan.assignments(fleet.members)
    assert {m.node_id for m, _ in due} == {HEAD, "b"}
    assert all(isinstance(msg, AssignStage) for _, msg in due)


def test_a_node_running_a_stage_fetches_the_shards_a_re_plan_gives_it_quietly(
        export: Path) -> None:
    fleet = Fleet(export)
    fleet.add(HEAD, 4, layer_s=8e-3)
    fleet.add("a", 4, layer_s=8e-3)
    late = fleet.add("b", 4, record=None)
    first = fleet.place()
    assert fleet.plan.placement_note.startswith("by memory") and "b" in first.values()
    fleet.serve()
    late.profile, late.profile_state = fleet.record(1e-3), "measured"  # it arrives
    fleet.rebalance()
    assert fleet.plan.pending == {0: HEAD, 1: "b", 2: "b", 3: "b"}
    offers = fleet.plan.pending_offers(fleet.members)
    assert [(m.node_id, quiet) for m, _, quiet in offers] == [("b", True)]
    fleet.plan.abandon("node b could not fetch shard 123: disk full")
    assert fleet.plan.pending is None and fleet.plan.plan == first
    assert "abandoned: node b could not fetch" in fleet.plan.replan_note
    assert fleet.plan.state(fleet.members) == "serving"


def test_a_re_plan_whose_node_fails_halfway_is_abandoned(export: Path) -> None:
    fleet = joined_faster(export, 4.0)
    fleet.rebalance()
    b = fleet.members["b"]
    b.state, b.error = ms.FAILED, "cannot fetch shard: disk full"
    assert fleet.rebalance() == []
    assert fleet.plan.pending is None
    assert fleet.plan.plan == {0: HEAD, 1: HEAD, 2: "a", 3: "a"}
    assert fleet.plan.replan_note == ("re-plan abandoned: node b failed: cannot fetch shard: "
                                      "disk full; serving on the current placement")
    assert fleet.plan.state(fleet.members) == "serving"
    assert fleet.rebalance() == []  # and it is not tried again with the failed node


def test_a_switched_plan_whose_stage_cannot_start_goes_back(export: Path) -> None:
    fleet = joined_faster(export, 4.0)
    fleet.rebalance()
    fleet.members["b"].shards.update(fleet.plan.hashes[2:])
    fleet.rebalance()
    for member in fleet.plan.releases(fleet.members):
        member.assigned, member.state = None, ms.IDLE
    for member, _ in fleet.plan.assignments(fleet.members):
        member.state = ms.WIRING
    b = fleet.members["b"]
    b.state, b.error = ms.FAILED, "cannot compile the stage"
    assert fleet.plan.state(fleet.members) == "failed"
    fleet.rebalance()
    assert fleet.plan.plan == {0: HEAD, 1: HEAD, 2: "a", 3: "a"}
    assert fleet.plan.replan_note.startswith("re-plan failed (stage 2")
    assert (fleet.plan.last_replan.kind, fleet.plan.last_replan.count) == ("failed", 3)
    epoch = fleet.plan.epoch
    offers = fleet.plan.offers_due(fleet.members)  # a, released, is offered its stage again
    assert [(m.node_id, s) for m, s in offers] == [("a", 2)]
    fleet.members["a"].state = ms.READY
    assert {m.node_id for m, _ in fleet.plan.assignments(fleet.members)} == {HEAD, "a"}
    assert fleet.plan.epoch == epoch + 1


def test_measured_links_are_used_and_missing_ones_assumed(export: Path) -> None:
    fleet = Fleet(export)
    members = [fleet.add(HEAD, 2), fleet.add("a", 2), fleet.add("b", 2)]
    slow = LinkStatus(HEAD, "a", rtt_s=0.05, forward_bps=1e6, backward_bps=1e6, measured_at=5.0)
    links, assumed = fleet.planner.links(members, [slow])
    assert links.link("a", HEAD).rtt_s == pytest.approx(0.05)
    assert assumed == 2  # b has no probed link to estimate its links from
    assert links.link(HEAD, "b").forward_bps == pytest.approx(117e6)
    # behind its slow link, a is left out for b
    plan = fleet.planner.place(members, [slow], {m.node_id: 1 << 40 for m in members})
    assert plan.stages == {0: HEAD, 1: HEAD, 2: "b", 3: "b"}


def test_a_profile_for_another_model_cannot_be_planned_on(export: Path) -> None:
    fleet = Fleet(export)
    member = fleet.add("a", 2, record=fleet.record(shape="another-shape"))
    with pytest.raises(PlanUnusable, match="node a's profile cannot be used: .*shape"):
        fleet.planner.profile(member)


def test_a_node_that_leaves_is_healed_as_before_then_re_planned(export: Path) -> None:
    fleet = Fleet(export)
    fleet.add(HEAD, 4, layer_s=8e-3)  # roomy but slow: it runs stage 0 only
    fleet.add("a", 3, layer_s=1e-3)
    fleet.add("b", 2, layer_s=1e-3)
    assert fleet.place() == {0: HEAD, 1: "a", 2: "a", 3: "a"}
    assert set(fleet.plan.left_out) == {"b"}
    fleet.serve()
    fleet.members["a"].mark_down(ms.LEFT, NOW - 1)
    assert fleet.plan.heal(fleet.members, NOW, 0.0, spares_first=False) == [1, 2, 3]
    assert fleet.plan.plan == dict.fromkeys(range(4), HEAD)  # healed onto the survivor
    fleet.serve()
    fleet.rebalance()
    assert fleet.plan.pending == {0: HEAD, 1: HEAD, 2: "b", 3: "b"}  # the spare, re-planned
    assert "b" not in fleet.plan.left_out


@pytest.mark.parametrize("profile_state", ["measuring", "failed: profiling took its budget"])
def test_a_node_joining_a_planned_pipeline_gets_no_stages_by_memory_before_its_profile(
        export: Path, profile_state: str) -> None:
    fleet = Fleet(export)
    fleet.add(HEAD, 1)
    fleet.add("a", 4)
    assert fleet.place() == {0: HEAD, 1: "a", 2: "a", 3: "a"}  # a run of several stages
    fleet.serve()
    joiner = fleet.add("new", 4, record=None)
    joiner.enrolled_at = NOW - 2 * SETTLED  # settled: memory would give it a's stages
    joiner.profile_state = profile_state
    assert fleet.rebalance() == []
    assert fleet.plan.plan == {0: HEAD, 1: "a", 2: "a", 3: "a"}
    # healed, the plan is no longer the planner's: a spare takes stages back by memory
    fleet.members["a"].mark_down(ms.LEFT, NOW - 1)
    assert fleet.plan.heal(fleet.members, NOW, 0.0, spares_first=False) == [1, 2, 3]
    fleet.serve()
    assert fleet.rebalance() != [] and "new" in fleet.plan.plan.values()


def test_the_planner_asks_for_its_objective_and_the_streams_it_judges_at(export: Path) -> None:
    """A cluster placed for throughput judges placements at its --max-streams streams and
    reserves their KV; one placed for latency, one stream's speed, KV for 4 streams."""
    fleet = Fleet(export)
    fleet.add(HEAD, 4)
    fleet.add("n1", 4)
    members = list(fleet.members.values())
    latency, _ = fleet.planner.request(members, ())
    assert (latency.objective, latency.streams) == ("latency", 4)
    throughput = StagePlanner(fleet.manifest, fleet.shape, fleet.needs, HEAD, "CPU", OV,
                              objective="throughput", streams=16)
    asked, _ = throughput.request(members, ())
    assert (asked.objective, asked.streams) == ("throughput", 16)
    best = plan(asked).placements[0]
    assert best.score == pytest.approx(best.streams.tok_s) and best.streams.streams == 16
