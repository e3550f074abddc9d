"""The node agent: a DEALER that enrols with the coordinator, caches shards, runs a stage.

Paranoid Pirate on the node side: any traffic from the coordinator counts as a heartbeat;
after ``liveness`` silent intervals the agent closes its socket and reconnects with
exponential backoff (``reconnect_min`` to ``reconnect_max``), first asking its ``locator``
(when given: a node that found its cluster on the LAN) where the coordinator is announced
now; the locator answers at once, and closes with the agent. The node id
(``<state_dir>/node_id``) is also the socket's routing id, so a restarted node reclaims its
place. Slow work (hashing a cached shard, compiling a stage) runs on a worker thread so
heartbeats never stall; a profile is measured in a process of its own
(controlplane/profile_job.py) and a link probed on a thread of its own, both reported when
done. The node answers probes of its links at its probe endpoint (an echo,
controlplane/link_probe.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import zmq

from controlplane.host_speed import ProfileSpeed
from controlplane.launch import (
    LaunchError,
    StageAssignment,
    StageHandle,
    StageLauncher,
    StageSlot,
    default_launcher,
)
from controlplane.link_probe import ProbeEcho, ProbeError, probe
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
    ShardChunk,
    ShardDone,
    ShardOffer,
    StageReady,
    Welcome,
    from_frames,
    refusal_text,
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
from controlplane.planner.measured import link_from_samples
from controlplane.planner.profile import ProfileError
from controlplane.profile_job import ProfileJob, ProfileTask
from controlplane.records import HEARTBEAT_S, LIVENESS, StageInfo
from controlplane.security import CurveClient
from controlplane.shards import Download, ShardCache, ShardError
from controlplane.sockets import dealer_socket
from dataplane.wire.transport import PipeOptions
from zctl.endpoints import tcp_address
from zctl.manifest import ManifestError, load_manifest
from zctl.paths import zctl_home

log = logging.getLogger("zctl.controlplane")

ProgressCallback = Callable[[str, int, int], None]  # (shard hash, bytes done, bytes total)


class CoordinatorLocator(Protocol):
    """Where a cluster's coordinator is now (a LAN watch: zctl.discovery.browser)."""

    def locate(self) -> str | None:
        """Its control endpoint now, without waiting; None when not known."""
        ...

    def close(self) -> None:
        """Stop looking (the agent calls it when it stops)."""
        ...


@dataclass
class AgentConfig:
    """Where the coordinator is, where this node keeps state, and its timing knobs."""

    coordinator: str  # the coordinator's control endpoint, e.g. tcp://10.0.0.1:5550
    state_dir: Path = field(default_factory=lambda: zctl_home() / "node")
    data_host: str | None = None  # address other nodes reach this one at; default: guessed
    data_port: int = 0  # inbound data pipe; 0: the one used last time, else a free one
    heartbeat_interval: float = HEARTBEAT_S  # until the coordinator's Welcome sets it
    liveness: int = LIVENESS
    reconnect_min: float = 1.0
    reconnect_max: float = 32.0
    window: int = 8  # shard chunk requests in flight (credit-based flow)
    chunk_timeout: float = 10.0
    chunk_retries: int = 5
    tok_s: float | None = None  # measured speed, if known (placement uses it)
    memory_limit: int = 0  # bytes of RAM this node lends its stages (0: what is free)
    openvino: str | None = None  # reported OpenVINO version; default: the installed one
    protocol: int = PROTOCOL_VERSION  # overridable only to test refusals
    max_message_bytes: int = 64 << 20
    curve: CurveClient | None = None
    cluster_id: str = ""  # the local cluster it was started for ("": whichever it joins)
    profile: bool = True  # measure its profile for a model it has none of, when asked
    link: PipeOptions | None = None  # the emulated link its data frames go over (its probes too)
    # where the coordinator is now, asked before each reconnection (a node that found its
    # cluster by discovery finds it again when it moves); None or a None answer: the same
    locator: CoordinatorLocator | None = None


