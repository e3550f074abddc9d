"""Scripted WAN experiments (tools/experiment): scenario files read into grids, bad files
refused in one line, the ratios the evaluation reports computed from rows, the CSV and the
figures written; and a small scenario run end to end on the tiny model."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.repo import ROOT
from tools.experiment.analysis import (
    COLUMNS,
    auto_k_over_best_fixed,
    best_fixed_k,
    best_over_plain,
    comparisons,
    lookup_over_plain,
    payload_over_full,
    streams_over_one,
    top1_over_full,
    write_csv,
)
from tools.experiment.plots import draw_all
from tools.experiment.runner import link_shape_of, request_fields, stream_prompts
from tools.experiment.scenario import (
    Link,
    ScenarioError,
    Workload,
    load_scenario,
    parse_scenario,
)

SHIPPED = sorted((ROOT / "tools" / "experiments").glob("*.toml"))


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


# -- what a workload asks the service for ---------------------------------------------------


def test_request_fields_ask_for_speculation_and_each_payload():
    assert request_fields(Workload("plain", None, 1, "top1")) == {}
    assert request_fields(Workload("lookup", 0, 1, "top1")) == {"speculative": "lookup", "k": 0}
    assert request_fields(Workload("lookup", 5, 2, "logits")) == {
        "speculative": "lookup", "k": 5, "logprobs": True, "top_logprobs": 5,
        "logits_payload": "fp32"}
    for payload, policy in (("topk", "auto"), ("fp16", "fp16")):
        assert request_fields(Workload("plain", None, 1, payload)) == {
            "logprobs": True, "top_logprobs": 5, "logits_payload": policy}
    assert stream_prompts(["a", "b"], 3, 1) == ["b", "a", "b"]
    shape = link_shape_of(Link(20.0, 1.0, 20.0, relay=True, relay_delay_ms=2.0))
    assert (shape.relays, shape.rate_mbit, shape.relay_delay_ms) == (1, 20.0, 2.0)
    assert link_shape_of(Link(5.0)).relays == 0


class Recorder:
    """A runner.Reporter that keeps what it is told."""

    def __init__(self) -> None:
        self.said: list[str] = []

    def cluster(self, text: str) -> None:
        self.said.append(f"cluster {text}")

    def sample(self, text: str) -> None:
        self.said.append(f"sample {text}")

    def cluster_done(self) -> None:
        self.said.append("done")


RECORD = {"date": "2026-12-02T00:00:00+00:00", "cpu": "test CPU", "commit": "abc1234"}


@pytest.fixture
def no_cluster(monkeypatch):
    """start_local_cluster and friends replaced: the runner's logic without processes."""
    import zctl.launcher.local as procs

    started = []

    def start(export_dir, nodes, runtime, root, **options):
        started.append((nodes, options["links"]))
        return procs.ClusterRecord("tcp://c", "tcp://s", str(export_dir), [])

    monkeypatch.setattr(procs, "start_local_cluster", start)
    monkeypatch.setattr(procs, "wait_serving", lambda record, timeout: None)
    monkeypatch.setattr(procs, "stop_processes", lambda pids: None)
    return started


def test_a_failed_measurement_is_a_result_and_the_others_still_run(no_cluster, monkeypatch,
                                                                   tmp_path):
    from controlplane.records import RuntimeSpec
    from tools.experiment import runner

    calls = []

    def measure(serve, work, prompts, tokens, timeout):
        calls.append((work.config, len(prompts), tokens))
        if work.streams == 4 and tokens == 48:  # the cell, not the warm-up
            raise RuntimeError("boom")
        return {"tok_s": 10.0 + len(calls), "seconds": 1.0}

    monkeypatch.setattr(runner, "measure", measure)
    scenario = parse_scenario({"link": {"delay_ms": 5, "relay": True},
                               "workload": {"streams": [1, 4], "repetitions": 2}}, "t")
    reporter = Recorder()
    rows = runner.run_scenario(scenario, {2: tmp_path}, runner.RunSettings(
        RuntimeSpec(), tmp_path), RECORD, reporter)
    assert calls[:2] == [("plain", 1, 16), ("plain", 4, 4)]  # the warm-up requests
    assert calls[2:] == [("plain", 1, 48), ("plain", 4, 48)] * 2
    assert [r["error"] for r in rows] == ["", "RuntimeError: boom"]
    assert rows[0]["tok_s"] == 14.0 and rows[0]["tok_s_runs"] == "13.000 15.000"
    assert rows[1]["tok_s"] is None and rows[0]["cpu"] == "test CPU"
    assert no_cluster[0][0] == 2 and [s.relays for s in no_cluster[0][1]] == [1, 1]
    assert reporter.said[0].startswith("cluster 2 stages, 5 ms") and reporter.said[-1] == "done"
    assert sum(s.startswith("sample") for s in reporter.said) == 4


