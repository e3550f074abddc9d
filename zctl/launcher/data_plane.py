"""A local cluster's data plane without its control plane: stage 0 in this process and
every other stage a stage-worker process (``python -m dataplane.worker``), for measuring and
testing the data plane alone."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from dataplane.runtime.config import RuntimeSpec
from zctl.launcher.local import free_port, log_tail, loopback_host
from zctl.launcher.record import ClusterError
from zctl.paths import zctl_home

if TYPE_CHECKING:
    from dataplane.head.cluster_head import ClusterHead


STATEFUL_WORKERS = ("a stage-worker process runs stateful stages: give a runtime without "
                    "paged attention")


def worker_command(export_dir: Path, stage: int, bind: str, send_to: str,
                   runtime: RuntimeSpec) -> list[str]:
    """The arguments after ``python`` of the stage-worker process entry
    (``python -m dataplane.worker``) serving ``stage`` with ``runtime`` (stateful KV)."""
    if runtime.paged_attention:
        raise ClusterError(STATEFUL_WORKERS)
    argv = ["-m", "dataplane.worker", str(export_dir), "--stage", str(stage), "--bind", bind,
            "--send-to", send_to, "--device", runtime.device,
            "--precision", runtime.precision or "default",
            "--kv-cache-precision", runtime.kv_cache_precision or "default"]
    if runtime.num_threads:
        argv += ["--threads", str(runtime.num_threads)]
    return argv + ([] if runtime.dynamic_quantization else ["--no-dynamic-quantization"])


@contextmanager
def local_data_plane(export_dir: Path, runtime: RuntimeSpec, root: Path | None = None, *,
                     timeout_s: float = 60.0) -> Iterator[ClusterHead]:
    """A local cluster's data plane without its control plane: stage 0 as the engine's
    executor in this process (a ClusterHead, waiting up to ``timeout_s`` for a reply) and
    every other stage a stage-worker process (``worker_command``) on its own loopback
    address (127.0.0.2, ...), chained in stage order, the last answering stage 0. For
    measuring and testing the data plane alone. The workers log to ``root/logs`` (default
    root: <zctl home>/local) and are stopped on exit. ClusterError for a one-stage export,
    or a worker that does not start."""
    from dataplane.head.cluster_head import ClusterHead
    from dataplane.runtime.load import load_runner
    from zctl.manifest import load_manifest

    stages = len(load_manifest(export_dir, verify_files=False).stages)
    if stages < 2:
        raise ClusterError("a one-stage export has no data plane to run: it runs in one process")
    if runtime.paged_attention:
        raise ClusterError(STATEFUL_WORKERS)
    binds = {i: f"tcp://{loopback_host(i)}:{free_port(loopback_host(i))}" for i in range(1, stages)}
    logs = (root or zctl_home() / "local") / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    head = ClusterHead(load_runner(export_dir, 0, runtime), binds[1],
                       "tcp://127.0.0.1:*", timeout_s=timeout_s)
    workers: list[subprocess.Popen] = []
    try:
        for i in reversed(binds):  # the last first: each sends to the next one's address
            command = worker_command(export_dir, i, binds[i], binds.get(i + 1, head.reply_endpoint),
                                     runtime)
            with open(logs / f"stage{i}.log", "ab") as log:
                workers.append(subprocess.Popen(
                    [sys.executable, *command], stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=log, text=True,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"}))
            ready = workers[-1].stdout.readline() if workers[-1].stdout else ""
            if not ready.startswith("ready "):
                raise ClusterError(f"the worker of stage {i} did not start:\n"
                                   f"{log_tail(str(logs / f'stage{i}.log'))}")
        yield head
    finally:
        head.close()
        for worker in workers:
            worker.terminate()
        for worker in workers:
            try:
                worker.wait(10)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
            if worker.stdout is not None:
                worker.stdout.close()
