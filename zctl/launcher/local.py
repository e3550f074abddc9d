"""Background cluster processes for ``zctl cluster up/down`` and the embedded cluster of ``zctl run``.

A local cluster is one coordinator process (stage 0, on 127.0.0.1) and N-1 node
processes, each on its own loopback address (127.0.0.2, 127.0.0.3, ...), started in
their own sessions so they outlive the command. ``cluster.json`` in the zctl home
records where they listen and their pids, so ``down`` and ``run`` can find them.
``local_data_plane`` is a local cluster's data plane without its control plane.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from controlplane.nodeinfo import fresh_port
from dataplane.runtime.config import RuntimeSpec
from zctl.engine.requests import DEFAULT_MAX_STREAMS
from zctl.launcher.processes import (
    CoordinatorProcess,
    LinkShape,
    NodeProcess,
    process_command,
)
from zctl.paths import zctl_home
from zctl.serve.tls import ApiTls, own_server_context, scheme

if TYPE_CHECKING:
    from dataplane.head.cluster_head import ClusterHead

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
    api: str = ""  # the OpenAI API's address when cluster up --api started it


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
    """A free port for a process about to start to bind: below the ephemeral range, where
    no outgoing connection takes it while the process starts (nodeinfo.fresh_port)."""
    return fresh_port(host)


def loopback_host(index: int) -> str:
    """127.0.0.1 for the coordinator, 127.0.0.2.. for node i (distinct loopback addresses)."""
    if not 0 <= index < 250:
        raise ClusterError("a local cluster has at most 250 nodes")
    return f"127.0.0.{index + 1}"


def zctl_process(pid: int) -> bool:
    """Whether ``pid`` runs one of zctl's own processes (a coordinator, a node, the API):
    a pid in an old cluster.json may belong to some other program by now."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(a == b"-m" and b in (b"zctl.launcher", b"zctl") for a, b in
               zip(argv, argv[1:], strict=False))


def alive(pid: int) -> bool:
    """Whether the process runs (an exited child not yet reaped does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc here: the signal said it exists
    return stat.rpartition(")")[2].split()[0] != "Z"


class LocalNetwork(Protocol):
    """Where a local cluster's processes live (default: distinct loopback addresses): node
    i's address (0: the coordinator's), and a command wrapped to run at node i (e.g. inside
    its network namespace)."""

    def host(self, node: int) -> str: ...
    def command(self, node: int, argv: list[str]) -> list[str]: ...


def _spawn(config: CoordinatorProcess | NodeProcess, log_path: Path,
           wrap: Callable[[list[str]], list[str]] | None = None) -> int:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, *process_command(config)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            wrap(argv) if wrap is not None else argv, stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return proc.pid


KV_CACHE_TYPES = ("f32", "f16", "bf16", "u8", "u4", "default")


def runtime_spec(precision: str | None, threads: int | None, device: str,
                 kv_cache_precision: str | None = None, dynamic_quantization: bool = True,
                 paged_attention: bool = True) -> RuntimeSpec:
    """The stages' runtime; ``kv_cache_precision`` None or 'default' keeps the plugin's (u8
    on CPU); ``dynamic_quantization`` False: f32 activations; ``paged_attention``: KV in
    blocks on PagedAttention (dataplane.runtime.paged; CPU devices only, elsewhere the
    stateful KV)."""
    if kv_cache_precision and kv_cache_precision not in KV_CACHE_TYPES:
        raise ClusterError(f"unknown KV cache precision {kv_cache_precision!r}: use one of "
                           f"{', '.join(KV_CACHE_TYPES)}")
    kv = None if kv_cache_precision in (None, "default") else kv_cache_precision
    return RuntimeSpec(device=device, precision=None if precision in (None, "default") else precision,
                       num_threads=threads or None, kv_cache_precision=kv,
                       dynamic_quantization=dynamic_quantization,
                       paged_attention=paged_attention and device.split(":")[0].split(".")[0] == "CPU")


def link_shape(delay_ms: float = 0.0, jitter_ms: float = 0.0, rate_mbit: float = 0.0,
               relays: int = 0, relay_delay_ms: float = 0.0) -> LinkShape:
    """An emulated WAN link's shape (checked here: ClusterError if bad)."""
    link = LinkShape(delay_ms, jitter_ms, rate_mbit, relays, relay_delay_ms)
    try:
        link.check()
    except ValueError as exc:
        raise ClusterError(f"bad link shape: {exc}") from None
    return link


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


