"""tools.harness.cluster: one run at a time holds a served cluster's home, a cluster.json an
interrupted run left is cleared without touching processes that are not zctl's, and
SIGTERM becomes an interrupt meanwhile. (A served cluster's whole life runs in
tests/tools/serving/test_serve.py and tests/tools/robustness/test_soak.py.)"""

from __future__ import annotations

import fcntl
import os
import signal
from pathlib import Path

import pytest

from dataplane.runtime.config import RuntimeSpec
from tools.harness.cluster import (
    LOCK_FILE,
    served_cluster,
    sigterm_as_interrupt,
    stop_left_behind,
    zctl_home_at,
)
from zctl.launcher.record import ClusterRecord, alive, cluster_file, write_record


def test_a_home_another_run_holds_is_refused_before_anything_starts(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    with open(home / LOCK_FILE, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(RuntimeError, match="another benchmark run holds"), \
                served_cluster(tmp_path / "no-export", 2, RuntimeSpec(), home):
            pass
    assert not (home / "cluster.json").exists()


def test_a_cluster_left_behind_is_cleared_but_no_other_process_is_touched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path))
    write_record(ClusterRecord("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "x", [os.getpid()]))
    stop_left_behind()
    assert not cluster_file().exists() and alive(os.getpid())
    stop_left_behind()  # nothing left: nothing to do


def test_the_home_and_sigterm_are_set_meanwhile_and_restored(tmp_path: Path,
                                                             monkeypatch) -> None:
    monkeypatch.setenv("ZCTL_HOME", "/elsewhere")
    handler = signal.getsignal(signal.SIGTERM)
    with zctl_home_at(tmp_path), sigterm_as_interrupt():
        assert os.environ["ZCTL_HOME"] == str(tmp_path)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    assert os.environ["ZCTL_HOME"] == "/elsewhere" and signal.getsignal(signal.SIGTERM) is handler
    monkeypatch.delenv("ZCTL_HOME")
    with zctl_home_at(tmp_path):
        pass
    assert "ZCTL_HOME" not in os.environ
