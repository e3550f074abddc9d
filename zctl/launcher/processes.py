"""The coordinator and node processes, started from typed configurations.

``CoordinatorProcess`` and ``NodeProcess`` say everything a process needs; ``run_coordinator``
and ``run_node`` run one until it is stopped (SIGTERM or Ctrl-C) and return its exit code.
``zctl`` builds them from its options (zctl.cli.cluster) and either runs one here or
starts ``python -m zctl.launcher ROLE CONFIG_JSON`` (``process_command``), whose entry
(zctl.launcher.__main__) only rebuilds the same dataclass from that JSON.
"""

from __future__ import annotations

import json
import logging
import signal
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controlplane.records import DEFAULT_REPLAN_GAIN, HEARTBEAT_S, LIVENESS
from controlplane.schema import SchemaError, build
from dataplane.runtime.config import RuntimeSpec
from zctl.endpoints import split_address, tcp_address
from zctl.engine.requests import DEFAULT_MAX_STREAMS
from zctl.launcher.lifetime import interrupt_once
from zctl.launcher.record import ClusterError

if TYPE_CHECKING:
    from zctl.discovery.browser import ClusterWatch

log = logging.getLogger("zctl.processes")
Say = Callable[[str], None]  # where a process tells its operator what it does
Progress = Callable[[str, int, int], None]  # (shard hash, bytes done, bytes in all)


@dataclass(frozen=True)
class LinkShape:
    """An emulated WAN link on every data frame a process sends (zeros: a plain link)."""

    delay_ms: float = 0.0  # one-way latency
    jitter_ms: float = 0.0  # plus uniform random 0..J ms per frame (order is kept)
    rate_mbit: float = 0.0  # bandwidth cap (0: none)
    relays: int = 0  # store-and-forward relays on the path (see dataplane.wire.link)
    relay_delay_ms: float = 0.0  # each relay's own delay

    @property
    def shaped(self) -> bool:
        return bool(self.delay_ms or self.jitter_ms or self.rate_mbit or self.relays)

    def pipe_options(self) -> Any:
        """The data pipes' options with this shape (dataplane.wire.transport.PipeOptions);
        ValueError naming a bad value."""
        from dataplane.wire.link import link_options

        return link_options(self.delay_ms, self.jitter_ms, self.rate_mbit, relays=self.relays,
                            relay_delay_ms=self.relay_delay_ms)

    def check(self) -> None:
        """ValueError naming a bad value."""
        self.pipe_options()

    def describe(self) -> str:
        relayed = ""
        if self.relays:
            relayed = (f", through {self.relays} store-and-forward relay"
                       + ("s" if self.relays > 1 else "")
                       + (f" (+{self.relay_delay_ms:g} ms each)" if self.relay_delay_ms else ""))
        return (f"{self.delay_ms:g} ms one-way"
                + (f" + 0..{self.jitter_ms:g} ms jitter" if self.jitter_ms else "")
                + (f", {self.rate_mbit:g} Mbit/s" if self.rate_mbit else "") + relayed)


