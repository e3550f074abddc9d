"""Local clusters of processes (zctl.launcher.local) without starting any: what is refused
before a process starts. (The clusters themselves: tests/e2e/test_local_clusters.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from zctl.launcher.local import start_local_node
from zctl.launcher.record import ClusterError, ClusterRecord, zctl_process


def test_node_zero_is_the_coordinator(tmp_path: Path) -> None:
    record = ClusterRecord("tcp://127.0.0.1:1", "", "", [])
    with pytest.raises(ClusterError, match="node 0 is the coordinator"):
        start_local_node(record, 0, tmp_path)
    assert not zctl_process(os.getpid())  # pytest is none of zctl's own processes


@pytest.mark.parametrize("owned", [False, True])
def test_a_spawned_process_names_its_command_and_is_tied_to_it_when_owned(
        owned: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What _spawn gives the process it starts (here ``true`` in its place): its parent is
    this process, an absolute state dir, and ends_with_parent only for an owned one
    (an embedded cluster's: cluster up's outlive their command)."""
    from zctl.launcher.local import _spawn
    from zctl.launcher.processes import NodeProcess, parse_process

    monkeypatch.chdir(tmp_path)
    started: list[list[str]] = []

    def instead(argv: list[str]) -> list[str]:
        started.append(argv)
        return ["true"]

    pid = _spawn(NodeProcess("tcp://127.0.0.1:9", state_dir="rel/node1"), tmp_path / "n.log",
                 instead, owned=owned)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0  # (tied: it ran all the same)
    config = parse_process(started[0][-2], started[0][-1])
    assert config.parent == os.getpid() and config.ends_with_parent is owned
    assert config.state_dir == str(tmp_path / "rel" / "node1")
