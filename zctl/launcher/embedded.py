"""An embedded cluster: the local cluster ``zctl run`` and ``zctl serve`` start for
themselves when no cluster is up, which lives exactly as long as the command.

``EmbeddedCluster`` owns that lifetime. Its processes are tied to this one
(``start_local_cluster(owned=True)``: the kernel and a watchdog in each end them if this
process dies, however it dies). It has a directory of its own under the zctl home
(``embedded/<pid>-<random>``: fresh node ids, ports, shard caches, and an identity its
coordinator checks, so no node of an earlier cluster can join it). Leaving it stops the
processes and removes the directory, but one that failed to start keeps its logs there for
the user to read. A directory that a killed command left behind is removed by the next
embedded cluster (``sweep``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Collection
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

from dataplane.runtime.config import RuntimeSpec
from zctl.launcher.lifetime import uninterrupted
from zctl.launcher.local import start_local_cluster, stop_processes, wait_serving
from zctl.launcher.orphans import LauncherProcess, running_processes, under
from zctl.launcher.record import ClusterError, ClusterRecord, alive
from zctl.paths import zctl_home

EMBEDDED = "embedded"  # under the zctl home: a directory per embedded cluster
LOGS = "logs"  # what a cluster that failed to start keeps
STOP_GRACE_S = 2.0  # it keeps nothing: a process still running this long after SIGTERM is killed


def embedded_dir() -> Path:
    """Where the embedded clusters of this zctl home keep their directories."""
    return zctl_home().absolute() / EMBEDDED


def owner_of(root: Path) -> int | None:
    """The pid of the command whose cluster directory ``root`` is (named '<pid>-...')."""
    pid, sep, _ = root.name.partition("-")
    return int(pid) if sep and pid.isdigit() else None


def stale(root: Path, processes: Collection[LauncherProcess]) -> bool:
    """Whether ``root`` is the directory of a cluster whose command was killed: that
    command is gone, none of ``processes`` (those running) is the cluster's, and it is not
    what a cluster that failed to start keeps (its logs alone)."""
    owner = owner_of(root)
    return (owner is not None and not alive(owner) and not under(processes, root.resolve())
            and {child.name for child in root.iterdir()} != {LOGS})


def sweep(base: Path, processes: Collection[LauncherProcess]) -> list[Path]:
    """Remove the stale cluster directories in ``base`` (``stale``); the ones removed."""
    removed = [root for root in sorted(base.iterdir()) if root.is_dir() and stale(root, processes)]
    for root in removed:
        shutil.rmtree(root, ignore_errors=True)
    return removed


class EmbeddedCluster:
    """A local cluster for this command's lifetime: entering starts ``nodes`` processes
    serving ``export_dir`` with ``runtime`` (and ``options``, as start_local_cluster takes
    them), waits up to ``timeout_s`` until it serves and gives its record; leaving, on any
    exit, stops them and removes their directory. ClusterError if it does not start (its
    processes stopped, its logs kept and named)."""

    def __init__(self, export_dir: Path, nodes: int, runtime: RuntimeSpec, *,
                 timeout_s: float = 300.0, **options: Any) -> None:
        self.export_dir, self.nodes, self.runtime = export_dir, nodes, runtime
        self.timeout_s, self.options = timeout_s, options
        self.root: Path | None = None
        self.record: ClusterRecord | None = None

    def __enter__(self) -> ClusterRecord:
        base = embedded_dir()
        base.mkdir(parents=True, exist_ok=True)
        sweep(base, running_processes())
        self.root = root = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=base))
        try:
            self.record = start_local_cluster(self.export_dir, self.nodes, self.runtime, root,
                                              owned=True, **self.options)
            wait_serving(self.record, self.timeout_s)
        except ClusterError as exc:
            uninterrupted(partial(self.stop, keep_logs=True))
            logs = root / LOGS
            kept = f"\n(its logs are kept in {logs})" if logs.is_dir() and str(logs) not in str(exc) else ""
            raise ClusterError(f"the embedded cluster did not start: {exc}{kept}") from None
        except BaseException:
            uninterrupted(self.stop)
            raise
        return self.record

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        uninterrupted(self.stop)

    def stop(self, keep_logs: bool = False) -> None:
        """Stop every process of the cluster (those its record names, and any other whose
        state is in its directory) and remove the directory, or all of it but its logs."""
        if self.root is None or not self.root.exists():
            return
        recorded = self.record.pids if self.record is not None else []
        found = [p.pid for p in under(running_processes(), self.root.resolve())]
        stop_processes(list(dict.fromkeys([*recorded, *found])), grace=STOP_GRACE_S)
        if not keep_logs:
            shutil.rmtree(self.root, ignore_errors=True)
            return
        for child in self.root.iterdir():
            if child.name != LOGS:
                shutil.rmtree(child, ignore_errors=True)
        if not any(self.root.iterdir()):
            self.root.rmdir()
