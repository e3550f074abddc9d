"""Records the control-plane messages carry: devices, shard files, a stage's slice of the
manifest, the runtime settings, and the cluster status snapshot.

Plain frozen dataclasses, no sockets and no OpenVINO; ``controlplane.messages`` nests them
in its messages and validates them field by field on receipt. The runtime settings are the
runners' own ``RuntimeSpec`` (dataplane.runtime.config, which imports no OpenVINO either).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from controlplane.planner.shape import ModelShape
from dataplane.runtime.config import RuntimeSpec

# Liveness defaults: a node silent for LIVENESS beats of HEARTBEAT_S is marked dead (2.5 s:
# what a lost node costs before its stages move to the survivors); any traffic counts.
HEARTBEAT_S = 0.5
LIVENESS = 5
# A re-plan of a serving pipeline is applied when the planner predicts it this much faster.
DEFAULT_REPLAN_GAIN = 0.10
# what views, stats and events call the coordinator's own node
COORDINATOR = "coordinator"


@dataclass(frozen=True)
class DeviceInfo:
    """One OpenVINO device a node sees; memory_bytes is None when the plugin will not say."""

    name: str
    full_name: str = ""
    memory_bytes: int | None = None


@dataclass(frozen=True)
class FileSpec:
    """One file of a shard: its name inside the shard directory, size and sha256."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class StageInfo:
    """The part of the export manifest a node's assignment names (cross-checked on the node)."""

    index: int
    layer_start: int
    layer_end: int
    xml: str
    bin: str
    first: bool
    last: bool


@dataclass(frozen=True)
class ProfileRecord:
    """A node's measured profile as it travels and is stored (the planner's ``NodeProfile``
    as plain data: controlplane.planner.measured converts): what it was measured for (a
    shape's fingerprint, a weight format, a device, an OpenVINO version), one decoder
    layer's decode step and the LM head's at 1, 2, 4 and 8 rows (seconds), a layer's
    prefill throughput, the fixed cost of an inference call, a layer's resident bytes and
    the node's free memory then; when (Unix time) and how long it took; the synthetic layer
    graph's version it timed and the coordinator's own work per decode step at 1, 2, 4
    and 8 rows (a record without them, from an older zctl, is stale), and the node's frames'
    work a hop at the same rows (none: not measured, taken as 0); the CPU quota the profile
    ran under (``cpu_share`` cores of CPU time per ``quota_period_s``; 0: none, as in a
    record from before quotas were read) and the process CPU seconds its timed decode steps
    used per second of their wall time (``cpu_per_wall``; 0: not measured); the form of the
    INT8 weights it timed (``int8_form``, zctl.weights.INT8_FORMS; None in a float format)
    and whether its experts were exact (``exact_experts``: ``zctl export --exact-experts``);
    the time of the host's reference workload as the node holding it first checked it
    (``reference_s``, controlplane/host_speed.py; 0: not timed yet)."""

    shape: str
    weights: str
    device: str
    openvino: str
    decode_s: list[float]
    head_decode_s: list[float]
    prefill_tokens_per_s: float
    call_s: float
    layer_bytes: int
    free_memory: int
    source: str = ""
    measured_at: float = 0.0
    seconds: float = 0.0
    graph: int = 0
    engine_decode_s: list[float] = field(default_factory=list)
    frame_decode_s: list[float] = field(default_factory=list)
    cpu_share: float = 0.0
    quota_period_s: float = 0.0
    cpu_per_wall: float = 0.0
    int8_form: str | None = None
    reference_s: float = 0.0
    exact_experts: bool = False


@dataclass(frozen=True)
class LinkStatus:
    """A link of the pipeline between neighbours ``a`` and ``b``, as the coordinator
    measured it (``a`` probing ``b``): round trip, and bytes per second each way at the
    frame sizes the model sends; ``error`` says why it has no figures (then they are 0)."""

    a: str
    b: str
    rtt_s: float = 0.0
    forward_bps: float = 0.0  # a to b
    backward_bps: float = 0.0  # b to a
    frame_bytes: list[int] = field(default_factory=list)  # the sizes probed
    measured_at: float = 0.0  # Unix time (0: not yet)
    error: str = ""