def test_a_cluster_that_does_not_start_fails_its_cells_only(no_cluster, monkeypatch, tmp_path):
    import zctl.launcher.local as procs
    from controlplane.records import RuntimeSpec
    from tools.experiment import runner

    def start(export_dir, nodes, runtime, root, **options):
        if options["links"][0].delay_ms == 0:
            raise procs.ClusterError("no room")
        return procs.ClusterRecord("tcp://c", "tcp://s", str(export_dir), [])

    monkeypatch.setattr(procs, "start_local_cluster", start)
    monkeypatch.setattr(runner, "measure", lambda *args: {"tok_s": 5.0})
    scenario = parse_scenario({"link": {"delay_ms": [0, 50]}}, "t")
    rows = runner.run_scenario(scenario, {2: tmp_path}, runner.RunSettings(
        RuntimeSpec(), tmp_path), RECORD, Recorder())
    assert [(r["delay_ms"], r["tok_s"], r["error"]) for r in rows] == [
        (0.0, None, "cluster: no room"), (50.0, 5.0, "")]


# -- ratios over rows -----------------------------------------------------------------------


def row(delay: float, config: str, tok_s: float, streams: int = 1, payload: str = "top1",
        link: str = "unlimited", k_mean: float | None = None, stages: int = 2) -> dict:
    decoding, _, k = config.partition("-")
    k = {"auto": "auto", "": ""}.get(k, k.removeprefix("k"))
    bandwidth = link.removesuffix("-tbf")
    rate = 0.0 if link == "unlimited" else float(
        bandwidth.removeprefix("relay-").removesuffix("mbit"))
    return {"scenario": "t", "stages": stages, "delay_ms": delay, "jitter_ms": 0.0,
            "rate_mbit": rate, "relay": link.startswith("relay"), "relay_delay_ms": 0.0,
            "shaper": "tbf" if link.endswith("-tbf") else "ours",
            "link": link, "hops": "", "decoding": decoding, "k": k, "config": config,
            "streams": streams, "payload": payload, "tok_s": tok_s, "k_mean": k_mean,
            "error": ""}


LATENCY_ROWS = [
    row(0, "plain", 20.0), row(0, "lookup-k1", 19.0), row(0, "lookup-k3", 18.0),
    row(0, "lookup-auto", 19.5, k_mean=0.5), row(0, "plain", 21.0, streams=4),
    row(100, "plain", 2.0), row(100, "lookup-k1", 3.0), row(100, "lookup-k3", 4.0),
    row(100, "lookup-auto", 3.9, k_mean=3.2), row(100, "plain", 7.0, streams=4),
    row(100, "lookup-auto", 13.0, streams=4),
]


def test_best_fixed_k_per_latency_with_adaptive_ks_mean():
    best = best_fixed_k(LATENCY_ROWS)
    assert best["0"]["k"] == 1 and best["100"]["k"] == 3
    assert best["100"]["auto_k_mean"] == 3.2 and best["0"]["tok_s"] == 19.0


def test_best_over_plain_and_adaptive_k_over_best_fixed():
    assert best_over_plain(LATENCY_ROWS) == {"0": 1.05, "100": 6.5}
    assert auto_k_over_best_fixed(LATENCY_ROWS) == {"0": 1.026, "100": 0.975}


def test_lookup_over_plain_and_streams_over_one_pair_the_same_cluster():
    assert lookup_over_plain(LATENCY_ROWS) == {
        "lookup-k1 x1@0ms": 0.95, "lookup-k3 x1@0ms": 0.9, "lookup-auto x1@0ms": 0.975,
        "lookup-k1 x1@100ms": 1.5, "lookup-k3 x1@100ms": 2.0, "lookup-auto x1@100ms": 1.95,
        "lookup-auto x4@100ms": 1.857}
    assert streams_over_one(LATENCY_ROWS) == {
        "plain x4@0ms": 1.05, "plain x4@100ms": 3.5, "lookup-auto x4@100ms": 3.333}
    assert {"lookup_over_plain", "streams_over_one"} <= set(comparisons(LATENCY_ROWS))


def test_keys_name_stage_counts_when_several_were_run():
    rows = [row(100, "plain", 2.0), row(100, "plain", 4.0, streams=4),
            row(100, "plain", 1.5, stages=3), row(100, "plain", 3.0, streams=4, stages=3)]
    assert best_over_plain(rows) == {"100@2stages": 2.0, "100@3stages": 2.0}


def test_top1_over_full_per_link_pairs_the_same_configuration():
    rows = [row(20, "plain", 22.0, link="relay-20mbit"),
            row(20, "plain", 2.75, payload="logits", link="relay-20mbit"),
            row(20, "plain", 25.0, link="20mbit"),
            row(20, "plain", 5.0, payload="logits", link="20mbit"),
            row(20, "lookup-auto", 30.0, link="20mbit")]  # no logits twin: not paired
    assert top1_over_full(rows) == {"relay-20mbit": 8.0, "20mbit": 5.0}
    rows.append(row(20, "plain", 11.0, payload="topk", link="relay-20mbit"))
    assert payload_over_full(rows, "topk") == {"relay-20mbit": 4.0}