@dataclass(frozen=True)
class CoordinatorProcess:
    """A coordinator: serves ``export_dir``, runs stage 0 and (with ``serve``) the
    generation service that ``zctl run`` talks to."""

    export_dir: str
    bind: str = "tcp://*:5550"
    host: str | None = None  # address nodes reach this machine at
    data_port: int = 0
    state_dir: str | None = None  # default: ZCTL_HOME/coordinator
    heartbeat: float = HEARTBEAT_S
    liveness: int = LIVENESS
    expect_nodes: int | None = None
    placement: dict[str, str] = field(default_factory=dict)  # {stage: node id}
    reassign_after: float | None = None
    heal_after: float | None = 0.0  # None: no healing onto the survivors
    resume_timeout: float = 120.0
    curve: bool = False
    serve: str | None = None  # the generation service's bind address
    row_groups: int | None = None  # default: one per stage
    max_streams: int = DEFAULT_MAX_STREAMS  # generations at once (more wait their turn)
    kv_memory_mb: int = 2048  # KV a stage may hold: running streams + cached prefixes
    prefix_cache_mb: int = 512  # of which cached prefixes (0: no prefix cache)
    shared_cores: bool = False
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    link: LinkShape = field(default_factory=LinkShape)
    cpus: str | None = None
    memory_mb: int = 0  # RAM this machine lends its stages (0: what is free)
    cluster_id: str = ""  # an embedded cluster's identity: others' nodes are refused ("": any)
    profile: bool = True  # measure this machine's profile for the model when it has none
    replan_gain: float = DEFAULT_REPLAN_GAIN  # re-plan when predicted this much faster
    objective: str = "latency"  # the planner's: latency, or throughput at max_streams streams
    profile_budget_s: float = 0.0  # what a node's profile of one device may take (0: 30 s)
    parent: int = 0  # the pid of the command that started this process (0: not recorded)
    ends_with_parent: bool = False  # an embedded cluster's process: it ends when parent does
    announce: bool = False  # announce the cluster on the LAN (DNS-SD over mDNS)
    cluster_name: str = ""  # the announced name ("": this machine's host name)
    announce_interfaces: list[str] = field(default_factory=list)  # only these interfaces
    announce_loopback: bool = False  # loopback too (binding every interface)

    @property
    def bind_host(self) -> str:
        """The host part of ``bind`` (``0.0.0.0`` or ``*``: every interface; an IPv6 host
        without its brackets); ValueError if ``bind`` is no tcp://HOST:PORT address."""
        return split_address(self.bind)[0]

    @property
    def control(self) -> str:
        """The control address nodes and clients connect to: ``host``, else the bind host,
        at the bind port (an IPv6 host in brackets)."""
        return tcp_address(self.host or self.bind_host, split_address(self.bind)[1])

    @property
    def announced_name(self) -> str:
        """The name the cluster is announced under: ``cluster_name``, else this machine's
        host name made a valid name."""
        if self.cluster_name:
            return self.cluster_name
        import socket

        from zctl.discovery.interfaces import default_cluster_name

        return default_cluster_name(socket.gethostname())


@dataclass(frozen=True)
class NodeProcess:
    """A node: joins ``coordinator`` and serves the stage it is assigned."""

    coordinator: str
    host: str | None = None  # address other nodes reach this one at
    data_port: int = 0
    state_dir: str | None = None  # default: ZCTL_HOME/node
    heartbeat: float = HEARTBEAT_S
    reconnect_min: float = 1.0
    reconnect_max: float = 32.0
    tok_s: float | None = None  # measured speed, for placement
    curve_server_key: str | None = None  # the coordinator's public key file: CURVE on
    link: LinkShape = field(default_factory=LinkShape)
    cpus: str | None = None
    memory_mb: int = 0  # RAM this machine lends its stages (0: what is free)
    cluster_id: str = ""  # the embedded cluster it belongs to ("": whichever it joins)
    profile: bool = True  # measure its profile for the cluster's model when it has none
    parent: int = 0  # the pid of the command that started this process (0: not recorded)
    ends_with_parent: bool = False  # an embedded cluster's process: it ends when parent does
    rediscover: str = ""  # the announced cluster it joined: found again by name when lost
    fingerprint: str = ""  # that cluster's announced CURVE key fingerprint ("": CURVE off)


ROLES: dict[str, type] = {"coordinator": CoordinatorProcess, "node": NodeProcess}


def process_command(config: CoordinatorProcess | NodeProcess) -> list[str]:
    """The arguments after ``python`` that start this process: the role and its config."""
    role = "coordinator" if isinstance(config, CoordinatorProcess) else "node"
    return ["-m", "zctl.launcher", role, json.dumps(asdict(config))]


def parse_process(role: str, text: str) -> CoordinatorProcess | NodeProcess:
    """The typed config ``process_command`` wrote; ValueError if it is not one."""
    if role not in ROLES:
        raise ValueError(f"unknown process role {role!r}: expected {' or '.join(ROLES)}")
    try:
        return build(ROLES[role], json.loads(text), role)
    except (json.JSONDecodeError, SchemaError) as exc:
        raise ValueError(f"bad {role} configuration: {exc}") from None


def placement_of(pins: list[str]) -> dict[str, str]:
    """``STAGE=NODE_ID`` pins as a placement; ValueError names a bad one."""
    out = {}
    for pin in pins:
        stage, sep, node_id = pin.partition("=")
        if not sep or not stage.isdigit() or not node_id:
            raise ValueError(f"bad --place {pin!r}: expected STAGE=NODE_ID, e.g. 1=pc2-1a2b3c4d")
        out[stage] = node_id
    return out


