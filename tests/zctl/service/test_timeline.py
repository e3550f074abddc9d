"""The cluster's timeline, read from consecutive status snapshots: joins, losses and
returns, heals, stages given back, re-plans, refusals, the pipeline's state."""

from __future__ import annotations

from dataclasses import replace

from controlplane.records import RefusalInfo, ReplanStatus, StageStatus
from tests.zctl.cli.test_view import cluster, node
from zctl.service.timeline import KINDS, Timeline, status_events


def two(**n1) -> object:
    return replace(cluster([node("coord", 0, "127.0.0.1"), node("n1", 1, "127.0.0.2", **n1)]),
                   stages=[StageStatus(0, 0, 2, "h0", 1, "coord", "serving"),
                           StageStatus(1, 2, 4, "h1", 1, "n1", "serving")], time_s=100.0)


def kinds(events) -> list[str]:
    return [e.kind for e in events]


def test_a_node_that_joins_is_lost_and_comes_back() -> None:
    alone = replace(two(), nodes=two().nodes[:1])
    joined = status_events(alone, two())
    assert kinds(joined) == ["joined"] and joined[0].node == "n1"
    assert "127.0.0.2" in joined[0].text
    lost = status_events(two(), two(state="dead"))
    assert kinds(lost) == ["lost"]
    assert kinds(status_events(two(state="dead"), two())) == ["returned"]
    assert kinds(status_events(two(), two(state="left"))) == ["left"]
    assert kinds(status_events(two(), alone)) == ["left"]
    assert status_events(two(), two()) == []


def test_a_heal_moves_a_lost_nodes_stage_and_the_pipeline_serves_again() -> None:
    dead = replace(two(state="dead"), pipeline="degraded")
    assert kinds(status_events(two(), dead)) == ["lost", "degraded"]
    healed = replace(two(state="dead"), epoch=2, stages=[
        StageStatus(0, 0, 2, "h0", 1, "coord", "serving"),
        StageStatus(1, 2, 4, "h1", 1, "coord", "serving")])
    events = status_events(dead, healed)
    assert kinds(events) == ["healed", "serving"]
    assert events[0].text == "stage 1 moved from n1 (lost) to coordinator"
    assert "epoch 2" in events[1].text
    back = status_events(replace(healed, nodes=two().nodes), two())
    assert kinds(back) == ["given_back"] and "coordinator to n1" in back[0].text


def test_a_replan_says_what_it_moved_and_its_note() -> None:
    note = "re-planned: predicted 40 tok/s against 20 now"
    replanned = replace(two(), stages=[StageStatus(0, 0, 2, "h0", 1, "coord", "serving"),
                                       StageStatus(1, 2, 4, "h1", 1, "coord", "serving")],
                        replan=ReplanStatus("applied", note, 98.5, 2))
    before = replace(two(), replan=ReplanStatus("planning", "re-planning: ...", 90.0, 1))
    events = status_events(before, replanned)
    assert kinds(events) == ["replan", "replan"]
    assert "(re-plan)" in events[0].text and events[0].time == 100.0
    assert events[1].text == note and events[1].time == 98.5  # when it came
    # the same re-plan again is no new event: a stage moving now is given back
    assert kinds(status_events(replanned, replace(replanned, stages=two().stages))) == [
        "given_back"]
    # the note is read from the re-plan, never from the placement's words
    worded = replace(two(), placement="by the planner; re-planning: 2x faster")
    assert status_events(two(), worded) == []
    # nor is a planner that cannot place (not counted) a re-plan
    unusable = replace(two(), replan=ReplanStatus("unusable", "no re-plan: x", 99.0, 0))
    assert status_events(two(), unusable) == []


def test_refusals_are_events_at_their_own_time() -> None:
    refusal = RefusalInfo("old", "10.0.0.9", "OpenVINO 2025.1 differs", 4.0, "openvino-version")
    refused = replace(two(), refused=[refusal], counters={"refused": 1})
    first = status_events(None, refused)  # what the coordinator remembers
    assert kinds(first) == ["refused"] and first[0].time == 96.0
    assert "OpenVINO 2025.1 differs" in first[0].text
    again = replace(refused, refused=[refusal, replace(refusal, age_s=0.5)],
                    counters={"refused": 2})
    assert [e.time for e in status_events(refused, again)] == [99.5]
    assert status_events(refused, refused) == []


def test_the_timeline_keeps_the_latest_with_growing_ids() -> None:
    timeline = Timeline(size=3)
    timeline.feed(two())
    for _ in range(3):
        timeline.feed(two(state="dead"))
        timeline.feed(two())
    recent = timeline.recent()
    assert [e["id"] for e in recent] == [4, 5, 6]
    assert [e["kind"] for e in recent] == ["returned", "lost", "returned"]
    assert set(recent[0]) == {"id", "kind", "time", "text", "node"}
    assert all(e["kind"] in KINDS for e in recent)
    # another coordinator (a restart): its nodes are not compared with the old one's
    assert timeline.feed(replace(two(state="dead"), session="other")) == []