def test_failed_cells_are_left_out_of_the_ratios():
    rows = [row(0, "plain", 10.0), {**row(0, "plain", 0.0, streams=4), "tok_s": None,
                                    "error": "cluster: did not start"}]
    assert comparisons(rows)["best_over_plain"] == {"0": 1.0}


def test_the_csv_has_every_column_and_one_row_per_cell(tmp_path):
    write_csv(LATENCY_ROWS, tmp_path / "results.csv")
    with (tmp_path / "results.csv").open() as f:
        read = list(csv.DictReader(f))
    assert list(read[0]) == list(COLUMNS) and len(read) == len(LATENCY_ROWS)
    assert read[5]["tok_s"] == "2.0" and read[0]["cpu"] == ""


def test_every_figure_the_rows_can_fill_is_written(tmp_path):
    bandwidth = [row(10, "plain", t, payload=p, link=link) for t, p, link in [
        (20.0, "top1", "1mbit"), (0.5, "logits", "1mbit"), (22.0, "top1", "100mbit"),
        (15.0, "logits", "100mbit"), (18.0, "top1", "relay-1mbit"),
        (0.25, "logits", "relay-1mbit")]]
    jitter = [{**row(50, "plain", t), "jitter_ms": j} for t, j in [(5.0, 0.0), (4.0, 25.0)]]
    written = draw_all(LATENCY_ROWS + bandwidth + jitter, tmp_path, "test")
    assert {p.name for p in written} == {"throughput_vs_latency.png", "best_k_vs_latency.png",
                                         "payload_vs_bandwidth.png", "streams_vs_latency.png",
                                         "throughput_vs_jitter.png"}
    assert all(p.stat().st_size > 1000 for p in written)
    assert draw_all([row(0, "plain", 1.0)], tmp_path / "none", "one cell") == []


# -- the command line -------------------------------------------------------------------------


def _experiment(*args: str, cwd: Path = ROOT, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "tools.experiment", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_zctl_experiment_and_zctl_bench_experiment_check_a_scenario(tmp_path):
    path = str(ROOT / "tools" / "experiments" / "relay.toml")

    def zctl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "zctl", *args], cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                              text=True, timeout=60)

    for args in (["experiment", "check", path, "--json"],
                 ["bench", "experiment", "check", path, "--json"]):
        result = zctl(*args)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == {
            "scenario": "relay", "clusters": 4, "workloads": 8, "cells": 32,
            "measurements": 32, "tokens": 48, "stages": [2]}
    refused = zctl("experiment", "walk", path)
    assert refused.returncode == 2 and "run or check" in refused.stderr


@pytest.mark.slow
def test_the_command_refuses_a_bad_file_in_one_line_and_checks_a_good_one(tmp_path):
    bad = _experiment("run", str(scenario_of("[link]\ndelay_ms = 'x'", tmp_path)))
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "delay_ms must be a number" in bad.stderr
    good = _experiment("check", str(ROOT / "tools" / "experiments" / "latency.toml"), "--json")
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["cells"] == 84


@pytest.mark.slow
def test_a_small_scenario_runs_end_to_end_on_the_tiny_model(dp_export2, tmp_path):
    """Two latencies, a relayed last hop (so stage 1 is pinned to its node), plain and lookup
    decoding, 1 and 2 streams, each payload: every cell measured, the CSV
    and JSON written with the scenario's parameters, and the figures drawn."""
    scenario = scenario_of(f"""
name = "tiny"
[model]
exports = {{ 2 = "{dp_export2}" }}
[link]
delay_ms = [0, 5]
[[hop]]
index = 1
rate_mbit = 200
relay = true
[workload]
decoding = ["plain", "lookup"]
k = [0, 2]
streams = [1, 2]
payload = ["top1", "topk", "fp16", "logits"]
tokens = 6
prompts = ["one two three one two three one two", "a b c a b c a b"]
""", tmp_path)
    out = tmp_path / "out"
    proc = _experiment("run", str(scenario), "--out", str(out), "--json", cwd=tmp_path,
                       timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(COLUMNS) and len(rows) == 2 * (2 + 4) * 4
    assert all(r["error"] == "" and float(r["tok_s"]) > 0 for r in rows), rows
    assert {r["hops"] for r in rows} == {"0ms/unlimited|0ms/relay-200mbit",
                                         "5ms/unlimited|5ms/relay-200mbit"}
    assert {r["config"] for r in rows} == {"plain", "lookup-auto", "lookup-k2"}
    assert set(result["best_over_plain"]) == {"0", "5"}
    for ratio in ("top1_over_full", "topk_over_full", "fp16_over_full"):
        assert set(result[ratio]) == {"unlimited@0ms", "unlimited@5ms"}
    assert set(result["auto_k_over_best_fixed"]) == {"0", "5"}
    assert {Path(p).name for p in result["plots"]} >= {"throughput_vs_latency.png",
                                                       "streams_vs_latency.png"}
    assert all(Path(p).is_file() for p in result["plots"])
    assert json.loads((out / "results.json").read_text())["rows"][0]["scenario"] == "tiny"
