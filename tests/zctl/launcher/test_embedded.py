"""An embedded cluster's directory and lifetime (zctl.launcher.embedded) without starting
any process: whose directory is whose, which are stale, and a cluster that cannot start
leaves nothing behind. (Embedded clusters of processes: tests/e2e/test_embedded_clusters.py.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dataplane.runtime.config import RuntimeSpec
from zctl.launcher.embedded import EmbeddedCluster, embedded_dir, owner_of, stale, sweep
from zctl.launcher.orphans import LauncherProcess
from zctl.launcher.record import ClusterError


def _gone_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_a_directory_names_the_command_it_belongs_to() -> None:
    assert owner_of(Path("/h/embedded/4242-k2j3h4")) == 4242
    assert owner_of(Path("/h/embedded/logs")) is None
    assert owner_of(Path("/h/embedded/x-1")) is None


def _cluster_dir(base: Path, name: str, *children: str) -> Path:
    root = base / name
    root.mkdir(parents=True)
    for child in children:
        (root / child).mkdir()
    return root


def test_stale_directories_are_those_of_killed_commands(tmp_path: Path) -> None:
    gone = _gone_pid()
    killed = _cluster_dir(tmp_path, f"{gone}-a", "coordinator", "node1", "logs")
    failed = _cluster_dir(tmp_path, f"{gone}-b", "logs")  # a failed start: its logs are kept
    mine = _cluster_dir(tmp_path, f"{os.getpid()}-c", "coordinator", "logs")  # its command runs
    busy = _cluster_dir(tmp_path, f"{gone}-d", "coordinator", "node1")
    empty = _cluster_dir(tmp_path, f"{gone}-e")  # killed before its cluster started
    still = [LauncherProcess(9, 1, "node", str(busy.resolve() / "node1"), gone)]
    (tmp_path / "notes.txt").write_text("not a cluster's")
    assert stale(killed, still) and not stale(failed, still) and not stale(mine, still)
    assert not stale(busy, still)  # a process of it still runs (it ends within seconds)
    assert sweep(tmp_path, still) == [killed, empty]
    assert not killed.exists() and not empty.exists()
    assert failed.exists() and mine.exists() and busy.exists()
    assert sweep(tmp_path, []) == [busy]


def test_a_cluster_that_cannot_start_leaves_nothing_behind(zctl_home: Path) -> None:
    cluster = EmbeddedCluster(Path("/no/export"), 2, ["not", "a", "runtime"])  # type: ignore[arg-type]
    with pytest.raises(ClusterError, match="the embedded cluster did not start: .*RuntimeSpec"):
        with cluster:
            pass
    assert cluster.root is not None and not cluster.root.exists()
    assert list(embedded_dir().iterdir()) == []


def test_each_embedded_cluster_has_a_directory_of_its_own(zctl_home: Path) -> None:
    roots = []
    for _ in range(2):
        cluster = EmbeddedCluster(Path("/no/export"), 2, RuntimeSpec(), link_delay_ms=-1)
        with pytest.raises(ClusterError, match="bad link shape"):
            cluster.__enter__()
        roots.append(cluster.root)
    assert roots[0] != roots[1] and all(r.parent == embedded_dir() for r in roots)
    assert all(owner_of(r) == os.getpid() and not r.exists() for r in roots)


def test_a_cluster_that_failed_to_start_keeps_its_logs_and_says_where(
        zctl_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its processes had started (their state and logs in its directory) when it failed:
    the state goes, the logs stay (named in the error), and no later sweep takes them."""
    import zctl.launcher.embedded as embedded

    def started_then_failed(export_dir: Path, nodes: int, runtime: RuntimeSpec, root: Path,
                            **options: object) -> None:
        assert options == {"owned": True, "cpu_sets": "split"}
        for part in ("coordinator", "node1", "logs"):
            (root / part).mkdir()
        (root / "logs" / "coordinator.log").write_text("error: no such device\n")
        raise ClusterError("the coordinator exited during start-up:\nerror: no such device")

    monkeypatch.setattr(embedded, "start_local_cluster", started_then_failed)
    cluster = EmbeddedCluster(Path("/x"), 2, RuntimeSpec(), cpu_sets="split")
    with pytest.raises(ClusterError) as failed:
        cluster.__enter__()
    assert cluster.root is not None
    logs = cluster.root / "logs"
    assert str(failed.value).startswith("the embedded cluster did not start: the coordinator")
    assert str(failed.value).endswith(f"(its logs are kept in {logs})")
    assert sorted(p.name for p in cluster.root.iterdir()) == ["logs"]
    assert (logs / "coordinator.log").read_text() == "error: no such device\n"
    after_exit = cluster.root.rename(embedded_dir() / f"{_gone_pid()}-kept")  # (its command gone)
    assert sweep(embedded_dir(), []) == [] and (after_exit / "logs").is_dir()
