"""The running placement's prediction from a status snapshot: the model of time on its
stages, profiles and probed links, a node's consecutive stages as one, the engine's row
groups, and "no prediction" with the reason for whatever is missing."""

from __future__ import annotations

import math
import re

import pytest

from controlplane.planner.presets import PRESETS
from controlplane.planner.profile import GRAPH_VERSION
from controlplane.planner.running import (
    NoPrediction,
    relative_error,
    running_prediction,
    streams_prediction,
)
from controlplane.records import (
    ClusterStatus,
    DeviceInfo,
    LinkStatus,
    NodeStatus,
    PredictionStatus,
    ProfileRecord,
    StageStatus,
)

SMOL = PRESETS["smollm2-135m"]  # 30 layers, hidden 576
LAYER = [2e-4, 2.5e-4, 3e-4, 4e-4]  # one layer's step at 1, 2, 4, 8 rows
HEAD = [1e-3, 1.2e-3, 1.5e-3, 2e-3]
CALL = 1e-4
ENGINE = [1e-4, 1.2e-4, 1.5e-4, 2e-4]  # the coordinator's step at 1, 2, 4, 8 rows
RTT = 2e-3
BPS = 1e12  # bytes cost next to nothing: the hops are their round trips' halves


def _node(node_id: str, profile: bool = True, state: str = "measured", slower: float = 1.0,
          **kw: object) -> NodeStatus:
    record = ProfileRecord(SMOL.fingerprint(), "int4", "CPU", "ov", [v * slower for v in LAYER],
                           HEAD, 2e4, CALL, 2 << 20, 9 << 30, graph=GRAPH_VERSION,
                           engine_decode_s=ENGINE) if profile else None
    return NodeStatus(node_id, "h", "serving", None, "tcp://h:1", 0.1, [DeviceInfo("CPU")],
                      4 << 30, 8 << 30, "ov", "z", 1, profile=record, profile_state=state, **kw)


def _stages(*spans: tuple[str, int, int]) -> list[StageStatus]:
    return [StageStatus(i, start, end, "h", 1 << 20, node, "serving")
            for i, (node, start, end) in enumerate(spans)]


def _link(a: str, b: str, rtt: float = RTT, error: str = "") -> LinkStatus:
    return LinkStatus(a, b, rtt, BPS, BPS, [2316], 1.0, error)


def _status(nodes: list[NodeStatus], stages: list[StageStatus], links: list[LinkStatus],
            pipeline: str = "serving", shape: object = SMOL) -> ClusterStatus:
    return ClusterStatus("c", "s", "tcp://c:5550", 8, "ov", "z", "/x", "smollm2-135m", pipeline,
                         1, 1.0, "", nodes, stages, [], {}, shape=shape, links=links)


def two_nodes(**kw: object) -> ClusterStatus:
    return _status([_node("c", local=True), _node("a", slower=2.0)],
                   _stages(("c", 0, 10), ("a", 10, 30)),
                   [_link("c", "a"), _link("a", "c", rtt=4e-3)], **kw)


def test_one_stream_waits_for_every_stage_every_hop_and_the_reply() -> None:
    got = running_prediction(two_nodes())
    assert not got.error and got.nodes == ["c", "a"]
    first = CALL + ENGINE[0] + 10 * LAYER[0]  # the coordinator's node runs the engine too
    last = CALL + HEAD[0] + 20 * 2 * LAYER[0]
    assert got.stage_ms == pytest.approx([first * 1e3, last * 1e3])
    # c to a, then the reply a to c: half the pair's round trip, its two probes averaged
    hops = [(RTT + 4e-3) / 4] * 2
    assert got.hop_ms == pytest.approx([h * 1e3 for h in hops], rel=1e-3)
    assert got.tok_s == pytest.approx(1 / (first + last + sum(hops)), rel=1e-3)
    assert streams_prediction(got, 1) == got.streams[0]
    assert got.streams[0].tok_s == pytest.approx(got.tok_s)


def test_streams_run_in_the_engines_row_groups() -> None:
    status = two_nodes()
    grouped = running_prediction(status, row_groups=2)
    eight = grouped.streams[7]
    assert (eight.streams, eight.row_groups, eight.rows) == (8, 2, 4)
    # a round of two groups of 4 rows: the longer of one cycle and twice the busiest stage
    stage0 = CALL + 10 * 3e-4
    stage1 = CALL + 1.5e-3 + 20 * 6e-4
    cycle = stage0 + stage1 + RTT / 2 + 4e-3 / 2
    assert eight.tok_s == pytest.approx(8 / max(cycle, 2 * stage1), rel=1e-3)
    alone = running_prediction(status, row_groups=0).streams[7]  # none: a group a stream
    assert (alone.row_groups, alone.rows) == (8, 1)
    assert grouped.row_groups == 2 and running_prediction(status).row_groups == -1
    best = running_prediction(status).streams[7]  # not known: the best for 8 streams
    assert best.tok_s >= max(eight.tok_s, alone.tok_s) - 1e-9
    with pytest.raises(ValueError, match="row groups"):
        running_prediction(status, row_groups=-1)


