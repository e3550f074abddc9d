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