def _home(state_dir: str | None, name: str) -> Path:
    from zctl.paths import zctl_home

    return Path(state_dir) if state_dir else zctl_home() / name


def _tie_to_parent(config: CoordinatorProcess | NodeProcess) -> None:
    """An embedded cluster's process shuts down as on SIGTERM once the command that started
    it is gone (zctl.launcher.lifetime; its parent also asked the kernel to tell it)."""
    if config.ends_with_parent and config.parent > 0:
        from zctl.launcher.lifetime import watch_parent

        watch_parent(config.parent)


def _prepare(link: LinkShape, cpus: str | None, base: Any, say: Say) -> Any:
    """Apply the CPU set and hold the allocator's mmap threshold (before anything starts a
    thread or compiles a stage); ``base`` (a launcher) with the emulated link applied, or
    None for the default one."""
    from dataplane.runtime.heap import hold_mmap_threshold

    hold_mmap_threshold()  # freed step buffers go back to the system (dataplane/runtime/heap.py)
    if cpus:
        from zctl.launcher.cpusets import confine_to

        say(f"confined to CPUs {cpus}")
        confine_to(cpus)
    if not link.shaped:
        return None
    from functools import partial

    try:
        options = link.pipe_options()
    except ValueError as exc:
        raise ValueError(f"bad emulated link: {exc}") from None
    say(f"emulated link on outbound frames: {link.describe()}")
    return partial(base, options=options)


def _probe_link(link: LinkShape) -> Any:
    """The emulated link a process's link probes go over as its data frames do (None: a
    plain link)."""
    return link.pipe_options() if link.shaped else None


def _row_groups(config: CoordinatorProcess) -> int:
    if config.row_groups is None:  # one group per stage: every stage busy
        from zctl.manifest import load_manifest

        return len(load_manifest(config.export_dir, verify_files=False).stages)
    if config.row_groups < 0:
        raise ValueError(f"row groups must be >= 0, not {config.row_groups}")
    return config.row_groups


def run_coordinator(config: CoordinatorProcess, say: Say = log.info) -> int:
    """Run the coordinator (and its generation service) until SIGTERM or Ctrl-C (or, with
    ``ends_with_parent``, until its parent is gone)."""
    _tie_to_parent(config)
    from controlplane.coordinator import Coordinator, CoordinatorConfig
    from controlplane.launch import head_launcher
    from controlplane.planner.search import PLAN_STREAMS
    from controlplane.security import CurveServer, key_dir

    launcher = _prepare(config.link, config.cpus, head_launcher, say)
    row_groups = _row_groups(config) if config.serve else None  # the service's
    state_dir = _home(config.state_dir, "coordinator")
    curve = None
    if config.curve:
        curve = CurveServer.from_state_dir(state_dir, state_dir / "authorized")
        say(f"CURVE on: give nodes {key_dir(state_dir) / 'coordinator.key'}; admit a node with "
            "zctl cluster authorize NODE.key")
    coordinator = Coordinator(config.export_dir, CoordinatorConfig(
        endpoint=config.bind, state_dir=state_dir, host=config.host, data_port=config.data_port,
        heartbeat_interval=config.heartbeat, liveness=config.liveness,
        expect_nodes=config.expect_nodes,
        placement={int(stage): node for stage, node in config.placement.items()},
        runtime=config.runtime, reassign_after=config.reassign_after,
        heal_after=config.heal_after, curve=curve, memory_limit=config.memory_mb << 20,
        cluster_id=config.cluster_id, profile=config.profile, link=_probe_link(config.link),
        row_groups=row_groups, replan_gain=config.replan_gain, objective=config.objective,
        plan_streams=config.max_streams if config.objective == "throughput" else PLAN_STREAMS,
        **({"profile_budget_s": config.profile_budget_s} if config.profile_budget_s > 0 else {})),
        launcher=launcher)
    signal.signal(signal.SIGTERM, interrupt_once())
    say(f"coordinator {coordinator.node_id}: nodes join with zctl node join {coordinator.bind()}")
    announcer = _announce(config, coordinator, curve, say) if config.announce else None
    service = None
    if config.serve:
        from zctl.service.server import GenerationService

        service = GenerationService(
            config.export_dir, coordinator.stage0_executor, config.serve,
            max_streams=config.max_streams, row_groups=row_groups,
            kv_memory_mb=config.kv_memory_mb, prefix_cache_mb=config.prefix_cache_mb,
            shared_cores=config.shared_cores,
            health=coordinator.pipeline_problem, resume_timeout_s=config.resume_timeout,
            stage_runtime=config.runtime,
            cluster=coordinator.status)
        say(f"generation service on {service.start()}")
    try:
        coordinator.run()
    except KeyboardInterrupt:
        pass
    finally:
        if service is not None:
            service.stop()
        if announcer is not None:
            announcer.close()
    return 0