def test_a_link_probed_one_way_gives_both_ways() -> None:
    status = _status([_node("c", local=True), _node("a")], _stages(("c", 0, 10), ("a", 10, 30)),
                     [_link("c", "a", rtt=3e-3), LinkStatus("a", "c", error="probing")])
    got = running_prediction(status)
    assert got.hop_ms == pytest.approx([1.5, 1.5], rel=1e-3)  # the reply a -> c: the same probe


def test_a_nodes_consecutive_stages_are_one_stage_with_a_call_each() -> None:
    status = _status([_node("c", local=True), _node("a")],
                     _stages(("c", 0, 10), ("a", 10, 20), ("a", 20, 30)),
                     [_link("c", "a"), _link("a", "c")])
    got = running_prediction(status)
    assert got.nodes == ["c", "a"]
    assert got.stage_ms[1] == pytest.approx((2 * CALL + HEAD[0] + 20 * LAYER[0]) * 1e3)


def test_one_node_has_no_hops() -> None:
    got = running_prediction(_status([_node("c", local=True)], _stages(("c", 0, 30)), []))
    assert got.hop_ms == [] and got.tok_s == pytest.approx(
        1 / (CALL + ENGINE[0] + HEAD[0] + 30 * LAYER[0]))


@pytest.mark.parametrize(("status", "why"), [
    (_status([_node("c", local=True), _node("a", profile=False, state="measuring")],
             _stages(("c", 0, 10), ("a", 10, 30)), [_link("c", "a"), _link("a", "c")]),
     "node a has no profile: measuring"),
    (_status([_node("c", local=True), _node("a")], _stages(("c", 0, 10), ("a", 10, 30)),
             [LinkStatus("c", "a", error="probing")]),
     r"the link c -> a is not measured yet \(probing\)"),
    (_status([_node("c", local=True), _node("a")], _stages(("c", 0, 10), ("a", 10, 30)), []),
     "the link c -> a is not measured yet"),
    (two_nodes(pipeline="wiring"), "the pipeline is wiring, not serving"),
    (two_nodes(shape=None), "shape is unknown"),
    (_status([_node("c", local=True), _node("a")],
             _stages(("c", 0, 10), ("a", 10, 20), ("c", 20, 30)), []),
     "node c runs stages that are not consecutive"),
    (_status([_node("c", local=True)], [StageStatus(0, 0, 30, "h", 1, None, "pending")], []),
     "stage 0 has no node"),
    (_status([_node("c", local=True)], _stages(("c", 0, 10), ("gone", 10, 30)), []),
     "node gone runs a stage but is not a member"),
])
def test_what_is_missing_is_no_prediction_with_the_reason(status: ClusterStatus,
                                                          why: str) -> None:
    got = running_prediction(status)
    assert got.streams == [] and got.nodes == [] and got.tok_s == 0.0
    assert re.search(why, got.error), got.error
    with pytest.raises(NoPrediction, match=why):
        streams_prediction(got, 1)


def test_a_profile_of_another_shape_is_no_prediction() -> None:
    other = PRESETS["llama-3.2-1b"]
    status = two_nodes()
    nodes = [status.nodes[0], NodeStatus(**{**status.nodes[1].__dict__, "profile": ProfileRecord(
        other.fingerprint(), "int4", "CPU", "ov", LAYER, HEAD, 2e4, CALL, 2 << 20, 9 << 30,
        graph=GRAPH_VERSION, engine_decode_s=ENGINE)})]
    got = running_prediction(_status(nodes, status.stages, status.links))
    assert got.error.startswith("node a has no profile: profiled for shape")


def test_streams_beyond_those_predicted_and_bad_counts_are_refused() -> None:
    got = running_prediction(two_nodes())
    with pytest.raises(NoPrediction, match="9 streams are not predicted"):
        streams_prediction(got, 9)
    with pytest.raises(ValueError, match=">= 1"):
        streams_prediction(got, 0)
    with pytest.raises(NoPrediction, match="why not"):
        streams_prediction(PredictionStatus(error="why not"), 1)


def test_the_relative_error_is_positive_when_the_prediction_is_too_fast() -> None:
    assert relative_error(115.0, 100.0) == pytest.approx(0.15)
    assert relative_error(75.0, 100.0) == pytest.approx(-0.25)
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="positive"):
            relative_error(1.0, bad)
