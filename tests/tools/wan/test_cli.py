"""The experiment's command (tools.wan.cli): ``python -m tools.wan`` and ``zctl experiment``
check a scenario, refuse a bad file in one line, and run a small scenario end to end on
the tiny model."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.repo import ROOT
from tests.tools.wan.test_scenario import scenario_of
from tools.wan.analysis import COLUMNS


def _experiment(*args: str, cwd: Path = ROOT, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "tools.wan", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.e2e
def test_zctl_experiment_and_zctl_bench_experiment_check_a_scenario(tmp_path):
    path = str(ROOT / "tools" / "wan" / "scenarios" / "relay.toml")

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


@pytest.mark.e2e
def test_the_command_refuses_a_bad_file_in_one_line_and_checks_a_good_one(tmp_path):
    bad = _experiment("run", str(scenario_of("[link]\ndelay_ms = 'x'", tmp_path)))
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "delay_ms must be a number" in bad.stderr
    good = _experiment("check", str(ROOT / "tools" / "wan" / "scenarios" / "latency.toml"), "--json")
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["cells"] == 84


@pytest.mark.e2e
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
