"""Profiles and links on a real local cluster (node processes on loopback): each process
measures its profile the first time it serves the model and keeps it for the next
cluster, the coordinator probes the pipeline's links both ways, ``cluster status`` shows
both and the running placement's speed predicted from them (``zctl run --json`` beside its
own), ``zctl plan --endpoint`` plans on them, and the cluster serves throughout."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zctl.cli.app import app

runner = CliRunner()


def _status() -> dict:
    result = runner.invoke(app, ["cluster", "status", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _wait(what: str, done, timeout_s: float = 180.0) -> dict:  # noqa: ANN001
    end = time.monotonic() + timeout_s
    while True:
        status = _status()
        if done(status):
            return status
        assert time.monotonic() < end, f"{what}: {json.dumps(status)[:2000]}"
        time.sleep(0.5)


def test_a_local_cluster_profiles_its_processes_and_probes_its_links(
        tiny_exports, tiny_llama_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    up = runner.invoke(app, ["cluster", "up", "--local", "2", "--model", str(export_dir),
                             "--profile", "--heartbeat", "0.3"])
    try:
        assert up.exit_code == 0, up.output
        # Placed by memory until both are profiled; then the planner, seeing two processes
        # share the cores, re-plans both stages onto one (no hop to pay) and re-wires.
        status = _wait("both processes profiled, both links measured, and the re-plan "
                       "they lead to serving", lambda s: (
            all(n["profile_state"] == "measured" for n in s["nodes"])
            and len([link for link in s["links"] if link["measured_at"]]) == 2
            and any(note.startswith("re-planned: ") for note in s["placement"].split("; "))
            and s["pipeline"] == "serving" and not s["prediction"]["error"]))
        assert len({s["node_id"] for s in status["stages"]}) == 1, status["stages"]
        shape = status["shape"]
        assert (shape["hidden"], shape["intermediate"]) == (64, 128)
        for node in status["nodes"]:
            profile = node["profile"]
            assert profile["weights"] == "fp32" and profile["device"] == "CPU"
            assert all(v > 0 for v in profile["decode_s"]) and profile["layer_bytes"] > 0
        ids = {node["node_id"] for node in status["nodes"]}
        for link in status["links"]:
            assert {link["a"], link["b"]} == ids and link["error"] == ""
            assert link["rtt_s"] > 0 and link["forward_bps"] > 0 and link["backward_bps"] > 0
        prediction = status["prediction"]  # the running placement, as the model of time sees it
        assert prediction["error"] == "" and prediction["tok_s"] > 0, prediction
        runs = [s["node_id"] for s in status["stages"]]  # a node's consecutive stages: one
        assert prediction["nodes"] == [n for i, n in enumerate(runs) if i == 0 or runs[i - 1] != n]
        assert [p["streams"] for p in prediction["streams"]] == list(range(1, 9))
        assert prediction["row_groups"] == 1  # a --local cluster sharing the cores: one group
        monkeypatch.setenv("COLUMNS", "250")
        table = runner.invoke(app, ["cluster", "status"])
        assert "ms/layer" in table.output and "links:" in table.output, table.output
        assert "predicted 1 stream" in " ".join(table.output.split())
        planned = runner.invoke(app, ["plan", str(tiny_llama_dir), "--endpoint",
                                      status["endpoint"], "--json"])
        assert planned.exit_code == 0, planned.output
        assert json.loads(planned.output)["fits"]["fp32"]["placements"]
        run = runner.invoke(app, ["run", "hello", "--max-tokens", "8", "--json"])
        assert run.exit_code == 0, run.output
        against = json.loads(run.output)["prediction"]
        assert against["streams"] == 1 and against["predicted_tok_s"] > 0, against
        assert against["relative_error"] == pytest.approx(
            against["predicted_tok_s"] / against["measured_tok_s"] - 1, abs=0.01)
        assert _status()["pipeline"] == "serving"
    finally:
        runner.invoke(app, ["cluster", "down"])
    up = runner.invoke(app, ["cluster", "up", "--local", "2", "--model", str(export_dir),
                             "--profile", "--heartbeat", "0.3"])
    try:  # the same state directories: each keeps its profile, nothing is measured again
        assert up.exit_code == 0, up.output
        _wait("both profiles kept", lambda s: all(n["profile_state"] == "kept"
                                                  for n in s["nodes"]), timeout_s=30)
    finally:
        runner.invoke(app, ["cluster", "down"])
