"""zctl bench fleet's pure parts: the arms and comparisons, the targets'
arithmetic and the report's ratios."""

from __future__ import annotations

import pytest

from tools.fleet.cases import (
    ARMS,
    COMPARISONS,
    STREAMS,
    Arm,
    Comparison,
    targets,
)
from tools.fleet.measure import arm_cpu_lists
from tools.fleet.report import fleet_report, placement_text

NO_DROP = Comparison("slow joiner", "no-drop", "joined", "base", 0.05, control="equal")
SPEEDUP = Comparison("uneven", "speedup", "planned", "equal", 1.3)


def test_every_comparison_names_arms_that_exist() -> None:
    for c in COMPARISONS:
        assert {c.subject, c.reference} | ({c.control} if c.control else set()) <= set(ARMS)


def test_the_joiners_share_the_second_core_and_the_planned_arms_cut_finer() -> None:
    assert ARMS["two+slow"].cores == (0, 1, 1) and ARMS["two+slow"].joins
    assert ARMS["three-equal-slow"].stages == 3 and ARMS["two"].stages == 6
    assert arm_cpu_lists(ARMS["two+far"], [4, 7]) == ["4", "7", "7"]
    with pytest.raises(ValueError, match="needs 2 cores"):
        arm_cpu_lists(ARMS["two"], [0])


@pytest.mark.parametrize("bad", [
    dict(nodes=1, cores=(0,)), dict(cores=(0,)), dict(slow_share=1.0), dict(delay_ms=-1.0),
    dict(joins=True, planned=False)])
def test_a_bad_arm_is_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match="arm x"):
        Arm(**{"name": "x", "nodes": 2, "cores": (0, 1), "planned": True, **bad})


def test_a_bad_comparison_is_refused() -> None:
    with pytest.raises(ValueError, match="kind"):
        Comparison("x", "faster", "a", "b", 1.3)
    with pytest.raises(ValueError, match="bound > 0"):
        Comparison("x", "speedup", "a", "b", 0)


def test_no_drop_is_met_down_to_five_percent_below_and_speedup_from_its_bound() -> None:
    runs = {"base": {1: [40.0], 8: [200.0]}, "joined": {1: [38.0], 8: [189.0]},
            "planned": {1: [52.0], 8: [300.0]}, "equal": {1: [40.0], 8: [240.0]}}
    got = targets((NO_DROP, SPEEDUP), runs)
    assert got["slow joiner, 1 stream: drop <= 5%"] == {"value": 0.95, "target": 0.95,
                                                        "met": True}
    assert got["slow joiner, 8 streams: drop <= 5%"]["met"] is False  # 0.945
    assert got["uneven, 1 stream: >= 1.3x"] == {"value": 1.3, "target": 1.3, "met": True}
    assert got["uneven, 8 streams: >= 1.3x"]["value"] == 1.25
    assert not got["uneven, 8 streams: >= 1.3x"]["met"]


def test_a_target_is_judged_on_the_ratio_not_on_its_rounded_figure() -> None:
    # 0.9496: shown as 0.95, yet short of the 0.95 a 5% drop allows
    runs = {"base": {1: [100.0], 8: [200.0]}, "joined": {1: [94.96], 8: [190.0]}}
    got = targets((NO_DROP,), runs)
    assert got["slow joiner, 1 stream: drop <= 5%"] == {"value": 0.95, "target": 0.95,
                                                        "met": False}
    assert got["slow joiner, 8 streams: drop <= 5%"]["met"] is True  # 0.95 itself


def test_an_arm_without_figures_misses_its_targets() -> None:
    got = targets((SPEEDUP,), {"equal": {1: [40.0], 8: [240.0]}})
    assert all(t == {"value": None, "target": 1.3, "met": False} for t in got.values())
    assert len(got) == len(STREAMS)


def test_the_report_puts_the_control_beside_the_subject() -> None:
    arms = {name: {"streams": {"1": {"runs_tok_s": r1}, "8": {"runs_tok_s": r8}}}
            for name, r1, r8 in (("two", [40, 20], [200, 100]),
                                 ("two+slow", [41, 20.5], [198, 99]),
                                 ("three-equal-slow", [20, 10], [120, 60]))}
    report = fleet_report(arms)
    slow = report["comparisons"]["slow joiner"]
    assert slow["ratio"] == {"1": 1.025, "8": 0.99}
    assert slow["control_ratio"] == {"1": 0.5, "8": 0.6}
    assert report["comparisons"]["far joiner"]["ratio"] == {"1": None, "8": None}
    assert report["targets"]["slow joiner, 8 streams: drop <= 5%"]["met"] is True


def test_the_placement_merges_a_nodes_consecutive_stages() -> None:
    arm = {"stages": [{"node": "coordinator", "layers": [0, 5]},
                      {"node": "coordinator", "layers": [5, 10]},
                      {"node": "node1", "layers": [10, 30]}]}
    assert placement_text(arm) == "coordinator 0-9, node1 10-29"
