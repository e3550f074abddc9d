"""Local clusters of processes (zctl.launcher.local): the data plane alone (stage 0 here,
stage workers on 127.0.0.x) generates what one process does; a node started again after
it was lost rejoins; the OpenAI API takes the key it is given; a node with a bad link or a
coordinator that cannot start fails at once; split CPU sets give each node its own cores;
the service's stats show every stage, node and hop of a cluster while it generates."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from dataplane.runtime.config import RuntimeSpec
from zctl.cli.app import app
from zctl.launcher.api import start_api
from zctl.launcher.cpusets import format_cpu_list, split_cpus
from zctl.launcher.data_plane import local_data_plane
from zctl.launcher.local import free_port, start_local_cluster, start_local_node, stop_processes, wait_serving
from zctl.launcher.processes import LinkShape, NodeProcess, process_command, runtime_spec
from zctl.launcher.record import ClusterError, ClusterRecord, alive, write_record, zctl_process

EXACT = runtime_spec("f32", None, "CPU", "f32", dynamic_quantization=False)
runner = CliRunner()


# -- the data plane alone, nodes, the API ---------------------------------------------------

def _generate(serve: str, tokens: int = 6) -> list[int]:
    from zctl.engine.requests import GenerationDone, GenerationRequest
    from zctl.service.client import generate_stream

    request = GenerationRequest(uuid.uuid4().hex[:16], "the sky is", tokens, ignore_eos=True,
                                temperature=0.0)
    done = [m for m in generate_stream(serve, request) if isinstance(m, GenerationDone)][-1]
    assert not done.error, done.error
    return list(done.tokens)


def _until_not_serving(record: ClusterRecord, timeout_s: float = 60.0) -> None:
    """Wait until the coordinator has seen the pipeline break."""
    import time

    from controlplane.client import query_status

    deadline = time.monotonic() + timeout_s
    while query_status(record.control, timeout=5.0).pipeline == "serving":
        assert time.monotonic() < deadline, "the coordinator never saw the node go"
        time.sleep(0.2)


def test_the_data_plane_alone_generates_what_one_process_does(tiny_exports,
                                                               tmp_path: Path) -> None:
    from dataplane.head.local_chain import LocalChain
    from dataplane.runtime.config import RuntimeSpec
    from tests.zctl.launcher.test_data_plane import STATEFUL
    from zctl.engine.scheduler import generate_greedy

    export_dir = tiny_exports.get([(0, 1), (1, 3), (3, 4)])
    prompt = [int(t) for t in np.random.default_rng(3).integers(5, 200, 12)]
    local = list(generate_greedy(LocalChain.load(str(export_dir), RuntimeSpec(
        precision="f32", kv_cache_precision="f32", dynamic_quantization=False)), prompt, 10))
    with local_data_plane(export_dir, STATEFUL, tmp_path) as head:
        assert head.num_stages == 3
        assert list(generate_greedy(head, prompt, 10)) == local
        assert head.timing_summary()["stage2.compute"]["p50"] > 0  # every stage's figures
        logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["stage1.log", "stage2.log"]


def test_the_data_plane_with_the_default_runtime_equals_the_local_chain(tiny_exports, dp_hosts,
                                                                        tmp_path: Path) -> None:
    from dataplane.head.local_chain import LocalChain
    from dataplane.runtime.config import RuntimeSpec
    from zctl.engine.scheduler import generate_greedy

    export = tiny_exports.get([(0, 2), (2, 4)])
    local = LocalChain.load(str(export), RuntimeSpec())
    with local_data_plane(export, RuntimeSpec(), tmp_path) as pipe:
        got = list(generate_greedy(pipe, [0, 17, 42], 8))
        assert pipe.stats.errors == 0
    assert got == list(generate_greedy(local, [0, 17, 42], 8)) and len(got) == 8


def test_a_lost_node_started_again_rejoins_and_the_cluster_serves(tiny_exports,
                                                                   tmp_path: Path) -> None:
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    record = start_local_cluster(export_dir, 2, EXACT, tmp_path, heal_after=None)
    try:
        wait_serving(record, 120)
        assert all(zctl_process(pid) for pid in record.pids)
        before = _generate(record.serve)
        os.killpg(record.pids[1], signal.SIGKILL)
        os.waitpid(record.pids[1], 0)
        _until_not_serving(record)
        pid, log = start_local_node(record, 1, tmp_path)
        record.pids.append(pid)
        assert log == str(tmp_path / "logs" / "node1.log") and alive(pid)
        wait_serving(record, 120)
        assert _generate(record.serve) == before
    finally:
        stop_processes(record.pids)
    assert not any(alive(pid) for pid in record.pids)


def test_the_api_requires_the_key_it_is_given(tiny_exports, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))  # where zctl serve finds it
    monkeypatch.setenv("ZCTL_API_KEY", "from-the-shell")
    record = start_local_cluster(tiny_exports.get([(0, 2), (2, 4)]), 2, EXACT, tmp_path)
    try:
        wait_serving(record, 120)
        write_record(record)
        keyed = start_api(record, f"127.0.0.1:{free_port('127.0.0.1')}", api_key="sesame")
        record.pids = keyed.pids
        assert zctl_process(keyed.pids[-1])
        assert "sesame" not in Path(f"/proc/{keyed.pids[-1]}/cmdline").read_text()
        models = f"{keyed.api}/v1/models"
        assert httpx.get(models, timeout=10).status_code == 401
        assert httpx.get(models, timeout=10, headers={
            "Authorization": "Bearer from-the-shell"}).status_code == 401
        assert httpx.get(models, timeout=10, headers={
            "Authorization": "Bearer sesame"}).status_code == 200
        open_api = start_api(record, f"127.0.0.1:{free_port('127.0.0.1')}", api_key="")
        record.pids = open_api.pids
        assert httpx.get(f"{open_api.api}/v1/models", timeout=10).status_code == 200
        shell = start_api(record, f"127.0.0.1:{free_port('127.0.0.1')}")
        record.pids = shell.pids
        assert httpx.get(f"{shell.api}/v1/models", timeout=10).status_code == 401
    finally:
        stop_processes(record.pids)


# -- processes that cannot start -----------------------------------------------------------

def test_a_bad_link_fails_before_the_node_starts() -> None:
    argv = process_command(NodeProcess("tcp://127.0.0.1:9", link=LinkShape(delay_ms=-5)))
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "bad emulated link" in done.stderr


def test_a_coordinator_that_cannot_start_fails_the_cluster_start_at_once(tmp_path) -> None:
    """Its process exits (and lingers unreaped): wait_serving says so with the log's reason
    instead of waiting out its timeout."""
    record = start_local_cluster(tmp_path / "no-export", 2, RuntimeSpec(), tmp_path / "c")
    try:
        with pytest.raises(ClusterError, match="exited during start-up") as failed:
            wait_serving(record, 120)
        assert "no-export" in str(failed.value)  # the coordinator's own error line
        assert not alive(record.pids[0])
    finally:
        stop_processes(record.pids)


# -- CPU sets --------------------------------------------------------------------------------

def _allowed(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError("no Cpus_allowed_list")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_split_local_cluster_gives_each_node_its_own_cores(tiny_exports, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    too_many = len(os.sched_getaffinity(0)) + 1
    refused = runner.invoke(app, ["cluster", "up", "--local", str(too_many), "--model",
                                  str(export_dir), "--cpu-sets", "split"])
    assert refused.exit_code == 1 and f"at least {too_many} CPUs" in refused.output
    assert not (tmp_path / "home" / "cluster.json").exists()
    not_local = runner.invoke(app, ["cluster", "up", "--cpu-sets", "split"])
    assert not_local.exit_code == 1 and "--local" in not_local.output
    up = runner.invoke(app, ["cluster", "up", "--local", "2", "--model", str(export_dir),
                             "--cpu-sets", "split"])
    try:
        assert up.exit_code == 0, up.output
        record = json.loads((tmp_path / "home" / "cluster.json").read_text())
        want = [format_cpu_list(s) for s in split_cpus(sorted(os.sched_getaffinity(0)), 2)]
        assert [_allowed(pid) for pid in record["pids"]] == want
        run = runner.invoke(app, ["run", "hello", "--max-tokens", "4", "--ignore-eos", "--json"])
        assert run.exit_code == 0, run.output
        assert json.loads(run.stdout.strip().splitlines()[-1])["tokens"] == 4
    finally:
        assert runner.invoke(app, ["cluster", "down"]).exit_code == 0


# -- the service's stats -----------------------------------------------------------------------

def test_stats_of_a_local_cluster_of_processes(tiny_exports, tmp_path: Path) -> None:
    """Three processes: every stage's node and KV slots (stage 2's from its heartbeats),
    every hop's network time and bytes, while a generation runs and after it."""
    import threading

    from tests.helpers.control import wait_for
    from tests.zctl.service.test_stats import PROMPT
    from zctl.engine.requests import GenerationDone, GenerationRequest
    from zctl.service.client import generate_many, query_service_stats
    from zctl.service.stats import COORDINATOR

    export_dir = tiny_exports.get([(0, 1), (1, 3), (3, 4)])
    record = start_local_cluster(export_dir, 3, runtime_spec("f32", None, "CPU", "f32"),
                                 tmp_path / "cluster", link_delay_ms=5)
    try:
        wait_serving(record, 120)
        dones: list[Any] = []
        request = GenerationRequest("long", PROMPT, 300, ignore_eos=True, speculative="lookup",
                                    temperature=0.0)
        client = threading.Thread(target=lambda: dones.extend(
            msg for msg in generate_many(record.serve, [request])
            if isinstance(msg, GenerationDone)), daemon=True)
        client.start()
        # mid-generation, the last stage's node has reported the slots it holds
        wait_for(lambda: query_service_stats(record.serve).stages[2].kv_slots > 0, 30,
                 "a heartbeat with KV slots")
        running = query_service_stats(record.serve)
        assert running.running == 1 and running.health == "" and running.stages[0].kv_slots > 0
        client.join(120)
        assert len(dones) == 1 and not dones[0].error
        stats = query_service_stats(record.serve)
    finally:
        stop_processes(record.pids)
    assert [s.node_id == COORDINATOR for s in stats.stages] == [True, False, False]
    assert all(s.up for s in stats.stages) and len(stats.nodes) == 3 and all(stats.nodes.values())
    assert {s.node_id for s in stats.stages[1:]} == set(stats.nodes) - {COORDINATOR}
    steps = sum(stats.stages[0].compute_ms.counts)
    assert steps > 0 and [sum(s.compute_ms.counts) for s in stats.stages] == [steps] * 3
    assert [h.name for h in stats.hops] == ["0-1", "1-2", "2-c"]
    for hop in stats.hops:  # each hop is delayed 5 ms: its network time shows it
        assert sum(hop.network_ms.counts) == steps and hop.network_ms.total >= 4.0 * steps
        assert hop.bytes > 0
    assert stats.counters["requests"] == 1 and stats.counters["spec_drafted"] > 0
    assert stats.stages[0].kv_slots == 0  # the finished stream was closed
