"""Background cluster processes for ``zctl cluster up/down`` and the embedded cluster of ``zctl run``.

A local cluster is one coordinator process (stage 0, on 127.0.0.1) and N-1 node
processes, each on its own loopback address (127.0.0.2, 127.0.0.3, ...), started in
their own sessions so they outlive the command. ``cluster.json`` in the zctl home
records where they listen and their pids, so ``down`` and ``run`` can find them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from common.paths import zctl_home

CLUSTER_FILE = "cluster.json"


class ClusterError(RuntimeError):
    """The cluster could not be started, found, or stopped; the text says why."""


@dataclass
class ClusterRecord:
    control: str  # the coordinator's ROUTER, for nodes and status
    serve: str  # the generation service, for zctl run
    export_dir: str
    pids: list[int]
    logs: list[str] = field(default_factory=list)
    local_nodes: int = 0
    started: float = 0.0
    curve_dir: str = ""  # the coordinator's state dir when CURVE is on (its key pair)


def control_curve(record: ClusterRecord | None) -> Any:
    """The CURVE client a console command talks to the coordinator with: the coordinator's
    own key pair (it admits itself), or None for a plain-text cluster."""
    if record is None or not record.curve_dir:
        return None
    from controlplane.security import CurveClient, key_dir, load_or_create_keypair

    public, secret = load_or_create_keypair(key_dir(Path(record.curve_dir)), "coordinator")
    return CurveClient(public, public, secret)


def prepare_local_curve(coordinator_state: Path, node_states: list[Path]) -> Path:
    """Key pairs for a local CURVE cluster: the coordinator's, and every node's admitted
    to it. Returns the coordinator's public key file (what nodes are given)."""
    from controlplane.security import authorize, key_dir, load_or_create_keypair

    load_or_create_keypair(key_dir(coordinator_state), "coordinator")
    for i, state in enumerate(node_states, start=1):
        load_or_create_keypair(key_dir(state), "node")
        authorize(coordinator_state / "authorized", f"node{i}", key_dir(state) / "node.key")
    return key_dir(coordinator_state) / "coordinator.key"


def cluster_file() -> Path:
    return zctl_home() / CLUSTER_FILE


def read_record() -> ClusterRecord | None:
    path = cluster_file()
    if not path.is_file():
        return None
    try:
        return ClusterRecord(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as exc:
        raise ClusterError(f"{path} is damaged ({exc}); remove it after checking no zctl "
                           "processes are left (zctl cluster down --force)") from None


def write_record(record: ClusterRecord) -> None:
    path = cluster_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(record), indent=2))
    os.replace(tmp, path)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def loopback_host(index: int) -> str:
    """127.0.0.1 for the coordinator, 127.0.0.2.. for node i (distinct loopback addresses)."""
    if not 0 <= index < 250:
        raise ClusterError("a local cluster has at most 250 nodes")
    return f"127.0.0.{index + 1}"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _spawn(args: list[str], log_path: Path) -> int:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "controlplane", *args], stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return proc.pid


KV_CACHE_TYPES = ("f32", "f16", "bf16", "u8", "u4", "default")


def runtime_args(precision: str | None, threads: int | None, device: str,
                 kv_cache_precision: str | None = None, dynamic_quantization: bool = True
                 ) -> list[str]:
    """The coordinator's runtime flags; ``kv_cache_precision`` None or 'default' keeps the
    plugin's (u8 on CPU); ``dynamic_quantization`` False: f32 activations."""
    if kv_cache_precision and kv_cache_precision not in KV_CACHE_TYPES:
        raise ClusterError(f"unknown KV cache precision {kv_cache_precision!r}: use one of "
                           f"{', '.join(KV_CACHE_TYPES)}")
    args = ["--device", device, "--precision", precision or "default"]
    if threads:
        args += ["--threads", str(threads)]
    if kv_cache_precision:
        args += ["--kv-cache-precision", kv_cache_precision]
    if not dynamic_quantization:
        args.append("--no-dynamic-quantization")
    return args


def link_args(delay_ms: float = 0.0, jitter_ms: float = 0.0, rate_mbit: float = 0.0) -> list[str]:
    """``--link-*`` arguments of an emulated WAN link (checked here: ClusterError if bad)."""
    from dataplane.link import link_options

    try:
        link_options(delay_ms, jitter_ms, rate_mbit)
    except ValueError as exc:
        raise ClusterError(f"bad link shape: {exc}") from None
    args = []
    for flag, value in (("--link-delay-ms", delay_ms), ("--link-jitter-ms", jitter_ms),
                        ("--link-rate-mbit", rate_mbit)):
        if value:
            args += [flag, f"{value:g}"]
    return args


def start_coordinator(export_dir: Path, bind_host: str, public_host: str, port: int,
                      runtime: list[str], expect_nodes: int | None, root: Path) -> ClusterRecord:
    """Start only the coordinator (stage 0 + generation service), in the background."""
    serve_port = free_port("127.0.0.1")
    control = f"tcp://{public_host}:{port}"
    log = root / "logs" / "coordinator.log"
    args = ["coordinator", str(export_dir), "--bind", f"tcp://{bind_host}:{port}",
            "--host", public_host, "--serve", f"tcp://127.0.0.1:{serve_port}",
            "--state-dir", str(root / "coordinator"), *runtime]
    if expect_nodes is not None:
        args += ["--expect-nodes", str(expect_nodes)]
    pid = _spawn(args, log)
    return ClusterRecord(control=control, serve=f"tcp://127.0.0.1:{serve_port}",
                         export_dir=str(export_dir), pids=[pid], logs=[str(log)],
                         started=time.time())


