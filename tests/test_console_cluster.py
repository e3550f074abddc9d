"""zctl cluster up/status/down and zctl run --json, end to end with node processes on loopback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from console.cli import app
from dataplane.generate import LocalChain
from dataplane.runtime import RuntimeConfig
from dataplane.scheduler import generate_greedy
from dataplane.tokenizer import ChatTokenizer

runner = CliRunner()
PROMPT = "what is the capital of france?"


@pytest.fixture
def zctl_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _expected_tokens(export_dir: Path, n: int) -> list[int]:
    tokenizer = ChatTokenizer(export_dir)
    chain = LocalChain.load(str(export_dir), RuntimeConfig(precision="f32"))
    return list(generate_greedy(chain, tokenizer.encode(PROMPT), n))


def test_run_json_with_embedded_cluster(tiny_exports, zctl_home: Path) -> None:
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    result = runner.invoke(app, ["run", PROMPT, "--model", str(export_dir), "--max-tokens", "12",
                                 "--ignore-eos", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["tokens"] == 12
    assert report["ttft_ms"] > 0 and report["tok_s"] > 0 and report["notes"] == []
    assert [s["layers"] for s in report["stages"]] == ["0-1", "2-3"]
    assert all(s["compute_ms"]["p50"] > 0 for s in report["stages"])
    assert report["suggested_layers"] in (None, "0-0,1-3", "0-2,3-3")  # a re-export hint
    assert "127.0.0.2" in report["stages"][1]["node"]
    tokenizer = ChatTokenizer(export_dir)
    assert report["text"] == tokenizer.decode(_expected_tokens(export_dir, 12))
    assert not (zctl_home / "cluster.json").exists()  # the embedded cluster was torn down
    # a speculative run's embedded cluster is exact unless told otherwise: here a u8 cache
    fast = runner.invoke(app, ["run", PROMPT, "--model", str(export_dir), "--max-tokens", "4",
                               "--speculative", "lookup", "--kv-cache-precision", "u8", "--json"])
    assert fast.exit_code == 0, fast.output
    assert "fast numerics" in fast.output and "--exact" in fast.output  # told, not silent


def test_cluster_up_status_run_down(tiny_exports, zctl_home: Path) -> None:
    export_dir = tiny_exports.get([(0, 1), (1, 3), (3, 4)])
    up = runner.invoke(app, ["cluster", "up", "--local", "3", "--model", str(export_dir),
                              "--exact"])  # speculative runs below must equal greedy
    try:
        assert up.exit_code == 0, up.output
        again = runner.invoke(app, ["cluster", "up", "--local", "3", "--model", str(export_dir)])
        assert again.exit_code == 1 and "already up" in again.output
        status = runner.invoke(app, ["cluster", "status", "--json"])
        assert status.exit_code == 0, status.output
        info = json.loads(status.stdout)
        assert info["pipeline"] == "serving" and len(info["nodes"]) == 3
        hosts = sorted(n["host"] for n in info["nodes"])
        assert hosts == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
        assert {n["openvino"] for n in info["nodes"]} == {info["openvino"]}
        assert info["runtime"]["kv_cache_precision"] == "f32"  # --exact
        assert info["runtime"]["dynamic_quantization"] is False
        assert "exact numerics" in runner.invoke(app, ["cluster", "status"]).output
        run = runner.invoke(app, ["run", PROMPT, "--max-tokens", "8", "--ignore-eos", "--json"])
        assert run.exit_code == 0, run.output
        report = json.loads(run.stdout.strip().splitlines()[-1])
        assert len(report["stages"]) == 3 and report["tokens"] == 8
        # several concurrent streams, speculative: each equals greedy, figures per stream
        multi = runner.invoke(app, ["run", PROMPT, "--streams", "3", "--max-tokens", "8",
                                    "--ignore-eos", "--speculative", "lookup", "--k", "3", "--json"])
        assert multi.exit_code == 0, multi.output
        report = json.loads(multi.stdout.strip().splitlines()[-1])
        tokenizer = ChatTokenizer(export_dir)
        want = tokenizer.decode(_expected_tokens(export_dir, 8))
        assert [s["text"] for s in report["streams"]] == [want] * 3
        assert report["tokens"] == 24 and report["aggregate_tok_s"] > 0
        assert all(s["spec"]["steps"] >= 1 for s in report["streams"])
        for bad, why in ((["--k", "many"], "--k must be"), (["--speculative", "guess"], "lookup"),
                         (["--speculative", "draft:/nonexistent"], "not a directory"),
                         (["--temperature", "-1"], "temperature"), (["--top-p", "2"], "top_p")):
            refused = runner.invoke(app, ["run", PROMPT, "--json", *bad])
            assert refused.exit_code == 1 and why in refused.output, refused.output
    finally:
        down = runner.invoke(app, ["cluster", "down"])
    assert down.exit_code == 0 and "stopped 3" in down.output
    assert runner.invoke(app, ["cluster", "status"]).exit_code == 1


def test_status_without_cluster_is_a_clear_error(zctl_home: Path) -> None:
    result = runner.invoke(app, ["cluster", "status"])
    assert result.exit_code == 1 and "no cluster is up" in result.output
    result = runner.invoke(app, ["cluster", "status", "--endpoint", "tcp://127.0.0.1:1"])
    assert result.exit_code == 1 and "no answer" in result.output
    for flag in ("--resume-timeout", "--reassign-after"):
        result = runner.invoke(app, ["cluster", "up", "--local", "2", flag, "-1"])
        assert result.exit_code == 1 and "must be >= 0 seconds" in result.output
    assert not (zctl_home / "cluster.json").exists()


def test_curve_cluster_up_admits_its_own_nodes_and_refuses_strangers(tiny_exports,
                                                                     zctl_home: Path) -> None:
    import subprocess
    import sys
    import time

    from console.cluster_procs import read_record

    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    assert "no --curve cluster" in runner.invoke(app, ["cluster", "authorize", "x.key"]).output
    up = runner.invoke(app, ["cluster", "up", "--local", "2", "--model", str(export_dir),
                             "--curve"])
    stranger = None
    try:
        assert up.exit_code == 0, up.output
        status = json.loads(runner.invoke(app, ["cluster", "status", "--json"]).stdout)
        assert status["curve"] is True and status["pipeline"] == "serving"
        assert "CURVE" in runner.invoke(app, ["cluster", "status"]).output
        run = runner.invoke(app, ["run", PROMPT, "--max-tokens", "6", "--ignore-eos", "--json"])
        assert run.exit_code == 0, run.output
        report = json.loads(run.stdout.strip().splitlines()[-1])
        assert report["text"] == ChatTokenizer(export_dir).decode(_expected_tokens(export_dir, 6))
        # a node with the coordinator's key but not admitted stays out until authorized
        record = read_record()
        server_key = Path(record.curve_dir) / "curve" / "coordinator.key"
        state = zctl_home / "stranger"
        log = zctl_home / "stranger.log"
        with open(log, "w") as stderr:
            stranger = subprocess.Popen(
                [sys.executable, "-m", "controlplane", "node", "--coordinator", record.control,
                 "--host", "127.0.0.4", "--state-dir", str(state), "--curve-server-key",
                 str(server_key), "--reconnect-min", "0.2", "--heartbeat", "0.2"],
                stdout=subprocess.DEVNULL, stderr=stderr)
        node_key = state / "curve" / "node.key"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not node_key.is_file():
            time.sleep(0.1)
        # it tried: a whole liveness period went by without an answer and it reconnects
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "silent; reconnecting" not in log.read_text():
            time.sleep(0.1)
        assert "silent; reconnecting" in log.read_text(), log.read_text()[-2000:]
        hosts = lambda: {n["host"] for n in json.loads(  # noqa: E731
            runner.invoke(app, ["cluster", "status", "--json"]).stdout)["nodes"]}
        assert "127.0.0.4" not in hosts()
        admitted = runner.invoke(app, ["cluster", "authorize", str(node_key), "--name", "n4"])
        assert admitted.exit_code == 0 and "admitted" in admitted.output
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "127.0.0.4" not in hosts():
            time.sleep(0.3)
        assert "127.0.0.4" in hosts()
    finally:
        if stranger is not None:
            stranger.terminate()
            stranger.wait(10)
        runner.invoke(app, ["cluster", "down"])