def _announce(config: CoordinatorProcess, coordinator: Any, curve: Any, say: Say) -> Any:
    """Announce the coordinator's cluster on the LAN (a zctl.discovery Announcer); None,
    said why, when it cannot be: the cluster runs on, joined by address."""
    from controlplane.messages import PROTOCOL_VERSION
    from controlplane.security import key_fingerprint
    from zctl.discovery.announcer import announce_cluster
    from zctl.discovery.records import Announcement

    name = config.announced_name
    announcement = Announcement(name, coordinator.bind(), PROTOCOL_VERSION, coordinator.openvino,
                                coordinator.node_id,
                                key_fingerprint(curve.public) if curve is not None else "")
    try:
        announcer = announce_cluster(announcement, config.bind_host, config.announce_interfaces,
                                     config.announce_loopback)
    except (OSError, ValueError) as exc:
        say(f"not announced on the LAN: {exc}; nodes join by address")
        return None
    where = ", ".join(f"{i.name} {i.address}" for i in announcer.interfaces)
    say(f"announced cluster {name} at {announcer.announcement.control} on {where}: nodes "
        "join with zctl node join (no address)")
    return announcer


def _watch_cluster(config: NodeProcess, say: Say) -> ClusterWatch | None:
    """A watch of the LAN for the announced cluster the node joined (its agent closes it);
    None when it joined by address, or when multicast cannot be opened here."""
    if not config.rediscover:
        return None
    from controlplane.messages import PROTOCOL_VERSION
    from zctl.discovery.browser import ClusterWatch

    watch = ClusterWatch(config.rediscover, PROTOCOL_VERSION, config.fingerprint)
    try:
        watch.start()
    except OSError as exc:
        say(f"cannot watch the LAN for cluster {config.rediscover} ({exc}): a lost "
            f"coordinator is looked for at {config.coordinator} only")
        return None
    return watch


def run_node(config: NodeProcess, say: Say = log.info, on_progress: Progress | None = None) -> int:
    """Run a node agent until SIGTERM or Ctrl-C (or, with ``ends_with_parent``, until its
    parent is gone); 2 if the coordinator refused it."""
    _tie_to_parent(config)
    from controlplane.agent import AgentConfig, NodeAgent
    from controlplane.launch import default_launcher
    from controlplane.security import CurveClient, key_dir, read_public_key

    launcher = _prepare(config.link, config.cpus, default_launcher, say)
    state_dir = _home(config.state_dir, "node")
    curve = (CurveClient.from_state_dir(state_dir, read_public_key(Path(config.curve_server_key)))
             if config.curve_server_key else None)
    locator = _watch_cluster(config, say)
    agent = NodeAgent(AgentConfig(
        config.coordinator, state_dir=state_dir, data_host=config.host, locator=locator,
        data_port=config.data_port, heartbeat_interval=config.heartbeat,
        reconnect_min=config.reconnect_min, reconnect_max=config.reconnect_max,
        tok_s=config.tok_s, curve=curve, memory_limit=config.memory_mb << 20,
        cluster_id=config.cluster_id, profile=config.profile, link=_probe_link(config.link)),
        launcher=launcher, on_progress=on_progress)
    signal.signal(signal.SIGTERM, interrupt_once())
    say(f"node {agent.node_id} (data {agent.data_addr}) joining {config.coordinator}")
    if curve is not None:
        say(f"CURVE: this node's public key is {key_dir(state_dir) / 'node.key'}; the "
            "coordinator must admit it (zctl cluster authorize NODE.key)")
    try:
        agent.run()
    except KeyboardInterrupt:
        pass
    if agent.refusal:
        say(f"refused: {agent.refusal}")
        return 2
    return 0




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
