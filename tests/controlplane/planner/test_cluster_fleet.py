"""A running cluster's status as a fleet: measured profiles, probed links, estimates for the
pairs that were not probed, and who is left out and why."""

from __future__ import annotations

import pytest

from controlplane.planner.cluster_fleet import cluster_fleet, estimated_links, measured_links
from controlplane.planner.presets import PRESETS
from controlplane.planner.profile import GRAPH_VERSION, ProfileError
from controlplane.planner.search import PlanRequest, plan
from controlplane.records import (
    ClusterStatus,
    DeviceInfo,
    LinkStatus,
    NodeStatus,
    ProfileRecord,
    StageStatus,
)

SMOL = PRESETS["smollm2-135m"]


def _node(node_id: str, profile: bool = True, weights: str = "int4", state: str = "serving",
          **kw: object) -> NodeStatus:
    record = ProfileRecord(SMOL.fingerprint(), weights, "CPU", "ov", [2e-4, 2.5e-4, 3e-4, 4e-4],
                           [1e-3] * 4, 2e4, 1e-4, 2 << 20, 9 << 30, graph=GRAPH_VERSION,
                           engine_decode_s=[1e-4] * 4) if profile else None
    return NodeStatus(node_id, "h", state, None, "tcp://h:1", 0.1, [DeviceInfo("CPU")], 4 << 30,
                      8 << 30, "ov", "z", 1, profile=record,
                      profile_state="kept" if profile else "not profiled yet", **kw)


def _status(nodes: list[NodeStatus], links: list[LinkStatus]) -> ClusterStatus:
    return ClusterStatus("c", "s", "tcp://c:5550", 7, "ov", "z", "/x", "smollm2-135m", "serving",
                         1, 1.0, "", nodes, [StageStatus(0, 0, 30, "h", 1 << 30, "c", "serving")],
                         [], {}, shape=SMOL, links=links)


def _link(a: str, b: str, rtt: float, forward: float, backward: float) -> LinkStatus:
    return LinkStatus(a, b, rtt, forward, backward, [2316], 1.0)


def test_probed_links_both_ways_are_one_pair_and_the_others_are_estimated() -> None:
    links = [_link("c", "a", 1e-3, 100e6, 80e6), _link("a", "c", 3e-3, 90e6, 110e6),
             _link("c", "b", 2e-3, 50e6, 40e6)]
    measured = measured_links(links)
    assert set(measured) == {("c", "a"), ("c", "b")}
    assert measured[("c", "a")].rtt_s == pytest.approx(2e-3)
    assert measured[("c", "a")].forward_bps == pytest.approx(105e6)  # c to a: 100 and 110
    pairs = estimated_links(["a", "b", "c"], measured)
    estimate = pairs[("a", "b")]
    assert estimate.rtt_s == pytest.approx(2e-3 / 2 + 2e-3 / 2)  # half of each end's best
    assert estimate.forward_bps == pytest.approx(50e6)  # a up 85 MB/s, b down 50
    assert estimated_links(["a", "z"], measured) == {}  # z has no measured link


def test_a_cluster_plans_on_its_profiled_nodes_with_the_memory_its_stages_hold() -> None:
    status = _status([_node("c", local=True), _node("a"), _node("spare", profile=False),
                      _node("gone", state="dead"), _node("other", weights="int8")],
                     [_link("c", "a", 5e-4, 1e9, 1e9), _link("a", "c", 5e-4, 1e9, 1e9)])
    fleet = cluster_fleet(status, SMOL, "int4")
    assert set(fleet.profiles) == {"c", "a"} and fleet.head == "c"
    assert fleet.profiles["c"].free_memory == (4 << 30) + (1 << 30)  # free + its stage
    assert any("spare left out: not profiled yet" in n for n in fleet.notes)
    assert any("other left out: profiled for" in n and "int8" in n for n in fleet.notes)
    result = plan(PlanRequest(SMOL, "int4", fleet.profiles, fleet.links, head=fleet.head))
    assert result.placements[0].nodes[0] == "c"


def test_a_node_without_a_measured_link_is_left_out() -> None:
    status = _status([_node("c", local=True), _node("a"), _node("b")],
                     [_link("c", "a", 5e-4, 1e9, 1e9)])
    fleet = cluster_fleet(status, SMOL, "int4")
    assert set(fleet.profiles) == {"c", "a"}
    assert any("b left out: none of its links is measured yet" in n for n in fleet.notes)


def test_a_cluster_whose_nodes_have_no_profiles_yet_gets_a_clear_error() -> None:
    status = _status([_node("c", profile=False, local=True), _node("a", profile=False)], [])
    with pytest.raises(ProfileError, match="no node of the cluster .* has a profile .*c: not "
                                           "profiled yet; a: not profiled yet"):
        cluster_fleet(status, SMOL, "int4")
    with pytest.raises(ProfileError, match="no node"):
        cluster_fleet(_status([_node("c", local=True)], []), PRESETS["llama-3.1-8b"], "int4")


def test_a_lone_coordinator_needs_no_link() -> None:
    fleet = cluster_fleet(_status([_node("c", local=True)], []), SMOL, "int4")
    assert list(fleet.profiles) == ["c"]
