"""Background cluster processes for ``zctl cluster up/down`` and the embedded cluster of ``zctl run``.

A local cluster is one coordinator process (stage 0, on 127.0.0.1) and N-1 node
processes, each on its own loopback address (127.0.0.2, 127.0.0.3, ...), started in
their own sessions: ``cluster up``'s outlive the command, an embedded cluster's
(``owned``) end with it. Its record (zctl.launcher.record) says where they listen and
their pids, so ``down`` and ``run`` can find them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Protocol

from controlplane.nodeinfo import fresh_port
from controlplane.records import DEFAULT_REPLAN_GAIN, ClusterStatus
from dataplane.runtime.config import RuntimeSpec
from zctl.engine.requests import DEFAULT_MAX_STREAMS
from zctl.launcher.lifetime import die_with_parent
from zctl.launcher.processes import (
    CoordinatorProcess,
    LinkShape,
    NodeProcess,
    link_shape,
    process_command,
)
from zctl.launcher.record import ClusterError, ClusterRecord, alive, control_curve
from zctl.paths import zctl_home


def prepare_local_curve(coordinator_state: Path, node_states: list[Path]) -> Path:
    """Key pairs for a local CURVE cluster: the coordinator's, and every node's admitted
    to it. Returns the coordinator's public key file (what nodes are given)."""
    from controlplane.security import authorize, key_dir, load_or_create_keypair

    load_or_create_keypair(key_dir(coordinator_state), "coordinator")
    for i, state in enumerate(node_states, start=1):
        load_or_create_keypair(key_dir(state), "node")
        authorize(coordinator_state / "authorized", f"node{i}", key_dir(state) / "node.key")
    return key_dir(coordinator_state) / "coordinator.key"


def free_port(host: str, taken: Collection[int] = ()) -> int:
    """A free port for a process about to start to bind: below the ephemeral range, where
    no outgoing connection takes it while the process starts (nodeinfo.fresh_port), and
    none of ``taken`` (ports already given to the same process, not bound yet)."""
    for _ in range(16):
        port = fresh_port(host)
        if port not in taken:
            return port
    raise ClusterError(f"no free port on {host} besides {sorted(taken)}")


def loopback_host(index: int) -> str:
    """127.0.0.1 for the coordinator, 127.0.0.2.. for node i (distinct loopback addresses)."""
    if not 0 <= index < 250:
        raise ClusterError("a local cluster has at most 250 nodes")
    return f"127.0.0.{index + 1}"


class LocalNetwork(Protocol):
    """Where a local cluster's processes live (default: distinct loopback addresses): node
    i's address (0: the coordinator's), and a command wrapped to run at node i (e.g. inside
    its network namespace)."""

    def host(self, node: int) -> str: ...
    def command(self, node: int, argv: list[str]) -> list[str]: ...


