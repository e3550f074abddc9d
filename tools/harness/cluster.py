"""Local clusters for the benchmarks, started by the product's launcher
(``zctl.launcher.local``) and stopped on every exit: a cluster serving through its
generation service (``local_cluster``), and one with ``zctl serve`` in front of it under a
zctl home of its own (``served_cluster``: one run at a time holds the home, a cluster an
interrupted run left behind is stopped first, SIGTERM tears it down as Ctrl-C does).
"""

from __future__ import annotations

import fcntl
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tools.harness.report import err

if TYPE_CHECKING:
    from dataplane.runtime.config import RuntimeSpec
    from zctl.launcher.record import ClusterRecord

LOCK_FILE = "bench.lock"
# what a benchmark cluster's node profile may take: a slowed node (a quarter of a core) or
# a loaded machine overruns the product's default 30 s, and a benchmark times the plan,
# not the profile
PROFILE_BUDGET_S = 120.0


@contextmanager
def local_cluster(export_dir: Path, nodes: int, runtime: RuntimeSpec, root: Path, *,
                  timeout_s: float = 300.0, **options: Any) -> Iterator[ClusterRecord]:
    """A local cluster of ``export_dir`` (``start_local_cluster``'s ``options``), its state
    and logs under ``root``, once it serves (``timeout_s``); every process stopped on exit."""
    from zctl.launcher.local import start_local_cluster, stop_processes, wait_serving

    record = start_local_cluster(export_dir, nodes, runtime, root, **options)
    try:
        wait_serving(record, timeout_s)
        yield record
    finally:
        stop_processes(record.pids)


@contextmanager
def zctl_home_at(path: Path) -> Iterator[None]:
    """ZCTL_HOME set to ``path`` meanwhile (where ``zctl serve`` finds the cluster)."""
    before = os.environ.get("ZCTL_HOME")
    os.environ["ZCTL_HOME"] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("ZCTL_HOME", None)
        else:
            os.environ["ZCTL_HOME"] = before


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt meanwhile, so a teardown runs for it too."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_left_behind() -> None:
    """Stop the cluster the zctl home's cluster.json names (one an interrupted run left),
    the processes that are still zctl's own, and remove the file."""
    from zctl.launcher.local import stop_processes
    from zctl.launcher.record import alive, cluster_file, read_record, zctl_process

    record = read_record()
    if record is not None:
        stop_processes([pid for pid in record.pids if alive(pid) and zctl_process(pid)])
    cluster_file().unlink(missing_ok=True)


@contextmanager
def served_cluster(export_dir: Path, nodes: int, runtime: RuntimeSpec, home: Path, *,
                   port: int = 0, api_key: str | None = None, max_queue: int | None = None,
                   timeout_s: float = 300.0, **options: Any) -> Iterator[ClusterRecord]:
    """A local cluster of ``export_dir`` (``start_local_cluster``'s ``options``) and
    ``zctl serve`` in front of it on 127.0.0.1:``port`` (0: a free port), as ``zctl cluster
    up --local N --api`` starts them, under ZCTL_HOME=``home`` (its cluster.json there, the
    processes' state and logs in ``home/local``); the record, with the API's address.
    ``api_key``: the key the API requires (None: none, whatever ZCTL_API_KEY says);
    ``max_queue``: its --max-queue (None: its default). Everything is stopped on exit, an
    exception, Ctrl-C or SIGTERM. RuntimeError if another run holds ``home``."""
    from zctl.launcher.api import start_api
    from zctl.launcher.local import free_port, start_local_cluster, stop_processes, wait_serving
    from zctl.launcher.record import cluster_file, write_record

    home.mkdir(parents=True, exist_ok=True)
    with open(home / LOCK_FILE, "w") as lock, sigterm_as_interrupt(), zctl_home_at(home):
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another benchmark run holds {home}") from None
        stop_left_behind()
        err.print(f"starting a {nodes}-node local cluster and zctl serve under {home} ...")
        record = start_local_cluster(export_dir, nodes, runtime, home / "local", **options)
        try:
            write_record(record)
            wait_serving(record, timeout_s)
            record = start_api(record, f"127.0.0.1:{port or free_port('127.0.0.1')}", timeout_s,
                               max_queue=max_queue, api_key=api_key or "")
            write_record(record)
            err.print(f"zctl serve is up at {record.api}")
            yield record
        finally:
            stop_processes(record.pids)
            cluster_file().unlink(missing_ok=True)


@contextmanager
def exit_on_failure() -> Iterator[None]:
    """Around a benchmark's served run: a RuntimeError (or a cluster that would not start)
    is printed and exits 1, an interrupt (after the teardown) exits 130."""
    import typer


    try:
        yield
    except RuntimeError as exc:  # a ClusterError too
        err.print(f"[bold red]error:[/] {exc}", highlight=False)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        err.print("interrupted: the cluster and the server are stopped")
        raise typer.Exit(130) from None