def start_coordinator(config: CoordinatorProcess, root: Path) -> ClusterRecord:
    """Start only the coordinator (stage 0 + generation service) in the background; its
    generation service binds a free loopback port and its state lives under ``root``."""
    serve = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    log = root / "logs" / "coordinator.log"
    pid = _spawn(replace(config, serve=serve, state_dir=str(root / "coordinator")), log)
    return ClusterRecord(control=config.control, serve=serve, export_dir=config.export_dir, pids=[pid],
                         logs=[str(log)], started=time.time())


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
                        network: LocalNetwork | None = None) -> ClusterRecord:
    """Coordinator on 127.0.0.1 plus ``nodes - 1`` node processes on 127.0.0.2, ...

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
    """
    from zctl.launcher.cpusets import local_cpu_sets

    if nodes < 2:
        raise ClusterError("a local cluster needs at least 2 nodes (the coordinator and one more)")
    if not isinstance(runtime, RuntimeSpec):
        raise ClusterError(f"the stages' runtime must be a RuntimeSpec (runtime_spec), not "
                           f"{type(runtime).__name__}")
    shapes = stage_links(nodes, link_shape(link_delay_ms, link_jitter_ms, link_rate_mbit), links)
    try:
        cpus = local_cpu_sets(cpu_sets, nodes)
    except ValueError as exc:
        raise ClusterError(str(exc)) from None
    root = root or zctl_home() / "local"
    host = network.host(0) if network is not None else loopback_host(0)
    server_key = None
    if curve:
        server_key = prepare_local_curve(root / "coordinator",
                                         [root / f"node{i}" for i in range(1, nodes)])
    placement = {}
    if len(set(shapes)) > 1:  # every hop its own shape: node i must serve stage i
        from controlplane.nodeinfo import load_or_create_node_id

        placement = {str(i): load_or_create_node_id(root / f"node{i}") for i in range(1, nodes)}
    record = start_coordinator(CoordinatorProcess(
        str(export_dir), bind=f"tcp://{host}:{free_port(host)}", host=host,
        expect_nodes=nodes - 1, placement=placement, resume_timeout=resume_timeout,
        reassign_after=reassign_after, heal_after=heal_after, curve=curve,
        row_groups=local_row_groups(cpu_sets, nodes, row_groups,
                                    max(s.delay_ms for s in shapes)),
        max_streams=max_streams, kv_memory_mb=kv_memory_mb, prefix_cache_mb=prefix_cache_mb,
        shared_cores=cpu_sets == "shared", runtime=runtime, link=shapes[0],
        cpus=cpus[0]), root)
    record.local_nodes = nodes
    record.curve_dir = str(root / "coordinator") if curve else ""
    for i in range(1, nodes):
        pid, log = start_local_node(record, i, root, link=shapes[i], cpus=cpus[i],
                                    curve_server_key=server_key, network=network)
        record.pids.append(pid)
        record.logs.append(log)
    return record


def start_local_node(record: ClusterRecord, index: int, root: Path, *,
                     link: LinkShape | None = None, cpus: str | None = None,
                     curve_server_key: Path | None = None,
                     network: LocalNetwork | None = None) -> tuple[int, str]:
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
        link=link or LinkShape(), cpus=cpus,
        curve_server_key=str(curve_server_key) if curve_server_key else None), log,
        partial(network.command, index) if network is not None else None)
    return pid, str(log)


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


def valid_port(port: int) -> bool:
    """Whether a TCP port can be listened on (1..65535)."""
    return 0 < port < 65536


def parse_api(value: str) -> tuple[str, int]:
    """HOST:PORT of ``cluster up --api`` (a bare PORT listens on 127.0.0.1)."""
    host, _, port = value.rpartition(":")
    if not port.isdigit() or not valid_port(int(port)):
        raise ClusterError(f"--api takes HOST:PORT (e.g. 127.0.0.1:8000), not {value!r}")
    return host or "127.0.0.1", int(port)


def cors_origin(value: str, option: str = "--cors-origin") -> str:
    """An origin as browsers send it (``scheme://host[:port]``, no path), or "*"; raises
    ValueError with the reason."""
    origin = value.strip().rstrip("/")
    if origin == "*":
        return origin
    scheme, sep, rest = origin.partition("://")
    if scheme not in ("http", "https") or not sep or not rest or "/" in rest:
        raise ValueError(f"{option} takes '*' or scheme://host[:port], not {value!r}")
    return origin


def start_api(record: ClusterRecord, value: str, timeout_s: float = 60.0,
              max_queue: int | None = None, cors_origins: tuple[str, ...] = (),
              tls: ApiTls | None = None, api_key: str | None = None) -> ClusterRecord:
    """Start ``zctl serve`` for the cluster in the background (it serves the cluster.json of
    this process's zctl home: write the record there first) and wait for it to answer; the
    record gains its pid and address. ``max_queue``: its --max-queue, None its default;
    ``cors_origins``: its --cors-origin values; ``tls``: HTTPS with these files;
    ``api_key``: the key it requires ("": none), None: ZCTL_API_KEY's, if that is set."""
    import urllib.error
    import urllib.request

    host, port = parse_api(value)
    log_path = Path(record.logs[0]).parent / "api.log" if record.logs else Path(os.devnull)
    command = [sys.executable, "-m", "zctl", "serve", "--host", host, "--port", str(port)]
    if max_queue is not None:
        command += ["--max-queue", str(max_queue)]
    for origin in cors_origins:
        command += ["--cors-origin", origin]
    if tls is not None:
        command += tls.serve_args()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if api_key is not None:  # in its environment, as ZCTL_API_KEY: not on its command line
        env.pop("ZCTL_API_KEY", None)
        env.update({"ZCTL_API_KEY": api_key} if api_key else {})
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, env=env)
    url = f"{scheme(tls)}://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise ClusterError(f"zctl serve exited with {proc.returncode} (see {log_path})")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2,  # noqa: S310
                                   context=own_server_context(url))
            break
        except urllib.error.HTTPError:
            break  # it answers (503 while a stage is down)
        except OSError:
            time.sleep(0.2)
    else:
        proc.kill()
        raise ClusterError(f"zctl serve did not answer at {url} within {timeout_s:g} s")
    return replace(record, pids=[*record.pids, proc.pid], api=url)
