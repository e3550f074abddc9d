"""Local clusters of processes (zctl.launcher.local) without starting any: what is refused
before a process starts, and why a starting cluster will not serve. (The clusters
themselves: tests/e2e/test_local_clusters.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from controlplane.records import ClusterStatus, NodeStatus, RefusalInfo
from zctl.launcher.local import free_port, start_failure, start_local_node
from zctl.launcher.record import ClusterError, ClusterRecord, zctl_process


def test_node_zero_is_the_coordinator(tmp_path: Path) -> None:
    record = ClusterRecord("tcp://127.0.0.1:1", "", "", [])
    with pytest.raises(ClusterError, match="node 0 is the coordinator"):
        start_local_node(record, 0, tmp_path)
    assert not zctl_process(os.getpid())  # pytest is none of zctl's own processes


def test_a_local_cluster_has_at_least_the_coordinator(tmp_path: Path) -> None:
    from dataplane.runtime.config import RuntimeSpec
    from zctl.launcher.local import start_local_cluster

    with pytest.raises(ClusterError, match="at least 1 node"):
        start_local_cluster(tmp_path, 0, RuntimeSpec(), tmp_path)
    with pytest.raises(ClusterError, match="memory to lend must be >= 0"):
        start_local_cluster(tmp_path, 1, RuntimeSpec(), tmp_path, memory_mb=-1)
    with pytest.raises(ClusterError, match="budget must be >= 0"):
        start_local_cluster(tmp_path, 1, RuntimeSpec(), tmp_path, profile_budget_s=-1)
    with pytest.raises(ClusterError, match="3 processes need 3 CPU lists, not 2"):
        start_local_cluster(tmp_path, 3, RuntimeSpec(), tmp_path, cpus=["0", "1"])
    with pytest.raises(ClusterError, match="bad CPU list 'x'"):
        start_local_cluster(tmp_path, 2, RuntimeSpec(), tmp_path, cpus=["0", "x"])
    assert not (tmp_path / "logs").exists()  # refused before anything started


def test_a_free_port_is_none_already_given_to_the_process(monkeypatch) -> None:
    import zctl.launcher.local as local

    picks = iter([20001, 20001, 20002])
    monkeypatch.setattr(local, "fresh_port", lambda host: next(picks))
    assert free_port("127.0.0.1", {20001}) == 20002
    monkeypatch.setattr(local, "fresh_port", lambda host: 20001)
    with pytest.raises(ClusterError, match="no free port on 127.0.0.1 besides"):
        free_port("127.0.0.1", {20001})


def _status(pipeline: str, plan_error: str = "", nodes=(), refused=()) -> ClusterStatus:
    return ClusterStatus("c0", "s", "tcp://127.0.0.1:1", 5, "2025.3", "0", "/e", "m", pipeline,
                         1, 1.0, plan_error, list(nodes), [], list(refused), {})


def _node(node_id: str, state: str, stage: int | None, error: str = "",
          local: bool = False) -> NodeStatus:
    return NodeStatus(node_id, "127.0.0.2", state, stage, "tcp://127.0.0.2:1", 0.0, [], 0, 0,
                      "2025.3", "0", 0, error=error, local=local)


def test_why_a_starting_cluster_will_not_serve() -> None:
    assert start_failure(_status("wiring", nodes=[_node("c0", "wiring", 0, local=True)])) is None
    assert start_failure(_status("waiting")) is None  # nodes may yet enrol
    failed = _status("failed", nodes=[_node("c0", "failed", 0, "LaunchError: cannot load "
                                            "stage 0: bad IR", local=True),
                                      _node("n1", "serving", 1)])
    assert start_failure(failed) == ("stage 0 on this machine failed to start: LaunchError: "
                                     "cannot load stage 0: bad IR")
    remote = _status("failed", nodes=[_node("n1", "failed", 1)])
    assert start_failure(remote) == "stage 1 on node n1 failed to start: no reason given"
    unplaced = _status("waiting", plan_error="stage 0 needs about 9.0 GiB but ...")
    assert start_failure(unplaced) == ("the stages cannot be placed: stage 0 needs about "
                                       "9.0 GiB but ...")
    refused = _status("waiting", refused=[RefusalInfo("n1", "127.0.0.2", "OpenVINO 2024.1 is "
                                                      "not the coordinator's 2025.3", 0.1)])
    assert start_failure(refused) == ("node n1 at 127.0.0.2 was refused: OpenVINO 2024.1 is "
                                      "not the coordinator's 2025.3")


@pytest.mark.parametrize("owned", [False, True])
def test_a_spawned_process_names_its_command_and_is_tied_to_it_when_owned(
        owned: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What _spawn gives the process it starts (here ``echo`` in its place): its parent is
    this process, an absolute state dir, and ends_with_parent only for an owned one
    (an embedded cluster's: cluster up's outlive their command)."""
    import time

    from zctl.launcher.local import _spawn
    from zctl.launcher.processes import NodeProcess, parse_process
    from zctl.launcher.record import alive

    monkeypatch.chdir(tmp_path)
    started: list[list[str]] = []

    def instead(argv: list[str]) -> list[str]:
        started.append(argv)
        return ["echo", "ran"]

    log = tmp_path / "n.log"
    pid = _spawn(NodeProcess("tcp://127.0.0.1:9", state_dir="rel/node1"), log, instead,
                 owned=owned)
    # (it is not waited for here: any later Popen may reap a child whose Popen is gone)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(pid) and log.read_text() == "ran\n"  # tied, it ran all the same
    config = parse_process(started[0][-2], started[0][-1])
    assert config.parent == os.getpid() and config.ends_with_parent is owned
    assert config.state_dir == str(tmp_path / "rel" / "node1")


@pytest.mark.slow  # starts processes
def test_stopped_processes_are_gone_even_those_that_ignore_sigterm() -> None:
    import subprocess
    import sys

    from zctl.launcher.local import stop_processes
    from zctl.launcher.record import alive

    code = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)")
    stubborn = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                start_new_session=True)
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              start_new_session=True)
    assert stubborn.stdout is not None and stubborn.stdout.readline() == b"ready\n"
    pids = [polite.pid, stubborn.pid]
    stop_processes(pids, grace=0.5)
    assert not any(alive(pid) for pid in pids)  # SIGKILLed and waited for, not merely sent
    for process in (polite, stubborn):  # reaped by stop_processes: the objects learn it
        process.wait(timeout=5)
    stubborn.stdout.close()