def _spawn(config: CoordinatorProcess | NodeProcess, log_path: Path,
           wrap: Callable[[list[str]], list[str]] | None = None, owned: bool = False) -> int:
    """Start the process in a session of its own, its output to ``log_path``; its config
    names this process as its parent (how zctl cluster down tells whether its command is
    gone) and, when ``owned``, it ends with this process (zctl.launcher.lifetime)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    state_dir = str(Path(config.state_dir).absolute()) if config.state_dir else None
    config = replace(config, state_dir=state_dir, parent=os.getpid(), ends_with_parent=owned)
    argv = [sys.executable, *process_command(config)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            wrap(argv) if wrap is not None else argv, stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=die_with_parent() if owned else None,  # (a prctl call, no more)
        )
    return proc.pid


def stage_links(nodes: int, link: LinkShape, links: Sequence[LinkShape] | None) -> list[LinkShape]:
    """Each process's outbound link shape, coordinator first: ``links`` when given (one
    per node, each checked), else ``link`` for all; ClusterError if bad."""
    if links is None:
        return [link] * nodes
    if link.shaped:
        raise ClusterError("give one link shape for all (link_*) or one per hop (links), "
                           "not both")
    if len(links) != nodes:
        raise ClusterError(f"{nodes} nodes send on {nodes} hops: links has {len(links)} shapes")
    for i, shape in enumerate(links):
        try:
            shape.check()
        except ValueError as exc:
            raise ClusterError(f"bad link shape of hop {i}: {exc}") from None
    return list(links)


def start_coordinator(config: CoordinatorProcess, root: Path, owned: bool = False
                      ) -> ClusterRecord:
    """Start only the coordinator (stage 0 + generation service) in the background; its
    generation service binds a free loopback port and its state lives under ``root``.
    ``owned``: it ends with this process."""
    taken = {int(config.bind.rpartition(":")[2] or 0), config.data_port}
    serve = f"tcp://127.0.0.1:{free_port('127.0.0.1', taken)}"
    log = root / "logs" / "coordinator.log"
    pid = _spawn(replace(config, serve=serve, state_dir=str(root / "coordinator")), log,
                 owned=owned)
    return ClusterRecord(control=config.control, serve=serve, export_dir=config.export_dir, pids=[pid],
                         logs=[str(log)], started=time.time(), cluster_id=config.cluster_id,
                         owned=owned)


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


def start_local_cluster(export_dir: Path, nodes: int, runtime: RuntimeSpec,
                        root: Path | None = None, *, link_delay_ms: float = 0.0,
                        link_jitter_ms: float = 0.0, link_rate_mbit: float = 0.0,
                        cpu_sets: str = "shared", row_groups: int | None = None,
                        curve: bool = False, resume_timeout: float = 120.0,
                        reassign_after: float | None = None,
                        heal_after: float | None = 0.0, max_streams: int = DEFAULT_MAX_STREAMS,
                        kv_memory_mb: int = 2048, prefix_cache_mb: int = 512,
                        links: Sequence[LinkShape] | None = None,
                        network: LocalNetwork | None = None, memory_mb: int = 0,
                        owned: bool = False, profile: bool = False,
                        replan_gain: float = DEFAULT_REPLAN_GAIN,
                        objective: str = "latency",
                        pin_stages: bool = False,
                        cpus: Sequence[str | None] | None = None,
                        profile_budget_s: float = 0.0) -> ClusterRecord:
    """Coordinator on 127.0.0.1 plus ``nodes - 1`` node processes on 127.0.0.2, ...
    (``nodes`` 1: the coordinator alone runs every stage).

    ``link_delay_ms`` (+ ``link_jitter_ms``, ``link_rate_mbit``) emulates a WAN: every
    process delays each data frame it sends, so every hop (the last stage's reply to the
    coordinator too) gets that one-way latency. ``cpu_sets="split"`` gives each process
    its own cores (as if each node were its own PC); "shared" lets every stage use all.
    ``row_groups`` batches concurrent streams' decode steps into that many row groups
    (0: none; None: ``local_row_groups``). ``curve``: CURVE on the control and data
    pipes, every local node's key admitted. ``heal_after``: seconds before a lost node's
    stages go to its neighbours (None: never). ``max_streams``: generations at once;
    ``kv_memory_mb``/``prefix_cache_mb``: the KV a stage may hold, and how much of it
    cached prefixes may (see CoordinatorProcess). ``links`` (instead of the ``link_*``
    shape for all): one shape per process, coordinator first, i.e. per hop, as each
    process shapes what it sends (hop i: stage i to i+1; the last: the replies to the
    coordinator). Shapes that differ pin stage i to node i (``stage_links``). ``network``
    places the processes elsewhere than on 127.0.0.x (e.g. nodes in network namespaces).
    ``memory_mb``: the RAM each process lends its stages (0: what is free).
    ``owned``: the processes end with this one (an embedded cluster, zctl.launcher.embedded),
    and the cluster has an identity of its own: its coordinator admits only its own nodes
    (another's, e.g. an earlier embedded cluster's, are refused; a cluster up one's admit
    any node, as one joined by hand with zctl node join). ``profile``: each process
    measures its profile for the model when its state directory keeps none (off by default:
    the processes share this machine's cores, and ``zctl node profile`` measures it once).
    ``objective``: what the planner places for (latency, or throughput at ``max_streams``
    streams). ``replan_gain``: a re-plan of the serving pipeline is applied when predicted
    this much faster (CoordinatorProcess). ``pin_stages``: stage i runs on node i, whatever the
    planner would choose (a benchmark's case names its topology), as when hops differ.
    ``cpus``: each process's CPU list, coordinator first (None: unconfined), instead of
    ``cpu_sets``' split (which still decides the row groups): several nodes may then share
    a core, as when more nodes than cores stand for PCs on one machine.
    ``profile_budget_s``: what a node's profile may take (0: the coordinator's default); a
    node held to a small CPU quota needs more.
    """
    from zctl.launcher.cpusets import local_cpu_sets

    if nodes < 1:
        raise ClusterError(f"a local cluster has at least 1 node (the coordinator), not {nodes}")
    if memory_mb < 0:
        raise ClusterError(f"memory to lend must be >= 0 MB, not {memory_mb}")
    if profile_budget_s < 0:
        raise ClusterError(f"a profile's budget must be >= 0 s, not {profile_budget_s}")
    if not isinstance(runtime, RuntimeSpec):
        raise ClusterError(f"the stages' runtime must be a RuntimeSpec (runtime_spec), not "
                           f"{type(runtime).__name__}")
    shapes = stage_links(nodes, link_shape(link_delay_ms, link_jitter_ms, link_rate_mbit), links)
    try:
        cpus = local_cpu_sets(cpu_sets, nodes) if cpus is None else process_cpus(cpus, nodes)
    except ValueError as exc:
        raise ClusterError(str(exc)) from None
    root = root or zctl_home() / "local"
    host = network.host(0) if network is not None else loopback_host(0)
    server_key = None
    if curve:
        server_key = prepare_local_curve(root / "coordinator",
                                         [root / f"node{i}" for i in range(1, nodes)])
    placement = {}
    if pin_stages or len(set(shapes)) > 1:  # (every hop its own shape: node i, stage i)
        from controlplane.nodeinfo import load_or_create_node_id

        placement = {str(i): load_or_create_node_id(root / f"node{i}") for i in range(1, nodes)}
    control_port = free_port(host)  # the coordinator's ports, given it distinct
    record = start_coordinator(CoordinatorProcess(
        str(export_dir), bind=f"tcp://{host}:{control_port}", host=host,
        data_port=free_port(host, {control_port}),
        expect_nodes=nodes - 1, placement=placement, resume_timeout=resume_timeout,
        reassign_after=reassign_after, heal_after=heal_after, curve=curve,
        row_groups=local_row_groups(cpu_sets, nodes, row_groups,
                                    max(s.delay_ms for s in shapes)),
        max_streams=max_streams, kv_memory_mb=kv_memory_mb, prefix_cache_mb=prefix_cache_mb,
        shared_cores=cpu_sets == "shared", runtime=runtime, link=shapes[0],
        cpus=cpus[0], memory_mb=memory_mb, profile=profile, replan_gain=replan_gain,
        objective=objective, profile_budget_s=profile_budget_s,
        cluster_id=uuid.uuid4().hex[:12] if owned else ""), root, owned)
    record.local_nodes = nodes
    record.curve_dir = str(root / "coordinator") if curve else ""
    for i in range(1, nodes):
        pid, log = start_local_node(record, i, root, link=shapes[i], cpus=cpus[i],
                                    curve_server_key=server_key, network=network,
                                    memory_mb=memory_mb, profile=profile)
        record.pids.append(pid)
        record.logs.append(log)
    return record


def process_cpus(cpus: Sequence[str | None], nodes: int) -> list[str | None]:
    """``cpus`` checked as one CPU list (or None) per process of ``nodes``; ValueError
    naming a bad one or a wrong count."""
    from zctl.launcher.cpusets import parse_cpu_list

    if len(cpus) != nodes:
        raise ValueError(f"{nodes} processes need {nodes} CPU lists, not {len(cpus)}")
    for text in cpus:
        if text is not None:
            parse_cpu_list(text)
    return list(cpus)


def start_local_node(record: ClusterRecord, index: int, root: Path, *,
                     link: LinkShape | None = None, cpus: str | None = None,
                     curve_server_key: Path | None = None,
                     network: LocalNetwork | None = None, memory_mb: int = 0,
                     profile: bool = False) -> tuple[int, str]:
    """Start node ``index`` (1..) of the local cluster ``record`` describes, as
    ``start_local_cluster`` does, or again after it was lost: its state dir
    (``root/node<index>``) keeps its identity and cached shards, its log
    (``root/logs/node<index>.log``) is appended to. Its pid and log path (the caller adds
    them to the record)."""
    if index < 1:
        raise ClusterError(f"node 0 is the coordinator: local nodes are 1.., not {index}")
    log = root / "logs" / f"node{index}.log"
    host = network.host(index) if network is not None else loopback_host(index)
    pid = _spawn(NodeProcess(
        record.control, host=host, state_dir=str(root / f"node{index}"), reconnect_min=0.2,
        link=link or LinkShape(), cpus=cpus, memory_mb=memory_mb, profile=profile,
        curve_server_key=str(curve_server_key) if curve_server_key else None,
        cluster_id=record.cluster_id), log,
        partial(network.command, index) if network is not None else None, record.owned)
    return pid, str(log)


def wait_serving(record: ClusterRecord, timeout: float, on_status=None):  # noqa: ANN001, ANN201
    """Poll the coordinator until its pipeline serves. ClusterError at once, with the
    cause, when it never will: the coordinator exited (its log's tail), or, for a local
    cluster (all of whose nodes are there), a stage failed to start, the stages do not fit
    the nodes, or a node was refused (``start_failure``); else after ``timeout``. (A node
    that is lost is healed around, as after any fault.)"""
    from controlplane.client import ClusterUnreachable, query_status

    deadline = time.monotonic() + timeout
    last = "not answering"
    while time.monotonic() < deadline:
        if record.pids and not alive(record.pids[0]):
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
        failure = start_failure(status) if record.local_nodes else None
        if failure:
            raise ClusterError(f"{failure} (logs in {Path(record.logs[0]).parent})")
        last = status.pipeline + (f" ({status.plan_error})" if status.plan_error else "")
        time.sleep(0.2)
    raise ClusterError(f"the cluster is not serving after {timeout:.0f}s: {last}; logs in "
                       f"{Path(record.logs[0]).parent}")


def start_failure(status: ClusterStatus) -> str | None:
    """Why a cluster all of whose nodes are there will not serve (None: it may yet): a
    stage failed to start (the node's error), the stages do not fit the nodes' memory, or
    a node was refused (e.g. another OpenVINO version)."""
    failed = [n for n in status.nodes if n.state == "failed"]
    if status.pipeline == "failed" and failed:
        return "; ".join(f"stage {n.stage} on {'this machine' if n.local else 'node ' + n.node_id}"
                         f" failed to start: {n.error or 'no reason given'}" for n in failed)
    if status.plan_error:
        return f"the stages cannot be placed: {status.plan_error}"
    if status.refused:
        return "; ".join(f"node {r.node_id} at {r.host} was refused: {r.reason}"
                         for r in status.refused)
    return None


def log_tail(path: str, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def stop_processes(pids: list[int], grace: float = 5.0) -> None:
    """SIGTERM every process (with its process group when it leads one), nodes first, then
    SIGKILL whatever is left after ``grace`` seconds, and wait (``grace`` again at most)
    until it is gone: a killed process ends only once the kernel has delivered the signal,
    later still when it sleeps in a disk read."""
    for pid in reversed(pids):
        _signal(pid, signal.SIGTERM)
    _wait_gone(pids, grace)
    for pid in pids:
        if alive(pid):
            _signal(pid, signal.SIGKILL)
    _wait_gone(pids, grace)


def _wait_gone(pids: list[int], within: float) -> None:
    """Reap ``pids`` until none runs or ``within`` seconds have passed."""
    deadline = time.monotonic() + within
    _reap(pids)
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
        _reap(pids)


def _signal(pid: int, signum: int) -> None:
    """Send ``signum`` to the process group ``pid`` leads (its own session's, as _spawn
    starts them), or to the process alone when it leads none."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _reap(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
