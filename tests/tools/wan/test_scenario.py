"""Scenario files (tools.wan.scenario): read into grids, bad files refused in one line, the
shipped scenarios."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.repo import ROOT
from tools.wan.scenario import Link, ScenarioError, Workload, load_scenario, parse_scenario

SHIPPED = sorted((ROOT / "tools" / "wan" / "scenarios").glob("*.toml"))


def scenario_of(text: str, tmp_path: Path, name: str = "s.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- scenarios and their grids --------------------------------------------------------------


def test_a_scenario_expands_into_every_topology_times_every_workload():
    scenario = parse_scenario({
        "topology": {"stages": [3, 2]},
        "link": {"delay_ms": [50, 0], "relay": [False, True], "rate_mbit": 20},
        "workload": {"decoding": ["plain", "lookup"], "k": [0, 3], "streams": [4, 1],
                     "payload": ["top1", "logits"], "tokens": 16, "repetitions": 2},
    }, "grid")
    assert scenario.name == "grid" and scenario.tokens == 16 and scenario.repetitions == 2
    assert len(scenario.topologies) == 2 * 2 * 2
    first = scenario.topologies[0]
    assert first.stages == 2 and first.link == Link(0.0, rate_mbit=20.0)
    assert len(first.hops) == 2 and first.uniform
    assert [t.stages for t in scenario.topologies] == [2, 2, 2, 2, 3, 3, 3, 3]
    assert [t.link.relay for t in scenario.topologies[:4]] == [False, False, True, True]
    configs = [(w.config, w.streams, w.payload) for w in scenario.workloads]
    assert len(configs) == (1 + 2) * 2 * 2
    assert configs[:4] == [("plain", 1, "top1"), ("plain", 1, "logits"),
                           ("plain", 4, "top1"), ("plain", 4, "logits")]
    assert {c[0] for c in configs} == {"plain", "lookup-auto", "lookup-k3"}
    assert len(scenario.cells()) == 8 * 12


def test_defaults_make_a_plain_single_stream_top1_grid():
    scenario = parse_scenario({}, "empty")
    assert [t.stages for t in scenario.topologies] == [2]
    assert scenario.workloads == (Workload("plain", None, 1, "top1"),)
    assert scenario.model == "smollm2-135m" and scenario.prompts


def test_a_hop_can_differ_from_the_swept_link():
    scenario = parse_scenario({"link": {"delay_ms": [10, 20]},
                               "hop": [{"index": 1, "rate_mbit": 20, "relay": True}]}, "h")
    topology = scenario.topologies[1]
    assert topology.hops == (Link(20.0), Link(20.0, rate_mbit=20.0, relay=True))
    assert not topology.uniform and topology.link == Link(20.0)


def test_link_labels_and_configuration_names():
    assert Link(rate_mbit=20, relay=True).label == "relay-20mbit"
    assert Link(rate_mbit=1000).label == "1000mbit" and Link().label == "unlimited"
    assert Workload("lookup", 0, 1, "top1").config == "lookup-auto"
    assert Workload("lookup", 7, 1, "top1").config == "lookup-k7"
    assert Workload("plain", None, 4, "logits").k_label == ""


@pytest.mark.parametrize(("text", "message"), [
    ("stages = 2", "unknown key 'stages'"),
    ("[link]\ndelay = 5", r"\[link\] has unknown key 'delay'"),
    ("[link]\ndelay_ms = -5", r"\[link\]\.delay_ms must be a number in 0\.\.60000, got -5"),
    ("[link]\ndelay_ms = []", "delay_ms is an empty list"),
    ("[link]\ndelay_ms = [5, 5]", "lists a value twice"),
    ("[link]\nrelay = 'yes'", "relay must be true or false"),
    ("[link]\nshaper = 'netem'", "shaper must be one of ours, tbf"),
    ("[link]\nshaper = 'tbf'", "caps a bandwidth"),
    ("[link]\nshaper = 'tbf'\nrate_mbit = 5\nrelay = true", "has no relay"),
    ("[link]\nshaper = 'tbf'\nrate_mbit = 5\n[[hop]]\nindex = 1\ndelay_ms = 3",
     "cannot be used with shaper"),
    ("[[hop]]\nindex = 1\nshaper = 'tbf'", "unknown key 'shaper'"),
    ("[topology]\nstages = 1", r"stages must be an integer in 2\.\.8"),
    ("[workload]\ndecoding = 'beam'", "decoding must be one of plain, lookup"),
    ("[workload]\nk = 3", "k is set but no decoding is 'lookup'"),
    ("[workload]\ndecoding = 'lookup'\nk = 40", r"k must be an integer in 0\.\.32"),
    ("[workload]\npayload = 'fp8'", "payload must be one of top1, topk, fp16, logits"),
    ("[workload]\nprompts = []", "prompts must be a non-empty list"),
    ("[workload]\ntokens = 1", r"tokens must be an integer in 2\.\.4096"),
    ("[[hop]]\nindex = 2\ndelay_ms = 5", r"index must be an integer in 0\.\.1"),
    ("[[hop]]\ndelay_ms = 5", "needs an index"),
    ("hop = 3", "array of tables"),
    ("[model]\nweights = 'int3'", "weights must be one of"),
    ("[model]\nexports = { 3 = 'x' }", "no export for 2 stages"),
    ("[link\n", "not valid TOML"),
])
def test_a_bad_scenario_file_is_one_line_naming_the_file_and_key(tmp_path, text, message):
    path = scenario_of(text, tmp_path)
    with pytest.raises(ScenarioError, match=message) as caught:
        load_scenario(path)
    assert str(caught.value).startswith(f"{path}: ") and "\n" not in str(caught.value)


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(ScenarioError, match="cannot read it"):
        load_scenario(tmp_path / "none.toml")


def test_exports_are_relative_to_the_scenario_file(tmp_path):
    scenario = load_scenario(scenario_of("[model]\nexports = { 2 = 'exp2' }", tmp_path))
    assert scenario.exports == {2: tmp_path / "exp2"} and scenario.source == tmp_path / "s.toml"


def test_the_shipped_scenarios_read_and_cover_the_paper():
    names = {p.stem: load_scenario(p) for p in SHIPPED}
    assert {"latency", "streams", "bandwidth", "relay", "jitter", "tbf"} <= set(names)
    assert {t.link.shaper for t in names["tbf"].topologies} == {"ours", "tbf"}
    latency = names["latency"]
    assert {t.link.delay_ms for t in latency.topologies} == {0, 10, 25, 50, 100, 200}
    assert {t.stages for t in latency.topologies} == {2, 3}
    assert {w.k for w in latency.workloads} == {None, 0, 1, 3, 5, 7, 10}
    assert {w.streams for w in names["streams"].workloads} == {1, 2, 4, 8}
    bandwidth = names["bandwidth"]
    assert {t.link.rate_mbit for t in bandwidth.topologies} == {1, 10, 100, 1000}
    assert {t.link.relay for t in bandwidth.topologies} == {False, True}
    assert {w.payload for w in names["relay"].workloads} == {"top1", "topk", "fp16", "logits"}
    sweep = names["sweep"]  # the latency sweep: plain, lookup and 4 streams, 0-50 ms a hop
    assert {t.link.delay_ms for t in sweep.topologies} == {0, 5, 10, 25, 50}
    assert {(w.config, w.streams) for w in sweep.workloads} == {
        ("plain", 1), ("plain", 4), ("lookup-auto", 1), ("lookup-auto", 4)}
    assert len(sweep.prompts) == sweep.repetitions == 3 and sweep.weights == "int4"
