"""The coordinator's membership table: one record per node, its state and liveness.

States: ``idle`` (enrolled, no stage: a spare), ``transferring`` (fetching its shard),
``ready`` (shard cached, waiting for the pipeline to be wired), ``wiring`` (stage
assigned, starting), ``serving``, ``failed`` (transfer or start failed; see error),
``dead`` (missed its heartbeats), ``left`` (said goodbye).

Liveness: a node is dead once it has been silent for ``liveness`` heartbeat intervals, or
once it is late again (silent past ``LATE_BEATS`` intervals) after lapses (silences past
``LAPSE_BEATS`` intervals) that, with the silence now, add up to as much within
``2 x liveness`` intervals. The second rule is what catches a flapping link: its
heartbeats get through in bursts between stalls, each burst restarting the first rule's
clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from controlplane.messages import AssignStage, Enrol
from controlplane.nodeinfo import describe_versions
from controlplane.planner.speed import speed_factor
from controlplane.records import NodeStatus, ProfileRecord

IDLE = "idle"
TRANSFERRING = "transferring"
READY = "ready"
WIRING = "wiring"
SERVING = "serving"
FAILED = "failed"
DEAD = "dead"
LEFT = "left"

LAPSE_BEATS = 2.0  # a silence of more than 2 intervals is a lapse (healthy gaps: ~1.25)
LATE_BEATS = 1.3  # after lapses, a silence of 1.3 intervals (healthy: <= 1.25) is late
LAPSE_WINDOW = 2  # lapses count for 2 x liveness intervals after they end

STATES = (IDLE, TRANSFERRING, READY, WIRING, SERVING, FAILED, DEAD, LEFT)
ALIVE = (IDLE, TRANSFERRING, READY, WIRING, SERVING, FAILED)
HAS_SHARD = (READY, WIRING, SERVING)


@dataclass
class Member:
    """One enrolled node as the coordinator sees it."""

    node_id: str
    identity: bytes
    info: Enrol
    state: str
    last_seen: float
    local: bool = False
    last_sent: float = 0.0
    stage: int | None = None
    offered: str | None = None  # shard hash offered (and not yet confirmed)
    shards: set[str] = field(default_factory=set)  # hashes the node holds
    assigned: AssignStage | None = None  # last wiring sent
    ready_epoch: int = -1
    served: dict[tuple[str, int], int] = field(default_factory=dict)  # chunks served
    transfer_total: int = 0
    error: str = ""
    down_since: float = 0.0  # when it was marked dead or left
    kv_slots: int = -1  # KV slots its stage holds, from its last heartbeat (-1: unknown)
    enrolments: int = 1  # a node that enrols again has lost what its stage held
    enrolled_at: float = 0.0  # when it last enrolled
    lapses: deque[tuple[float, float]] = field(default_factory=deque)  # (end, seconds)
    profile: ProfileRecord | None = None  # its profile for the cluster's model
    profile_state: str = "not profiled yet"  # or measuring, measured, kept, failed: why
    profile_answered: bool = False  # it answered the profile request (since it enrolled)
    reference_s: float = 0.0  # its reference workload's time as last timed (0: not yet)

    @property
    def speed_factor(self) -> float:
        """How many times slower it runs now than when profiled (1 until both are timed)."""
        return speed_factor(self.profile.reference_s if self.profile else 0.0, self.reference_s)

    @property
    def alive(self) -> bool:
        return self.state in ALIVE

    def heard(self, now: float, interval: float) -> None:
        """Traffic from the node at ``now`` (any traffic counts as a heartbeat); the silence
        it ends is kept as a lapse when it outlasted ``LAPSE_BEATS`` intervals."""
        silence = now - self.last_seen
        if silence > LAPSE_BEATS * interval:
            self.lapses.append((now, silence))
        self.last_seen = now

    def recent_lapses(self, now: float, window: float) -> float:
        """Seconds of lapses that ended within ``window`` seconds of ``now`` (older ones are
        forgotten)."""
        while self.lapses and self.lapses[0][0] < now - window:
            self.lapses.popleft()
        return sum(seconds for _, seconds in self.lapses)

    def mark_down(self, state: str, now: float) -> None:
        self.state, self.down_since, self.kv_slots = state, now, -1

    def transfer_done(self) -> int:
        return sum(self.served.values())

    def status(self, now: float) -> NodeStatus:
        info = self.info
        return NodeStatus(
            node_id=self.node_id, host=info.host, state=self.state, stage=self.stage,
            data_addr=info.data_addr, last_seen_s=round(max(0.0, now - self.last_seen), 3),
            devices=list(info.devices), ram_free=info.ram_free, ram_total=info.ram_total,
            openvino=info.openvino, zctl=info.zctl, cached_shards=len(self.shards),
            transfer_done=self.transfer_done(), transfer_total=self.transfer_total,
            error=self.error, local=self.local,
            last_sent_s=(round(max(0.0, now - self.last_sent), 3)
                         if self.last_sent and not self.local else None),
            kv_slots=self.kv_slots, profile=self.profile, profile_state=self.profile_state,
            speed_factor=round(self.speed_factor, 4), reference_s=self.reference_s,
        )


def replaced_connection(identity: bytes) -> bool:
    """Whether ``identity`` is the name libzmq gives a peer's old connection when a new one
    takes its routing id over (ROUTER_HANDOVER: a zero byte and a counter; a DEALER cannot
    choose a routing id starting with a zero byte). A message still queued on that
    connection (an enrolment a node sent before it gave up on a slow coordinator and
    reconnected) is stale: its node enrols again over the new connection."""
    return identity[:1] == b"\x00"


def enrol_refusal(msg: Enrol, identity: bytes, coordinator_id: str, openvino: str,
                  curve: bool, cluster_id: str = "") -> tuple[str, str] | None:
    """Why the coordinator refuses an enrolment, as (code, reason naming both sides), or
    None to admit it. ``curve``: the cluster encrypts its data pipes; ``cluster_id``: the
    local cluster this coordinator serves, whose nodes alone it admits ("": any node)."""
    if identity != msg.node_id.encode():
        return "bad-enrol", (f"node {msg.node_id} enrolled over a connection whose routing id "
                             f"is {identity[:64]!r}: the routing id must be the node id")
    if msg.node_id == coordinator_id:
        return "duplicate-id", (f"node id {msg.node_id} is the coordinator's own id: was a "
                                "state directory copied? delete node_id in the node's state "
                                "directory")
    if msg.openvino != openvino:
        ours, theirs = describe_versions(openvino, msg.openvino)
        return "openvino-version", (f"node {msg.node_id} runs OpenVINO {theirs} but the "
                                    f"coordinator runs {ours}; compiled shards need the same "
                                    "OpenVINO on every node")
    if cluster_id and msg.cluster_id != cluster_id:
        theirs = f"local cluster {msg.cluster_id}" if msg.cluster_id else "no local cluster"
        return "other-cluster", (f"node {msg.node_id} was started for {theirs}, but this "
                                 f"coordinator serves local cluster {cluster_id}: a node of "
                                 "another (an earlier) cluster on this machine")
    if curve and not msg.data_key:
        return "no-data-key", (f"node {msg.node_id} enrolled without a data-pipe key, but this "
                               "cluster encrypts its data pipes (CURVE): update zctl on the node")
    return None


def silence_verdict(member: Member, now: float, interval: float, liveness: int) -> str | None:
    """Why a remote, live member is dead at ``now``, or None while it is not: silent for
    ``liveness`` intervals, or late again after lapses that add up to as much (the module
    docstring)."""
    if member.local or not member.alive:
        return None
    deadline = interval * liveness
    silence = now - member.last_seen
    if silence > deadline:
        return f"missed {liveness} heartbeats ({silence:.1f} s silent)"
    lapsed = member.recent_lapses(now, LAPSE_WINDOW * deadline)
    if lapsed and silence > LATE_BEATS * interval and silence + lapsed > deadline:
        return (f"silent {silence:.1f} s after lapses of {lapsed:.1f} s within "
                f"{LAPSE_WINDOW * deadline:.0f} s: its link stalls again and again")
    return None


def beat_due(member: Member, now: float, interval: float) -> bool:
    """Whether a remote, live member is owed a heartbeat: nothing was sent to it for an
    interval (any traffic counts both ways)."""
    return not member.local and member.alive and now - member.last_sent >= interval