class NodeAgent:
    """One node; ``start()`` runs it in a thread, ``run()`` in the caller's."""

    def __init__(self, config: AgentConfig, launcher: StageLauncher | None = None,
                 on_progress: ProgressCallback | None = None) -> None:
        self.config = config
        config.state_dir.mkdir(parents=True, exist_ok=True)
        self.node_id = load_or_create_node_id(config.state_dir)
        self.cache = ShardCache(config.state_dir / "shards")
        self.launcher = launcher or default_launcher
        self.on_progress = on_progress
        host = config.data_host or route_host(endpoint_host(config.coordinator))
        self.host = host
        port = choose_data_port(host, config.state_dir, config.data_port)
        self.data_addr = tcp_address(host, port)
        self.openvino = config.openvino or openvino_version()
        self.devices = probe_devices()
        self.state = "disconnected"  # enrolling, enrolled, refused, stopped
        self.refusal: str | None = None
        self.coordinator_id = ""
        self.coordinator = config.coordinator  # the control endpoint it joins (or rejoins)
        self.counters: dict[str, int] = dict.fromkeys(
            ("received", "malformed", "protocol_mismatch", "unexpected", "reconnects",
             "chunks_rejected", "enrolments"), 0)
        self._interval = config.heartbeat_interval
        self._liveness = config.liveness
        self._backoff = config.reconnect_min
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._session = 0
        self._last_sent = 0.0
        self._last_enrol = 0.0
        self._download: Download | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="zctl-agent-work")
        self._jobs: list[_Job] = []
        self.slot = StageSlot(self.launcher)
        self.profile = ProfileJob(f"node {self.node_id}", config.state_dir, config.profile,
                                  config.memory_limit, self.openvino)
        self.profile_state = "not profiled yet"
        self.speed = ProfileSpeed(self.profile.store.anchor)
        self._echo: ProbeEcho | None = None
        self._probes = ThreadPoolExecutor(1, thread_name_prefix="zctl-agent-probe")
        self._probe_jobs: list[tuple[LinkProbe, Future]] = []

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"zctl-agent-{self.node_id}",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Leave the cluster, stop the stage, close the socket and the locator; a link
        probe in flight ends within link_probe.POLL_MS (it waits on the same stop)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def handle(self) -> StageHandle | None:
        return self.slot.handle

    @property
    def assignment(self) -> StageAssignment | None:
        return self.slot.assignment

    def run(self) -> None:
        """Connect, serve, reconnect with backoff; returns when stopped or refused."""
        try:
            self._echo = ProbeEcho(self._ctx, self.host, self.config.link)
            while not self._stop.is_set():
                self._connect()
                outcome = self._serve()
                if outcome != "lost":
                    break
                self._close()
                self.counters["reconnects"] += 1
                self.state = "disconnected"
                log.warning("node %s: coordinator %s silent; reconnecting in %.1fs",
                            self.node_id, self.coordinator, self._backoff)
                if self._stop.wait(self._backoff):
                    break
                self._backoff = min(self._backoff * 2, self.config.reconnect_max)
                self._relocate()
        finally:
            if self._sock is not None and self.state == "enrolled":
                self._send(Leave("node stopping"))
            self._close()
            self.profile.stop()
            self._executor.shutdown(wait=True)
            self._probes.shutdown(wait=True)
            if self._echo is not None:
                self._echo.close()
            self.slot.stop()
            self._ctx.term()
            if self.config.locator is not None:
                self.config.locator.close()
            if self.state != "refused":
                self.state = "stopped"

    def _relocate(self) -> None:
        """Ask ``config.locator`` where the coordinator is now, and follow it there."""
        if self.config.locator is None:
            return
        found = self.config.locator.locate()
        if found and found != self.coordinator:
            log.warning("node %s: the coordinator moved from %s to %s", self.node_id,
                        self.coordinator, found)
            self.coordinator = found

    def _connect(self) -> None:
        self._session += 1
        sock = dealer_socket(self._ctx, self.config.max_message_bytes, self.node_id.encode())
        if self.config.curve is not None:
            self.config.curve.apply(sock)
        sock.connect(self.coordinator)
        self._sock = sock
        self.state = "enrolling"
        self.speed.hold(None)  # until this session's coordinator asks for its profile
        self._interval, self._liveness = self.config.heartbeat_interval, self.config.liveness
        self._enrol()

    def _close(self) -> None:
        if self._download is not None:
            self._download.abort()
            self._download = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def _enrol(self) -> None:
        self._last_enrol = time.monotonic()
        total, free = ram(self.config.memory_limit)
        self.counters["enrolments"] += 1
        curve = self.config.curve  # with CURVE, its key pair also guards the data pipes
        self._send(Enrol(self.node_id, self.host, self.data_addr, self.devices, total, free,
                         self.openvino, zctl_version(), self.cache.hashes(), self.config.tok_s,
                         data_key="" if curve is None else curve.public.decode(),
                         cluster_id=self.config.cluster_id,
                         probe_addr=self._echo.endpoint if self._echo else ""))

    def _send(self, msg: Message, payload: bytes | None = None) -> None:
        assert self._sock is not None
        try:
            self._sock.send_multipart(to_frames(msg, payload, self.config.protocol), zmq.NOBLOCK)
            self._last_sent = time.monotonic()
        except zmq.ZMQError as exc:  # queue full while the coordinator is away
            log.debug("node %s cannot send %s: %s", self.node_id, type_tag(msg), exc)

    # -- session -------------------------------------------------------------------------
    def _serve(self) -> str:
        """One connection's life; returns 'lost', 'refused' or 'stopped'."""
        assert self._sock is not None
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        last_recv = time.monotonic()
        while not self._stop.is_set():
            if poller.poll(int(self._interval * 250)):
                for _ in range(256):
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    last_recv = time.monotonic()
                    outcome = self._handle_frames(frames)
                    if outcome is not None:  # refused, or the coordinator said goodbye
                        return outcome
            now = time.monotonic()
            if now - last_recv > self._interval * self._liveness:
                return "lost"
            if self.state == "enrolled":
                anchored = self.speed.poll()  # its profile's speed, checked again now and then
                if anchored is not None:  # with the reference time its first checks took
                    self._send(ProfileReport(self.profile_state, anchored))
            if self.state == "enrolled" and now - self._last_sent >= self._interval:
                self._send(Heartbeat(self.state, self._kv_slots(), self.speed.latest_s))
            self._collect_jobs()
            self._collect_measurements()
            self._request_chunks()
        return "stopped"

    def _handle_frames(self, frames: list[bytes]) -> str | None:
        self.counters["received"] += 1
        try:
            msg, payload = from_frames(frames)
        except ProtocolMismatch as exc:
            reason = refusal_text(exc)
            if reason is not None:
                return self._refused(reason)
            self.counters["protocol_mismatch"] += 1
            log.warning("node %s: %s", self.node_id, exc)
            return None
        except MessageError as exc:
            self.counters["malformed"] += 1
            log.warning("node %s dropped a bad message from the coordinator: %s", self.node_id, exc)
            self._send(Error("malformed", str(exc)))
            return None
        try:
            return self._dispatch(msg, payload)
        except Exception as exc:  # noqa: BLE001 - a bad message must not kill the node
            log.exception("node %s: handling %s failed", self.node_id, type_tag(msg))
            self._send(Error("internal", f"{type(exc).__name__}: {exc}", type_tag(msg)))
            return None

    def _refused(self, reason: str) -> str:
        self.refusal = reason
        self.state = "refused"
        log.error("node %s refused by the coordinator: %s", self.node_id, reason)
        return "refused"

    def _dispatch(self, msg: Message, payload: bytes | None) -> str | None:
        if isinstance(msg, Welcome):
            self.state, self.coordinator_id = "enrolled", msg.coordinator_id
            self._interval, self._liveness = msg.heartbeat_interval, msg.liveness
            self._backoff = self.config.reconnect_min
            log.info("node %s enrolled with coordinator %s", self.node_id, msg.coordinator_id)
        elif isinstance(msg, Refuse):
            return self._refused(msg.reason)
        elif isinstance(msg, Heartbeat):
            pass
        elif isinstance(msg, Leave):
            log.info("node %s: coordinator left (%s)", self.node_id, msg.reason)
            self._backoff = self.config.reconnect_min
            return "lost"  # treated as lost: reconnect (with backoff) until it is back
        elif isinstance(msg, ShardOffer):
            self._on_offer(msg)
        elif isinstance(msg, ShardChunk):
            assert payload is not None
            self._on_chunk(msg, payload)
        elif isinstance(msg, AssignStage):
            curve = self.config.curve
            assignment = StageAssignment.from_message(
                msg, self.cache.path(msg.shard_hash),
                None if curve is None else (curve.public, curve.secret),
                tuple(self.cache.path(h) for h in msg.more_hashes))
            self._submit("stage", msg, self._launch, assignment, msg)
        elif isinstance(msg, Release):
            log.info("node %s released from its stage: %s", self.node_id, msg.reason)
            self._submit("released", None, self.slot.stop)
        elif isinstance(msg, ProfileRequest):
            task = ProfileTask(msg.shape, msg.weights, msg.device, msg.int8_form,
                               msg.exact_experts)
            report = self.profile.request(task, msg.budget_s)
            self._send(self._profiled(report))
        elif isinstance(msg, LinkProbe):
            self._probe_jobs.append((msg, self._probes.submit(self._probe_link, msg)))
        elif isinstance(msg, Error):
            if msg.code == "not-enrolled":
                if time.monotonic() - self._last_enrol >= self._interval:  # once per burst
                    self._enrol()
            else:
                log.warning("node %s: coordinator rejected %s: %s %s", self.node_id,
                            msg.ref_type or "a message", msg.code, msg.detail)
        else:
            self.counters["unexpected"] += 1
            self._send(Error("unexpected", f"a coordinator does not send {type_tag(msg)}", type_tag(msg)))
        return None

    # -- shards --------------------------------------------------------------------------
    def _on_offer(self, offer: ShardOffer) -> None:
        if self._download is not None:
            self._download.abort()
            self._download = None
        if offer.chunk_size + 4096 > self.config.max_message_bytes:
            self._send(ShardDone(offer.shard_hash, False, error=(
                f"chunk size {offer.chunk_size} exceeds this node's message limit "
                f"{self.config.max_message_bytes}; use smaller chunks")))
            return
        if self.cache.has(offer.shard_hash):
            self._submit("cached", offer, self._check_cached, offer)
        else:
            self._begin_download(offer)

    def _check_cached(self, offer: ShardOffer) -> bool:
        if self.cache.verify(offer):
            return True
        log.warning("node %s: cached shard %s is damaged; fetching it again", self.node_id,
                    offer.shard_hash[:12])
        self.cache.remove(offer.shard_hash)
        return False

    def _begin_download(self, offer: ShardOffer) -> None:
        try:
            self._download = Download(self.cache, offer, self.config.chunk_retries,
                                      self.config.chunk_timeout)
        except (ShardError, OSError) as exc:
            self._send(ShardDone(offer.shard_hash, False, error=str(exc)))
            return
        log.info("node %s fetching shard %s (%d bytes)", self.node_id, offer.shard_hash[:12],
                 self._download.bytes_total)
        self._request_chunks()

    def _request_chunks(self) -> None:
        download = self._download
        if download is None or download.complete:
            return
        try:
            requests = download.requests(self.config.window)
        except ShardError as exc:
            self._fail_download(str(exc))
            return
        for request in requests:
            self._send(request)

    def _on_chunk(self, msg: ShardChunk, payload: bytes) -> None:
        download = self._download
        if download is None or msg.shard_hash != download.offer.shard_hash:
            return  # left over from an aborted transfer
        rejected = download.rejected
        try:
            written = download.accept(msg, payload)
        except ShardError as exc:
            self._fail_download(str(exc))
            return
        if download.rejected > rejected:
            self.counters["chunks_rejected"] += 1
            log.warning("node %s: chunk %d of %s failed its sha256; requesting it again",
                        self.node_id, msg.chunk, msg.file)
        if written and self.on_progress is not None:
            self.on_progress(msg.shard_hash, download.bytes_done, download.bytes_total)
        if download.complete:
            self._download = None
            self._submit("downloaded", download.offer, download.finalize)
        else:
            self._request_chunks()

    def _fail_download(self, error: str) -> None:
        assert self._download is not None
        shard_hash = self._download.offer.shard_hash
        self._download.abort()
        self._download = None
        log.error("node %s: shard %s failed: %s", self.node_id, shard_hash[:12], error)
        self._send(ShardDone(shard_hash, False, error=error))

    # -- background jobs -----------------------------------------------------------------
    def _submit(self, kind: str, context: Any, fn: Callable[..., Any], *args: Any) -> None:
        self._jobs.append(_Job(self._session, kind, context, self._executor.submit(fn, *args)))

    def _collect_jobs(self) -> None:
        while self._jobs and self._jobs[0].future.done():
            job = self._jobs.pop(0)
            if job.session != self._session:
                continue  # the coordinator connection that asked for it is gone
            error = job.future.exception()
            if job.kind == "cached":
                if error is None and job.future.result():
                    self._send(ShardDone(job.context.shard_hash, True, cached=True))
                else:
                    self._begin_download(job.context)
            elif job.kind == "downloaded":
                if error is None:
                    log.info("node %s cached shard %s", self.node_id, job.context.shard_hash[:12])
                    self._send(ShardDone(job.context.shard_hash, True))
                else:
                    log.error("node %s: %s", self.node_id, error)
                    self._send(ShardDone(job.context.shard_hash, False, error=str(error)))
            elif job.kind == "stage":
                msg: AssignStage = job.context
                text = "" if error is None else (
                    str(error) if isinstance(error, LaunchError | ManifestError)
                    else f"{type(error).__name__}: {error}")
                self._send(StageReady(msg.epoch, msg.stage.index, error is None, text))

    # -- profile and links -----------------------------------------------------------------
    def _probe_link(self, msg: LinkProbe) -> LinkReport:
        """Time the link to ``msg.peer`` (on the probe thread)."""
        try:
            link = link_from_samples(probe(self._ctx, msg.peer_addr, msg.sizes, msg.rounds,
                                           msg.timeout_s, self.config.link, stop=self._stop))
        except (ProbeError, ProfileError) as exc:
            return LinkReport(msg.probe_id, msg.peer, False, error=str(exc))
        return LinkReport(msg.probe_id, msg.peer, True, link.rtt_s, link.forward_bps,
                          link.backward_bps)

    def _profiled(self, report: ProfileReport) -> ProfileReport:
        """Note a profile report's state, and its profile, whose speed the node checks now
        and then (controlplane/host_speed.py); the report as the coordinator should have
        it (with the reference time this node anchored the profile at, if it did)."""
        self.profile_state = report.state
        return replace(report, profile=self.speed.hold(report.profile))

    def _collect_measurements(self) -> None:
        """Send a finished profile's and finished probes' reports."""
        report = self.profile.finished()
        if report is not None:
            report = self._profiled(report)
            if self.state == "enrolled":
                self._send(report)
        while self._probe_jobs and self._probe_jobs[0][1].done():
            msg, future = self._probe_jobs.pop(0)
            error = future.exception()
            self._send(future.result() if error is None else LinkReport(
                msg.probe_id, msg.peer, False, error=f"{type(error).__name__}: {error}"))

    # -- the stage -----------------------------------------------------------------------
    def _launch(self, assignment: StageAssignment, msg: AssignStage) -> None:
        """Start (or keep) the assigned stage; runs on the worker thread."""
        dirs = [assignment.runner_dir, *assignment.more_dirs]
        for info, shard_hash, runner_dir in zip(msg.stages, msg.shard_hashes, dirs, strict=True):
            if not self.cache.has(shard_hash):
                raise LaunchError(f"shard {shard_hash[:12]} of stage {info.index} is not "
                                  "cached here")
            check_runner_dir(runner_dir, info, shard_hash, msg.num_stages)
        self.slot.apply(assignment)
        stages = ", ".join(str(i.index) for i in msg.stages)
        log.info("node %s runs stage %s: bind %s, send to %s", self.node_id, stages,
                 assignment.bind, assignment.send_to)

    def _kv_slots(self) -> int:
        """KV slots the running stage holds (its handle's ``kv_slots()``); -1 when none runs
        or it cannot say."""
        handle = self.slot.handle
        if handle is None:
            return -1
        try:
            return int(handle.kv_slots())
        except Exception:  # noqa: BLE001 - a figure must never stop the heartbeat
            log.debug("node %s could not count its KV slots", self.node_id, exc_info=True)
            return -1

    def status(self) -> dict[str, Any]:
        """This node as it sees itself (for ``zctl node status``)."""
        a = self.slot.assignment
        download = self._download
        return {
            "node_id": self.node_id, "state": self.state, "coordinator": self.coordinator,
            "coordinator_id": self.coordinator_id, "data_addr": self.data_addr,
            "refusal": self.refusal, "stage": a.stage_index if a else None,
            "epoch": a.epoch if a else None, "cached_shards": self.cache.hashes(),
            "transfer": [download.bytes_done, download.bytes_total] if download else None,
            "profile": self.profile_state,
            "counters": dict(self.counters),
        }


def check_runner_dir(runner_dir: Path, info: StageInfo, shard_hash: str, num_stages: int
                     ) -> None:
    """Raise LaunchError unless the cached manifest describes the stage as assigned."""
    manifest = load_manifest(runner_dir, verify_files=False)
    index = info.index
    spec = manifest.stages[index] if index < len(manifest.stages) else None
    if spec is None or len(manifest.stages) != num_stages or \
            manifest.stage_hash(index) != shard_hash or \
            (spec.layer_start, spec.layer_end, spec.xml, spec.bin, spec.first, spec.last) != \
            (info.layer_start, info.layer_end, info.xml, info.bin, info.first, info.last):
        raise LaunchError(f"the cached shard {shard_hash[:12]} does not describe stage "
                          f"{index} of {num_stages} as the assignment does")


@dataclass
class _Job:
    session: int
    kind: str
    context: Any
    future: Future
