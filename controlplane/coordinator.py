"""The coordinator: a ROUTER that enrols nodes, places and ships shards, wires the pipeline.

It is also node 0: it runs stage 0 itself (from the export it serves) and binds the
return pipe the last stage sends to. One thread owns the socket and runs a poll loop
with bounded waits; every message is decoded by ``controlplane.messages`` and an
unknown or malformed one is counted and answered with an Error, never fatal.

It asks every node that enrols for its profile of the served model (and keeps or
measures its own, controlplane/profile_job.py), and once the pipeline serves a new
wiring it has each link between neighbours probed (controlplane/links.py); both show in
the status. Neither ever holds up the pipeline: a node without a profile, or a link
whose probe is not answered, only lacks its figures. With every node's profile the
planner places the stages, and places them again while serving (controlplane/wiring.py);
its status predicts the running placement's speed (controlplane/planner/running.py), or
says what it lacks.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import zmq

from controlplane import membership as ms
from controlplane.heal import hosts
from controlplane.host_speed import ProfileSpeed
from controlplane.launch import (
    BackgroundStage,
    HeadHandle,
    StageAssignment,
    StageHandle,
    StageLauncher,
    head_launcher,
)
from controlplane.link_probe import ProbeEcho, probe
from controlplane.links import LinkTable, Probe, probe_sizes
from controlplane.messages import (
    PROTOCOL_VERSION,
    AssignStage,
    Enrol,
    Error,
    Heartbeat,
    Leave,
    LinkProbe,
    LinkReport,
    Message,
    MessageError,
    ProfileReport,
    ProfileRequest,
    ProtocolMismatch,
    Refuse,
    Release,
    ShardDone,
    ShardRequest,
    StageReady,
    StatusReply,
    StatusRequest,
    UnknownMessage,
    Welcome,
    from_frames,
    peer_node_id,
    to_frames,
    type_tag,
)
from controlplane.nodeinfo import (
    choose_data_port,
    endpoint_host,
    load_or_create_node_id,
    openvino_version,
    probe_devices,
    ram,
    route_host,
    zctl_version,
)
from controlplane.placement import LayerCost, stage_needs
from controlplane.planner.export_shape import export_shape
from controlplane.planner.measured import link_from_samples
from controlplane.planner.profile import LinkProfile
from controlplane.planner.running import running_prediction
from controlplane.planner.search import PLAN_STREAMS
from controlplane.planner.shape import ShapeError
from controlplane.profile_job import ProfileJob, ProfileTask, report_outcome
from controlplane.profile_store import BUDGET_S
from controlplane.records import (
    DEFAULT_REPLAN_GAIN,
    HEARTBEAT_S,
    LIVENESS,
    ClusterStatus,
    RefusalInfo,
)
from controlplane.security import CurveServer
from controlplane.shards import DEFAULT_CHUNK_SIZE, ShardError, ShardSource
from controlplane.sockets import router_socket
from controlplane.stage_planner import StagePlanner
from controlplane.wiring import PipelinePlan
from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.kv.blocks import sliding_tokens
from dataplane.wire.transport import PipeOptions
from zctl.endpoints import split_address, tcp_address
from zctl.engine.executor import Executor
from zctl.manifest import load_manifest
from zctl.paths import zctl_home

log = logging.getLogger("zctl.controlplane")
# heartbeats a spare must have been enrolled for, without a lapse, before it takes back
# stages a healed node carries (a node that flaps is not given stages to lose again)
REBALANCE_BEATS = 5
EVERY_INTERFACE = ("0.0.0.0", "*", "::", "")  # bind hosts no node can connect to


@dataclass
class CoordinatorConfig:
    """How the coordinator listens, paces heartbeats, places and ships shards."""

    endpoint: str = "tcp://*:5550"  # the control ROUTER binds here
    state_dir: Path = field(default_factory=lambda: zctl_home() / "coordinator")
    host: str | None = None  # address nodes reach this machine at; default: guessed
    data_port: int = 0  # return pipe (stage 0 inbound); 0: last used or a free one
    heartbeat_interval: float = HEARTBEAT_S
    liveness: int = LIVENESS  # heartbeats a node may miss before it is marked dead
    chunk_size: int = DEFAULT_CHUNK_SIZE
    expect_nodes: int | None = None  # remote nodes to wait for before placing; default stages-1
    placement: dict[int, str] = field(default_factory=dict)  # explicit {stage: node id}
    reassign_after: float | None = None  # move a down node's stage to a spare after s seconds
    # give a down node's stages to its live neighbours after s seconds when no spare can
    # take them (None: wait for the node or a spare)
    heal_after: float | None = 0.0
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    memory_limit: int = 0  # bytes of RAM this machine lends its stages (0: what is free)
    max_message_bytes: int = 1 << 20
    verify_export: bool = True
    curve: CurveServer | None = None  # CURVE authentication and encryption (optional)
    cluster_id: str = ""  # an embedded local cluster's identity: only its nodes enrol ("": any)
    profile: bool = True  # measure this machine's profile for the model when it has none
    profile_budget_s: float = BUDGET_S  # what a node's profile of one device may take
    probe_links: bool = True  # probe the links between the pipeline's neighbours
    link: PipeOptions | None = None  # the emulated link its data frames go over (its probes too)
    # the row groups its generation service steps streams in, for the running placement's
    # predicted speed (0: none; None: not known, the best for each stream count)
    row_groups: int | None = None
    replan_gain: float = DEFAULT_REPLAN_GAIN  # re-plan when predicted this much faster (0.1: 10%)
    # what the planner places for: one stream's speed (latency), or ``plan_streams``
    # streams' aggregate (throughput); KV is reserved for ``plan_streams`` streams either way
    objective: str = "latency"
    plan_streams: int = PLAN_STREAMS


def _member_identity(identity: bytes) -> str:
    return identity.decode("utf-8", "replace")


class Coordinator:
    """Control-plane server; ``start()`` runs it in a thread, ``run()`` in the caller's."""

    def __init__(self, export_dir: Path | str, config: CoordinatorConfig | None = None,
                 launcher: StageLauncher | None = None, source: ShardSource | None = None) -> None:
        """Load (and verify) the export; ``launcher`` starts stage 0 here (default: the
        data plane's ClusterHead); ``source`` serves shard chunks (default: the export).
        """
        self.config = config or CoordinatorConfig()
        cfg = self.config
        self.export_dir = Path(export_dir)
        self.manifest = load_manifest(self.export_dir, verify_files=cfg.verify_export)
        self.source = source or ShardSource(self.export_dir, self.manifest, cfg.chunk_size)
        cost = LayerCost.from_export(
            self.manifest, self.export_dir,
            sliding_tokens=sliding_tokens(cfg.runtime, self.manifest.model))
        self.launcher = launcher or head_launcher
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        self.node_id = load_or_create_node_id(cfg.state_dir)
        bind_host = endpoint_host(cfg.endpoint)
        self.host = cfg.host or (bind_host if bind_host not in EVERY_INTERFACE
                                 else route_host("192.0.2.1"))
        port = choose_data_port(self.host, cfg.state_dir, cfg.data_port)
        self.data_addr = tcp_address(self.host, port)
        self.openvino = openvino_version()
        self.zctl = zctl_version()
        self.session = uuid.uuid4().hex[:12]
        self.hashes = [self.manifest.stage_hash(i) for i in range(len(self.manifest.stages))]
        total, free = ram(cfg.memory_limit)
        # with CURVE the data pipes are encrypted too, the coordinator's key pair serving both
        data_key = cfg.curve.public.decode() if cfg.curve is not None else ""
        info = Enrol(self.node_id, self.host, self.data_addr, probe_devices(), total, free,
                     self.openvino, self.zctl, list(self.hashes), data_key=data_key)
        now = time.monotonic()
        me = ms.Member(self.node_id, self.node_id.encode(), info, ms.READY, now, local=True,
                       shards=set(self.hashes))
        self.members: dict[str, ms.Member] = {self.node_id: me}
        needs = stage_needs(self.manifest, self.export_dir, cost)
        self.plan = PipelinePlan(self.manifest, needs, self.node_id, cfg.runtime,
                                 cfg.expect_nodes, cfg.placement)
        self.refused: deque[tuple[str, str, str, float, str]] = deque(maxlen=32)
        self.counters: dict[str, int] = dict.fromkeys(
            ("received", "malformed", "unknown_type", "protocol_mismatch", "unexpected",
             "not_enrolled", "send_failed", "refused", "marked_dead", "chunks_served",
             "bad_requests", "handler_errors", "stale"), 0)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self.endpoint = ""
        self._started = now
        self.local = BackgroundStage(self.launcher, "zctl-stage0")  # stage 0, run here
        self.shape, self.profile_task = None, None
        try:
            self.shape = export_shape(self.manifest, self.export_dir)
            self.profile_task = ProfileTask(self.shape, self.manifest.weight_format,
                                            cfg.runtime.device, self.manifest.int8_form,
                                            self.manifest.exact_experts)
            self.plan.planner = StagePlanner(self.manifest, self.shape, needs, self.node_id,
                                             cfg.runtime.device, self.openvino, cfg.replan_gain,
                                             cfg.objective, cfg.plan_streams)
        except ShapeError as exc:
            log.warning("no profiles or link probes for this export: %s", exc)
            me.profile_state = f"failed: {exc}"
        self.profile = ProfileJob("coordinator", cfg.state_dir, cfg.profile, cfg.memory_limit,
                                  self.openvino)
        self.speed = ProfileSpeed(self.profile.store.anchor)
        self.links = LinkTable()
        self._echo: ProbeEcho | None = None
        self._probes = ThreadPoolExecutor(1, thread_name_prefix="zctl-coordinator-probe")
        self._probe_jobs: list[tuple[Probe, Future]] = []

    # -- lifecycle -----------------------------------------------------------------------
    def bind(self) -> str:
        """Bind the ROUTER (done by start/run); returns the endpoint nodes connect to."""
        if self._sock is not None:
            return self.endpoint
        sock = router_socket(self._ctx, self.config.max_message_bytes, handover=True,
                             send_hwm=10000)
        try:
            if self.config.curve is not None:
                self.config.curve.apply(sock, self._ctx)
            sock.bind(self.config.endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise OSError(f"coordinator cannot bind {self.config.endpoint}: {exc}") from None
        except BaseException:
            sock.close(0)
            raise
        self._sock = sock
        if self.config.probe_links:
            self._echo = ProbeEcho(self._ctx, self.host, self.config.link)
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        bound_host, port = split_address(bound)
        self.endpoint = tcp_address(self.host, port) if bound_host in EVERY_INTERFACE else bound
        log.info("coordinator %s listening on %s (data return pipe %s)", self.node_id,
                 self.endpoint, self.data_addr)
        return self.endpoint

    def start(self) -> str:
        endpoint = self.bind()
        self._thread = threading.Thread(target=self._loop, name="zctl-coordinator", daemon=True)
        self._thread.start()
        return endpoint

    def run(self) -> None:
        """Serve until stop() (from another thread) or KeyboardInterrupt."""
        self.bind()
        try:
            self._loop()
        except KeyboardInterrupt:
            log.info("coordinator interrupted")

    def stop(self, timeout: float = 5.0) -> None:
        """Say goodbye to the nodes, stop the local stage, close the socket."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        elif self._sock is not None:  # bound but never run
            self._shutdown()

    def wait_serving(self, timeout: float) -> ClusterStatus:
        """Block until the pipeline serves; raise TimeoutError naming what it waits for."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if status.pipeline == "serving":
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"pipeline is {status.pipeline} after {timeout:.0f}s"
                                   + (f": {status.plan_error}" if status.plan_error else ""))
            time.sleep(0.02)

    # -- loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        assert self._sock is not None
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        tick = self.config.heartbeat_interval / 8  # a verdict is at most 1/8 beat late
        if self.profile_task is not None:
            with self._lock:
                self._own_profile(self.profile.request(self.profile_task,
                                                       self.config.profile_budget_s))
        try:
            while not self._stop.is_set():
                if poller.poll(int(tick * 1000)):
                    for _ in range(256):  # bounded drain so ticks are never starved
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        with self._lock:
                            self._receive(frames)
                with self._lock:
                    self._tick(time.monotonic())
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        with self._lock:
            for member in self.members.values():
                if not member.local and member.alive:
                    self._send(member.identity, Leave("coordinator shutting down"))
        self.local.stop()
        self.profile.stop()
        if self.plan.planner is not None:
            self.plan.planner.search.close()  # a search in flight ends unheard
        self._probes.shutdown(wait=True)
        if self._echo is not None:
            self._echo.close()
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self.config.curve is not None:
            self.config.curve.stop()
        self._ctx.term()

    def _send(self, identity: bytes, msg: Message, payload: bytes | None = None) -> bool:
        assert self._sock is not None
        try:
            self._sock.send_multipart([identity, *to_frames(msg, payload)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.counters["send_failed"] += 1
            log.debug("cannot send %s to %r: %s", type_tag(msg), identity, exc)
            return False
        member = self.members.get(_member_identity(identity))
        if member is not None and member.identity == identity:
            member.last_sent = time.monotonic()
        return True

    # -- receiving -----------------------------------------------------------------------
    def _receive(self, frames: list[bytes]) -> None:
        self.counters["received"] += 1
        identity, body = frames[0], frames[1:]
        member = self.members.get(_member_identity(identity))
        if member is not None and (member.identity != identity or member.local):
            member = None
        if member is not None and member.alive:
            member.heard(time.monotonic(), self.config.heartbeat_interval)  # any traffic counts
        try:
            msg, payload = from_frames(body)
        except ProtocolMismatch as exc:
            self.counters["protocol_mismatch"] += 1
            self._protocol_mismatch(identity, exc)
            return
        except UnknownMessage as exc:
            self.counters["unknown_type"] += 1
            log.warning("unknown message from %r: %s", identity[:64], exc)
            self._send(identity, Error("unknown-type", str(exc)))
            return
        except MessageError as exc:
            self.counters["malformed"] += 1
            log.warning("malformed message from %r: %s", identity[:64], exc)
            self._send(identity, Error("malformed", str(exc)))
            return
        try:
            self._dispatch(identity, member, msg)
        except Exception as exc:  # noqa: BLE001 - one bad message must not stop the cluster
            self.counters["handler_errors"] += 1
            log.exception("handling %s from %r failed", type_tag(msg), identity[:64])
            self._send(identity, Error("internal", f"{type(exc).__name__}: {exc}", type_tag(msg)))

    def _dispatch(self, identity: bytes, member: ms.Member | None, msg: Message) -> None:
        if isinstance(msg, Enrol):
            self._on_enrol(identity, msg)
        elif isinstance(msg, StatusRequest):
            self._send(identity, StatusReply(self._status()))
        elif isinstance(msg, Error):
            log.warning("node %r reports error %s: %s", identity[:64], msg.code, msg.detail)
        elif member is None or not member.alive:
            if not isinstance(msg, Leave):
                self.counters["not_enrolled"] += 1
                self._send(identity, Error("not-enrolled", "this node is not enrolled (or was "
                                           "marked dead): enrol again", type_tag(msg)))
        elif isinstance(msg, Heartbeat):
            member.kv_slots = msg.kv_slots
            if msg.reference_s:
                member.reference_s = msg.reference_s
        elif isinstance(msg, Leave):
            log.info("node %s left: %s", member.node_id, msg.reason or "no reason given")
            member.mark_down(ms.LEFT, time.monotonic())
        elif isinstance(msg, ShardRequest):
            self._on_shard_request(member, msg)
        elif isinstance(msg, ShardDone):
            self._on_shard_done(member, msg)
        elif isinstance(msg, StageReady):
            self._on_stage_ready(member, msg)
        elif isinstance(msg, ProfileReport):
            self._on_profile_report(member, msg)
        elif isinstance(msg, LinkReport):
            figures = (LinkProfile(msg.rtt_s, msg.forward_bps, msg.backward_bps) if msg.ok
                       else None)
            if not self.links.result(msg.probe_id, member.node_id, figures, msg.error):
                self.counters["stale"] += 1
        else:
            self.counters["unexpected"] += 1
            self._send(identity, Error("unexpected", f"a node does not send {type_tag(msg)}", type_tag(msg)))

    def _refuse(self, identity: bytes, node_id: str, host: str, code: str, reason: str) -> None:
        self.counters["refused"] += 1
        self.refused.append((node_id, host, reason, time.monotonic(), code))
        log.warning("refused node %s: %s", node_id, reason)
        self._send(identity, Refuse(code, reason, node_id))

    def _protocol_mismatch(self, identity: bytes, exc: ProtocolMismatch) -> None:
        if exc.msg_type == Enrol.TYPE:
            node_id = peer_node_id(exc)
            host = exc.body.get("host") if isinstance(exc.body.get("host"), str) else "?"
            self._refuse(identity, node_id, host, "protocol-version",
                         f"node {node_id} speaks control protocol {exc.theirs!r} but the "
                         f"coordinator speaks {PROTOCOL_VERSION}; run the same zctl release "
                         "on every node")
        else:
            self._send(identity, Error("protocol-version", str(exc), exc.msg_type))

    def _on_enrol(self, identity: bytes, msg: Enrol) -> None:
        if ms.replaced_connection(identity):  # stale: not refused, the node is back already
            log.info("node %s: an enrolment from its replaced connection dropped", msg.node_id)
            return
        refusal = ms.enrol_refusal(msg, identity, self.node_id, self.openvino,
                                   self.config.curve is not None, self.config.cluster_id)
        if refusal is not None:
            self._refuse(identity, msg.node_id, msg.host, *refusal)
            return
        if msg.zctl != self.zctl:
            log.warning("node %s runs zctl %s, the coordinator %s", msg.node_id, msg.zctl,
                        self.zctl)
        now = time.monotonic()
        member = self.members.get(msg.node_id)
        if member is None:
            member = ms.Member(msg.node_id, identity, msg, ms.IDLE, now)
            self.members[msg.node_id] = member
            log.info("node %s enrolled from %s (%d device(s), data %s)", msg.node_id,
                     msg.host, len(msg.devices), msg.data_addr)
        else:
            log.info("node %s re-enrolled (was %s)", msg.node_id, member.state)
            member.enrolments += 1
        member.identity, member.info, member.state, member.last_seen = identity, msg, ms.IDLE, now
        member.enrolled_at = now
        member.shards = set(msg.cached_shards)
        member.offered, member.assigned, member.ready_epoch, member.error = None, None, -1, ""
        member.served, member.transfer_total, member.kv_slots = {}, 0, -1
        member.lapses.clear()
        self._send(identity, Welcome(msg.node_id, self.node_id, self.session,
                                     self.config.heartbeat_interval, self.config.liveness))
        if self.profile_task is not None:
            task = self.profile_task
            self._send(identity, ProfileRequest(task.shape, task.weights, task.device,
                                                self.config.profile_budget_s, task.int8_form,
                                                task.exact_experts))

    def _on_shard_request(self, member: ms.Member, msg: ShardRequest) -> None:
        if member.offered != msg.shard_hash:
            self.counters["bad_requests"] += 1
            self._send(member.identity, Error("bad-request", f"shard {msg.shard_hash[:12]} "
                                              "was not offered to this node", type_tag(msg)))
            return
        try:
            chunk, data = self.source.read_chunk(msg)
        except (ShardError, OSError) as exc:
            self.counters["bad_requests"] += 1
            self._send(member.identity, Error("bad-request", str(exc), type_tag(msg)))
            return
        if self._send(member.identity, chunk, data):
            self.counters["chunks_served"] += 1
            member.served[(msg.file, msg.chunk)] = msg.size

    def _on_shard_done(self, member: ms.Member, msg: ShardDone) -> None:
        if member.offered != msg.shard_hash:
            self.counters["stale"] += 1
            return
        member.offered = None
        quiet = member.state in (ms.SERVING, ms.WIRING)  # fetched for a pending re-plan
        if msg.ok:
            member.shards.add(msg.shard_hash)
            if not quiet:
                member.state, member.error = ms.READY, ""
            log.info("node %s holds shard %s (%s)", member.node_id, msg.shard_hash[:12],
                     "cached" if msg.cached else "transferred")
        elif quiet:
            self.plan.abandon(f"node {member.node_id} could not fetch shard "
                              f"{msg.shard_hash[:12]}: {msg.error}")
        else:
            member.state, member.error = ms.FAILED, msg.error
            log.error("node %s could not fetch shard %s: %s", member.node_id,
                      msg.shard_hash[:12], msg.error)

    def _on_profile_report(self, member: ms.Member, msg: ProfileReport) -> None:
        if self.profile_task is None:
            return
        record, state = report_outcome(msg, self.profile_task, member.info.openvino)
        member.profile_answered = True
        if record is not None or state != "measuring" or member.profile is None:
            member.profile, member.profile_state = record, state
        if state.startswith("failed"):
            log.warning("node %s: no profile: %s", member.node_id, state)

    def _own_profile(self, report: ProfileReport) -> None:
        me = self.members[self.node_id]
        assert self.profile_task is not None
        record, me.profile_state = report_outcome(report, self.profile_task, self.openvino)
        me.profile = self.speed.hold(record)
        me.profile_answered = True

    def _on_stage_ready(self, member: ms.Member, msg: StageReady) -> None:
        if member.assigned is None or msg.epoch != member.assigned.epoch:
            self.counters["stale"] += 1
            return
        self._stage_result(member, msg.epoch, msg.ok, msg.error)

    def _stage_result(self, member: ms.Member, epoch: int, ok: bool, error: str) -> None:
        if ok:
            member.state, member.ready_epoch, member.error = ms.SERVING, epoch, ""
            log.info("node %s serves stage %s (epoch %d)", member.node_id, member.stage, epoch)
        else:
            member.state, member.error = ms.FAILED, error
            log.error("node %s cannot run stage %s: %s", member.node_id, member.stage, error)

    # -- periodic work -------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        cfg = self.config
        for member in self.members.values():
            verdict = ms.silence_verdict(member, now, cfg.heartbeat_interval, cfg.liveness)
            if verdict is not None:
                member.mark_down(ms.DEAD, now)
                self.counters["marked_dead"] += 1
                log.warning("node %s %s: marked dead", member.node_id, verdict)
            elif ms.beat_due(member, now, cfg.heartbeat_interval):
                self._send(member.identity, Heartbeat(member.state))
        self._collect_local_jobs()
        self._advance()
        report = self.profile.finished()
        if report is not None:
            self._own_profile(report)
        me = self.members[self.node_id]
        anchored = self.speed.poll()  # its profile's speed, checked again now and then
        if anchored is not None:  # with the reference time its first checks took
            me.profile = anchored
        me.reference_s = self.speed.latest_s
        self._probe_links(now)
        if self.config.curve is not None:
            self.config.curve.maybe_reload()

    # -- links -----------------------------------------------------------------------------
    def _probe_links(self, now: float) -> None:
        """Probe the links of a newly wired pipeline once it serves; take finished probes'
        figures; mark overdue ones."""
        while self._probe_jobs and self._probe_jobs[0][1].done():
            job, future = self._probe_jobs.pop(0)
            error = future.exception()
            self.links.result(job.probe_id, job.a, future.result() if error is None else None,
                              str(error or ""))
        self.links.expire(now)
        plan = self.plan
        if (not self.config.probe_links or self.shape is None or plan.plan is None
                or plan.state(self.members) != "serving"):
            return
        chain = [node for node, _ in hosts(plan.plan)]
        spares = [m.node_id for m in self.members.values()
                  if m.alive and not m.local and m.node_id not in chain]
        addrs = {m.node_id: m.info.probe_addr for m in self.members.values()}
        addrs[self.node_id] = self._echo.endpoint if self._echo else ""
        refused = ("links of a --curve cluster are not probed (the probe endpoint is not "
                   "encrypted)" if self.config.curve is not None else "")
        sizes = probe_sizes(self.shape)
        for job in self.links.due(plan.epoch, chain, addrs, sizes, now, refused, spares):
            if job.a == self.node_id:
                self._probe_jobs.append((job, self._probes.submit(self._probe_own, job, sizes)))
            else:
                self._send(self.members[job.a].identity, LinkProbe(
                    job.probe_id, job.b, job.b_addr, sizes, self.links.rounds,
                    self.links.timeout_s))

    def _probe_own(self, job: Probe, sizes: list[int]) -> LinkProfile:
        """Time this machine's link to ``job.b`` (on the probe thread)."""
        return link_from_samples(probe(self._ctx, job.b_addr, sizes, self.links.rounds,
                                       self.links.timeout_s, self.config.link,
                                       stop=self._stop))

    def _advance(self) -> None:
        now = time.monotonic()
        links = self.links.status()
        if not self.plan.try_plan(self.members, links, now):
            return
        cfg = self.config
        if cfg.reassign_after is not None:
            self.plan.reassign(self.members, now, cfg.reassign_after)
        if cfg.heal_after is not None:
            self.plan.heal(self.members, now, cfg.heal_after,
                           spares_first=cfg.reassign_after is not None)
        self.plan.rebalance(self.members, now, REBALANCE_BEATS * cfg.heartbeat_interval, links,
                            give_back=cfg.heal_after is not None)
        for member, stage in self.plan.offers_due(self.members):
            self._offer(member, stage, quiet=False)
        for member, stage, quiet in self.plan.pending_offers(self.members):
            self._offer(member, stage, quiet)
        for member in self.plan.releases(self.members):
            self._send(member.identity, Release("a re-plan leaves this node out: a spare now"))
            member.assigned, member.ready_epoch = None, -1
            if member.state in ms.HAS_SHARD:
                member.state = ms.IDLE
        for member, msg in self.plan.assignments(self.members):
            if member.local:
                member.state = ms.WIRING
                self._launch_local(msg)
            elif self._send(member.identity, msg):
                member.state = ms.WIRING

    def _offer(self, member: ms.Member, stage: int, quiet: bool) -> None:
        """Offer ``stage``'s shard; ``quiet``: the node runs a stage, which the fetch leaves
        running (its state stays as it is)."""
        offer = self.source.offer_for(stage)
        member.offered, member.served = offer.shard_hash, {}
        member.transfer_total = (0 if offer.shard_hash in member.shards
                                 else sum(f.size for f in offer.files))
        if self._send(member.identity, offer) and not quiet:
            member.state = ms.TRANSFERRING

    # -- the local stage (node 0) ----------------------------------------------------------
    def _launch_local(self, msg: AssignStage) -> None:
        curve = self.config.curve
        assignment = StageAssignment.from_message(
            msg, self.export_dir, None if curve is None else (curve.public, curve.secret))
        self.local.submit(msg.epoch, assignment)

    def _collect_local_jobs(self) -> None:
        me = self.members[self.node_id]
        for epoch, error in self.local.finished():
            if error is not None:
                log.error("starting the local stage failed: %s", error)
            if me.assigned is not None and epoch == me.assigned.epoch:
                self._stage_result(me, epoch, error is None,
                                   "" if error is None else f"{type(error).__name__}: {error}")

    @property
    def local_handle(self) -> StageHandle | None:
        """The running stage-0 handle (whatever the launcher returned), if wired."""
        return self.local.handle

    def stage0_executor(self) -> Executor | None:
        """The data plane's executor of stage 0 (a ``HeadHandle``'s ClusterHead) when wired;
        what the generation service drives."""
        handle = self.local.handle
        return handle.head if isinstance(handle, HeadHandle) else None

    # -- status --------------------------------------------------------------------------
    def _status(self) -> ClusterStatus:
        now = time.monotonic()
        plan = self.plan
        status = ClusterStatus(
            coordinator_id=self.node_id, session=self.session, endpoint=self.endpoint,
            protocol=PROTOCOL_VERSION, openvino=self.openvino, zctl=self.zctl,
            export_dir=str(self.export_dir), model=self.manifest.model.name,
            pipeline=plan.state(self.members), epoch=plan.epoch,
            uptime_s=round(now - self._started, 3), plan_error=plan.plan_error,
            nodes=[m.status(now) for m in self.members.values()],
            stages=plan.stage_status(self.members),
            refused=[RefusalInfo(n, h, r, round(now - t, 3), c) for n, h, r, t, c in self.refused],
            counters=dict(self.counters), runtime=self.config.runtime,
            curve=self.config.curve is not None, time_s=time.time(),
            heartbeat_interval=self.config.heartbeat_interval, liveness=self.config.liveness,
            shape=self.shape, links=self.links.status(), placement=plan.describe(),
            replan=plan.last_replan, left_out=dict(plan.left_out))
        return replace(status, prediction=running_prediction(status, self.config.row_groups))

    def status(self) -> ClusterStatus:
        """A consistent snapshot (thread-safe)."""
        with self._lock:
            return self._status()

    def pipeline_problem(self) -> str | None:
        """Why the wired pipeline cannot run steps now (PipelinePlan.problem; thread-safe)."""
        with self._lock:
            return self.plan.problem(self.members)

    def status_dict(self) -> dict[str, Any]:
        return self.status().to_dict()