def local_row_groups(cpu_sets: str, nodes: int, row_groups: int | None = None,
                     link_delay_ms: float = 0.0) -> int:
    """Row groups for a local cluster: ``row_groups`` if given, else 1 when the nodes share
    the cores (no stage computes faster for having a group of its own: batch every
    stream), one per stage when each node has its own (keep every stage busy), and none
    behind an emulated WAN link (every stream in flight on its own hides the hops best)."""
    if row_groups is None:
        if link_delay_ms > 0:
            return 0
        return 1 if cpu_sets == "shared" else nodes
    if row_groups < 0:
        raise ClusterError(f"row groups must be >= 0, not {row_groups}")
    return row_groups


def start_local_cluster(export_dir: Path, nodes: int, runtime: list[str],
                        root: Path | None = None, *, link_delay_ms: float = 0.0,
                        link_jitter_ms: float = 0.0, link_rate_mbit: float = 0.0,
                        cpu_sets: str = "shared", row_groups: int | None = None,
                        curve: bool = False) -> ClusterRecord:
    """Coordinator on 127.0.0.1 plus ``nodes - 1`` node processes on 127.0.0.2, ...

    ``link_delay_ms`` (+ ``link_jitter_ms``, ``link_rate_mbit``) emulates a WAN: every
    process delays each data frame it sends, so every hop (the last stage's reply to the
    coordinator too) gets that one-way latency. ``cpu_sets="split"`` gives each process
    its own cores (as if each node were its own PC); "shared" lets every stage use all.
    ``row_groups`` batches concurrent streams' decode steps into that many row groups
    (0: none; None: ``local_row_groups``). ``curve``: CURVE on the control and data
    pipes, every local node's key admitted.
    """
    from controlplane.cpusets import local_cpu_sets

    if nodes < 2:
        raise ClusterError("a local cluster needs at least 2 nodes (the coordinator and one more)")
    link = link_args(link_delay_ms, link_jitter_ms, link_rate_mbit)
    try:
        cpus = [[] if c is None else ["--cpus", c] for c in local_cpu_sets(cpu_sets, nodes)]
    except ValueError as exc:
        raise ClusterError(str(exc)) from None
    root = root or zctl_home() / "local"
    host = loopback_host(0)
    groups = ["--row-groups", str(local_row_groups(cpu_sets, nodes, row_groups, link_delay_ms))]
    if cpu_sets == "shared":
        groups.append("--shared-cores")
    secure: list[str] = []
    if curve:
        server_key = prepare_local_curve(root / "coordinator",
                                         [root / f"node{i}" for i in range(1, nodes)])
        groups.append("--curve")
        secure = ["--curve-server-key", str(server_key)]
    record = start_coordinator(export_dir, host, host, free_port(host),
                               [*runtime, *link, *cpus[0], *groups], nodes - 1, root)
    record.local_nodes = nodes
    record.curve_dir = str(root / "coordinator") if curve else ""
    for i in range(1, nodes):
        log = root / "logs" / f"node{i}.log"
        record.pids.append(_spawn(
            ["node", "--coordinator", record.control, "--host", loopback_host(i),
             "--state-dir", str(root / f"node{i}"), "--reconnect-min", "0.2", *link, *cpus[i],
             *secure], log))
        record.logs.append(str(log))
    return record


def wait_serving(record: ClusterRecord, timeout: float, on_status=None):  # noqa: ANN001, ANN201
    """Poll the coordinator until its pipeline serves; ClusterError with the log tail if not."""
    from controlplane.client import ClusterUnreachable, query_status

    deadline = time.monotonic() + timeout
    last = "not answering"
    while time.monotonic() < deadline:
        dead = [pid for pid in record.pids if not alive(pid)]
        if record.pids and record.pids[0] in dead:
            raise ClusterError(f"the coordinator exited during start-up:\n{log_tail(record.logs[0])}")
        try:
            status = query_status(record.control, timeout=1.0, curve=control_curve(record))
        except ClusterUnreachable:
            time.sleep(0.2)
            continue
        if on_status is not None:
            on_status(status)
        if status.pipeline == "serving":
            return status
        last = status.pipeline + (f" ({status.plan_error})" if status.plan_error else "")
        time.sleep(0.2)
    raise ClusterError(f"the cluster is not serving after {timeout:.0f}s: {last}; logs in "
                       f"{Path(record.logs[0]).parent}")


def log_tail(path: str, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def stop_processes(pids: list[int], grace: float = 5.0) -> None:
    """SIGTERM every process group (nodes first), then SIGKILL whatever is left."""
    for pid in reversed(pids):
        try:
            os.killpg(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        _reap(pids)
        time.sleep(0.05)
    for pid in pids:
        if alive(pid):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    _reap(pids)


def _reap(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