@dataclass(frozen=True)
class NodeStatus:
    node_id: str
    host: str
    state: str
    stage: int | None
    data_addr: str
    last_seen_s: float
    devices: list[DeviceInfo]
    ram_free: int
    ram_total: int
    openvino: str
    zctl: str
    cached_shards: int
    transfer_done: int = 0
    transfer_total: int = 0
    error: str = ""
    local: bool = False
    last_sent_s: float | None = None  # since the coordinator last sent to it (None: never)
    kv_slots: int = -1  # KV slots its stage holds, as of its last heartbeat (-1: unknown)
    profile: ProfileRecord | None = None  # measured for the cluster's model (None: not yet)
    profile_state: str = ""  # not profiled yet, measuring, measured, cached, failed: why
    # how many times slower the node runs now than when profiled (its reference workload
    # timed now over then: controlplane/planner/speed.py); its profile is taken at it
    speed_factor: float = 1.0
    reference_s: float = 0.0  # its reference workload's time as last timed (0: not yet)

    @property
    def name(self) -> str:
        """The node as people see it: its id, or COORDINATOR for the coordinator's own."""
        return COORDINATOR if self.local else self.node_id


@dataclass(frozen=True)
class StageStatus:
    index: int
    layer_start: int
    layer_end: int
    shard_hash: str
    bytes: int
    node_id: str | None
    state: str


@dataclass(frozen=True)
class RefusalInfo:
    node_id: str
    host: str
    reason: str
    age_s: float
    code: str = ""  # the Refuse code: openvino-version, protocol-version, ...


@dataclass(frozen=True)
class StreamsPrediction:
    """``streams`` decoding together in ``row_groups`` row groups of at most ``rows`` rows:
    their predicted aggregate tok/s."""

    streams: int
    tok_s: float
    row_groups: int
    rows: int


@dataclass(frozen=True)
class PredictionStatus:
    """The planner's model of time applied to the placement running now
    (controlplane/planner/running.py): one stream's tok/s, 1 to 8 streams' aggregate tok/s
    in the row groups the engine runs them in (``row_groups``: its setting, 0 none, -1 not
    known: the best for each count), and per node in stage order (consecutive stages on a
    node are one) its decode step at one row and the hop after it (the last: the reply to
    stage 0), in ms. ``error`` says why there is no prediction (then the figures are
    empty): a profile or a link not measured yet, a pipeline not serving."""

    tok_s: float = 0.0
    streams: list[StreamsPrediction] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    stage_ms: list[float] = field(default_factory=list)
    hop_ms: list[float] = field(default_factory=list)
    row_groups: int = -1
    error: str = ""


# What a re-plan came to: a faster placement whose shards are moving (planning), switched
# to (applied), not worth re-wiring (not_applied), dropped (abandoned), undone because a
# node could not start its stage (failed); or a planner that cannot place (unusable), and
# one that can again and keeps the running placement (kept).
REPLAN_KINDS = ("planning", "applied", "not_applied", "abandoned", "failed", "unusable",
                "kept")
UNCOUNTED_REPLAN_KINDS = ("unusable", "kept")  # said, but no re-plan


@dataclass(frozen=True)
class ReplanStatus:
    """The last re-plan's outcome: its kind (one of REPLAN_KINDS; "": none yet), its note
    in words, when the coordinator came to it (Unix seconds, its clock; 0: none yet), and
    how many re-plan outcomes it has come to (an outcome the same as the last one is not
    counted again, nor is an unusable planner or one that keeps the placement: they are
    no re-plan)."""

    kind: str = ""
    note: str = ""
    time_s: float = 0.0
    count: int = 0


@dataclass(frozen=True)
class ClusterStatus:
    """What ``zctl cluster status --json`` prints."""

    coordinator_id: str
    session: str
    endpoint: str
    protocol: int
    openvino: str
    zctl: str
    export_dir: str
    model: str
    pipeline: str
    epoch: int
    uptime_s: float
    plan_error: str
    nodes: list[NodeStatus]
    stages: list[StageStatus]
    refused: list[RefusalInfo]
    counters: dict[str, int]
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)  # what every stage compiles with
    curve: bool = False  # CURVE on the control and data pipes
    time_s: float = 0.0  # the coordinator's wall clock when it made this snapshot (0: unknown)
    heartbeat_interval: float = 0.0  # seconds between heartbeats (0: not reported)
    liveness: int = 0  # heartbeats a node may miss before it is marked dead (0: not reported)
    shape: ModelShape | None = None  # the served model's shape (None: unknown)
    links: list[LinkStatus] = field(default_factory=list)  # the pipeline's, as measured
    prediction: PredictionStatus | None = None  # the running placement's speed (None: not made)
    placement: str = ""  # how the stages were placed (the planner, or why not), re-plans
    replan: ReplanStatus = field(default_factory=ReplanStatus)  # the last re-plan's outcome
    left_out: dict[str, str] = field(default_factory=dict)  # spares the planner left out: why

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
