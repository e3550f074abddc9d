"""The experiment runner (tools.wan.runner): what a workload asks the service for, and a
run's logic with the launcher replaced (a failed measurement or cluster is a result)."""

from __future__ import annotations

import pytest

from tools.wan.runner import link_shape_of, request_fields, stream_prompts
from tools.wan.scenario import Link, Workload, parse_scenario


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
    from zctl.launcher.record import ClusterRecord

    started = []

    def start(export_dir, nodes, runtime, root, **options):
        started.append((nodes, options["links"]))
        return ClusterRecord("tcp://c", "tcp://s", str(export_dir), [])

    monkeypatch.setattr(procs, "start_local_cluster", start)
    monkeypatch.setattr(procs, "wait_serving", lambda record, timeout: None)
    monkeypatch.setattr(procs, "stop_processes", lambda pids: None)
    return started


def test_a_failed_measurement_is_a_result_and_the_others_still_run(no_cluster, monkeypatch,
                                                                   tmp_path):
    from dataplane.runtime.config import RuntimeSpec
    from tools.wan import runner

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
    from dataplane.runtime.config import RuntimeSpec
    from tools.wan import runner
    from zctl.launcher.record import ClusterError, ClusterRecord

    def start(export_dir, nodes, runtime, root, **options):
        if options["links"][0].delay_ms == 0:
            raise ClusterError("no room")
        return ClusterRecord("tcp://c", "tcp://s", str(export_dir), [])

    monkeypatch.setattr(procs, "start_local_cluster", start)
    monkeypatch.setattr(runner, "measure", lambda *args: {"tok_s": 5.0})
    scenario = parse_scenario({"link": {"delay_ms": [0, 50]}}, "t")
    rows = runner.run_scenario(scenario, {2: tmp_path}, runner.RunSettings(
        RuntimeSpec(), tmp_path), RECORD, Recorder())
    assert [(r["delay_ms"], r["tok_s"], r["error"]) for r in rows] == [
        (0.0, None, "cluster: no room"), (50.0, 5.0, "")]
