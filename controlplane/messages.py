"""Control-plane message schemas: typed, versioned, validated on receipt.

Schemas only, no sockets. Every message is a frozen dataclass registered under a type
tag: the control plane's own ``Message`` classes under their ``TYPE`` (``register``), and
dataclasses another room defines, such as the engine's requests and chunks, as they are
(``register_record``, with the check their values must pass). On the wire a message is
one JSON frame ``{"protocol": N, "type": tag, "body": {...}}``, followed by one raw binary
frame for the messages that carry a payload (shard chunks). ``decode_message`` checks the
protocol version, the type tag and every field's type (nested dataclasses, lists, dicts,
optionals) and raises ``MessageError`` with a readable reason; it never returns a
half-valid message.
"""

from __future__ import annotations

import json
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, NamedTuple

from controlplane.checks import (  # noqa: F401 - NODE_ID_RE, MessageError: part of the API
    NODE_ID_RE,
    MessageError,
    check_key,
    check_nonneg,
    check_sha,
    need,
)
from controlplane.planner.shape import ModelShape
from controlplane.records import ClusterStatus, DeviceInfo, FileSpec, ProfileRecord, StageInfo
from controlplane.schema import SchemaError, build
from dataplane.runtime.config import RuntimeSpec
from zctl.weights import INT8_FORMS

PROTOCOL_VERSION = 16  # bump with every change to a message schema (tests/test_wire_schema.py)

class UnknownMessage(MessageError):
    """A well-formed envelope of a type this side does not know."""


class ProtocolMismatch(MessageError):
    """A well-formed envelope from a peer speaking another protocol version."""

    def __init__(self, theirs: Any, msg_type: str, body: Any) -> None:
        self.theirs = theirs
        self.ours = PROTOCOL_VERSION
        self.msg_type = msg_type
        self.body = body if isinstance(body, dict) else {}
        super().__init__(
            f"peer speaks control protocol {theirs!r} but this side speaks {PROTOCOL_VERSION} "
            f"(message {msg_type!r})"
        )


class Message:
    """Base of every control-plane message (subclasses are frozen dataclasses)."""

    TYPE: ClassVar[str] = ""
    HAS_PAYLOAD: ClassVar[bool] = False

    def check(self) -> None:
        """Semantic checks beyond field types; raise MessageError."""


class Registration(NamedTuple):
    """How one message class travels: its type tag, the check a decoded value must pass
    (raising MessageError), and whether a payload frame follows it."""

    tag: str
    check: Callable[[Any], None]
    has_payload: bool = False


REGISTRY: dict[str, type] = {}  # type tag -> message class
_REGISTRATIONS: dict[type, Registration] = {}

M = typing.TypeVar("M", bound=type[Message])
R = typing.TypeVar("R", bound=type)


def register(cls: M) -> M:
    """Register a control-plane ``Message`` class under its ``TYPE``."""
    _add(cls, Registration(cls.TYPE, cls.check, cls.HAS_PAYLOAD))
    return cls


def register_record(tag: str, cls: R, check: Callable[[Any], None] = lambda _: None) -> R:
    """Carry ``cls``, a frozen dataclass defined outside the control plane, under ``tag``;
    ``check`` refuses a decoded value that is not sound (raising MessageError)."""
    _add(cls, Registration(tag, check))
    return cls


def _add(cls: type, registration: Registration) -> None:
    tag = registration.tag
    if not tag or tag in REGISTRY or cls in _REGISTRATIONS:
        raise TypeError(f"message class {cls.__name__} needs a unique type tag (got {tag!r})")
    REGISTRY[tag] = cls
    _REGISTRATIONS[cls] = registration


def registration(cls: type) -> Registration:
    """How messages of ``cls`` travel (TypeError if it is not registered)."""
    found = _REGISTRATIONS.get(cls)
    if found is None:
        raise TypeError(f"{cls.__name__} is not a registered message")
    return found


def type_tag(msg: object) -> str:
    """The type tag ``msg`` travels under."""
    return registration(type(msg)).tag


# -- messages --------------------------------------------------------------------------
@register
@dataclass(frozen=True)
class Enrol(Message):
    """Node -> coordinator: who I am, what I have, what I run."""

    TYPE: ClassVar[str] = "enrol"
    node_id: str
    host: str
    data_addr: str
    devices: list[DeviceInfo]
    ram_total: int
    ram_free: int
    openvino: str
    zctl: str
    cached_shards: list[str] = field(default_factory=list)
    tok_s: float | None = None
    pid: int = 0
    data_key: str = ""  # Z85 public key of the node's CURVE data pipes ("": no CURVE)
    cluster_id: str = ""  # the local cluster the node was started for ("": any)
    probe_addr: str = ""  # the echo its links are probed against ("": none)

    def check(self) -> None:
        need(bool(NODE_ID_RE.match(self.node_id)),
              f"enrol.node_id {self.node_id!r} must be 1-64 characters of [A-Za-z0-9._-]")
        need(self.data_addr.startswith("tcp://"),
              f"enrol.data_addr {self.data_addr!r} must be a tcp:// endpoint")
        check_key(self.data_key, "enrol.data_key")
        check_nonneg(self, "ram_total", "ram_free")
        for h in self.cached_shards:
            check_sha(h, "enrol.cached_shards entry")


@register
@dataclass(frozen=True)
class Welcome(Message):
    """Coordinator -> node: enrolment accepted; heartbeat at this rate."""

    TYPE: ClassVar[str] = "welcome"
    node_id: str
    coordinator_id: str
    session: str
    heartbeat_interval: float
    liveness: int

    def check(self) -> None:
        need(self.heartbeat_interval > 0, "welcome.heartbeat_interval must be > 0")
        need(self.liveness >= 1, "welcome.liveness must be >= 1")


@register
@dataclass(frozen=True)
class Refuse(Message):
    """Coordinator -> node: enrolment refused (code: openvino-version, protocol-version, ...)."""

    TYPE: ClassVar[str] = "refuse"
    code: str
    reason: str
    node_id: str = ""


@register
@dataclass(frozen=True)
class Heartbeat(Message):
    """Either way; any traffic counts as a heartbeat, this is for when there is none."""

    TYPE: ClassVar[str] = "heartbeat"
    state: str = ""
    # node -> coordinator: KV slots its stage holds now (all streams and row groups);
    # -1: unknown (no stage running, or the coordinator's own beat)
    kv_slots: int = -1
    # node -> coordinator: its reference workload's time as last timed (controlplane/
    # host_speed.py; 0: not timed)
    reference_s: float = 0.0

    def check(self) -> None:
        need(self.kv_slots >= -1, f"heartbeat.kv_slots must be >= -1, got {self.kv_slots}")
        need(math.isfinite(self.reference_s) and self.reference_s >= 0,
             f"heartbeat.reference_s must be >= 0 seconds, got {self.reference_s}")


@register
@dataclass(frozen=True)
class Leave(Message):
    """Either way: an orderly goodbye (node shutting down, or coordinator shutting down)."""

    TYPE: ClassVar[str] = "leave"
    reason: str = ""


@register
@dataclass(frozen=True)
class ShardOffer(Message):
    """Coordinator -> node: hold this shard (fetch what is not cached, chunk by chunk)."""

    TYPE: ClassVar[str] = "shard_offer"
    shard_hash: str
    stage_index: int
    files: list[FileSpec]
    chunk_size: int

    def check(self) -> None:
        check_sha(self.shard_hash, "shard_offer.shard_hash")
        need(self.chunk_size > 0, "shard_offer.chunk_size must be > 0")
        need(bool(self.files), "shard_offer.files is empty")
        for spec in self.files:
            check_sha(spec.sha256, f"shard_offer file {spec.name!r} sha256")
            need(spec.size >= 0, f"shard_offer file {spec.name!r} has a negative size")


@register
@dataclass(frozen=True)
class ShardRequest(Message):
    """Node -> coordinator: send me this chunk (one request is one credit)."""

    TYPE: ClassVar[str] = "shard_request"
    shard_hash: str
    file: str
    chunk: int
    offset: int
    size: int

    def check(self) -> None:
        check_sha(self.shard_hash, "shard_request.shard_hash")
        check_nonneg(self, "chunk", "offset", "size")


@register
@dataclass(frozen=True)
class ShardChunk(Message):
    """Coordinator -> node: one chunk; the bytes travel in the next frame."""

    TYPE: ClassVar[str] = "shard_chunk"
    HAS_PAYLOAD: ClassVar[bool] = True
    shard_hash: str
    file: str
    chunk: int
    offset: int
    size: int
    sha256: str

    def check(self) -> None:
        check_sha(self.shard_hash, "shard_chunk.shard_hash")
        check_sha(self.sha256, "shard_chunk.sha256")
        check_nonneg(self, "chunk", "offset", "size")


@register
@dataclass(frozen=True)
class ShardDone(Message):
    """Node -> coordinator: the shard is cached and verified (or why it is not)."""

    TYPE: ClassVar[str] = "shard_done"
    shard_hash: str
    ok: bool
    cached: bool = False
    error: str = ""


@register
@dataclass(frozen=True)
class AssignStage(Message):
    """Coordinator -> node: run this stage; bind the inbound pipe here, send there."""

    TYPE: ClassVar[str] = "assign_stage"
    epoch: int
    stage: StageInfo
    num_stages: int
    model: str
    shard_hash: str
    bind: str
    send_to: str
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    # CURVE data pipes (empty: plain): the next hop's public key, and the keys admitted
    # to this stage's inbound pipe (the previous hop's)
    peer_key: str = ""
    admit_keys: list[str] = field(default_factory=list)
    # the stages that follow ``stage`` on this node, run with it as one (a node that took
    # a lost neighbour's stages), and their shards' hashes
    more_stages: list[StageInfo] = field(default_factory=list)
    more_hashes: list[str] = field(default_factory=list)

    @property
    def stages(self) -> list[StageInfo]:
        return [self.stage, *self.more_stages]

    @property
    def shard_hashes(self) -> list[str]:
        return [self.shard_hash, *self.more_hashes]

    def check(self) -> None:
        check_sha(self.shard_hash, "assign_stage.shard_hash")
        need(len(self.more_stages) == len(self.more_hashes),
             "assign_stage: more_stages and more_hashes differ in length")
        for shard_hash in self.more_hashes:
            check_sha(shard_hash, "assign_stage.more_hashes entry")
        for before, after in zip(self.stages, self.more_stages, strict=False):
            need(after.index == before.index + 1 and after.layer_start == before.layer_end,
                 f"assign_stage: stage {after.index} does not follow stage {before.index}")
        check_key(self.peer_key, "assign_stage.peer_key")
        for key in self.admit_keys:
            check_key(key, "assign_stage.admit_keys entry", required=True)
        need(bool(self.peer_key) == bool(self.admit_keys),
              "assign_stage: peer_key and admit_keys come together (CURVE) or not at all")
        need(0 <= self.stage.index and self.stages[-1].index < self.num_stages,
              f"assign_stage: stages {self.stage.index}-{self.stages[-1].index} are outside "
              f"0-{self.num_stages - 1}")
        for name in ("bind", "send_to"):
            value = getattr(self, name)
            need(value.startswith("tcp://"), f"assign_stage.{name} {value!r} must be tcp://")


@register
@dataclass(frozen=True)
class Release(Message):
    """Coordinator -> node: stop serving your stage (you are no longer in the pipeline)."""

    TYPE: ClassVar[str] = "release"
    reason: str = ""


@register
@dataclass(frozen=True)
class StageReady(Message):
    """Node -> coordinator: the stage runs with the wiring of ``epoch`` (or why not)."""

    TYPE: ClassVar[str] = "stage_ready"
    epoch: int
    stage_index: int
    ok: bool
    error: str = ""


@register
@dataclass(frozen=True)
class Error(Message):
    """Either way: the message you sent was rejected (code: malformed, unknown-type, ...)."""

    TYPE: ClassVar[str] = "error"
    code: str
    detail: str
    ref_type: str = ""


PROFILE_STATES = ("kept", "measured", "measuring", "not-profiled", "failed")


@register
@dataclass(frozen=True)
class ProfileRequest(Message):
    """Coordinator -> node: your profile for the cluster's model (its shape, in this weight
    format, on this device); measure it if you have none (within ``budget_s`` seconds);
    ``int8_form``: the served export's INT8 form (None: the format's default);
    ``exact_experts``: its experts are exact (``zctl export --exact-experts``)."""

    TYPE: ClassVar[str] = "profile_request"
    shape: ModelShape
    weights: str
    device: str
    budget_s: float = 30.0
    int8_form: str | None = None
    exact_experts: bool = False

    def check(self) -> None:
        need(self.budget_s > 0, "profile_request.budget_s must be > 0")
        need(not self.exact_experts or self.shape.moe,
             f"profile_request.exact_experts: {self.shape.name} has no experts")
        need(self.int8_form in (None, *INT8_FORMS),
             f"profile_request.int8_form {self.int8_form!r} is not one of {INT8_FORMS}")


@register
@dataclass(frozen=True)
class ProfileReport(Message):
    """Node -> coordinator: its profile (state kept or measured), or that it is measuring
    one, has none and will not measure it (not-profiled), or failed; ``detail`` says why."""

    TYPE: ClassVar[str] = "profile_report"
    state: str
    profile: ProfileRecord | None = None
    detail: str = ""

    def check(self) -> None:
        need(self.state in PROFILE_STATES,
             f"profile_report.state {self.state!r} is not one of {', '.join(PROFILE_STATES)}")
        need((self.profile is not None) == (self.state in ("kept", "measured")),
             "profile_report: a profile comes with state kept or measured, and only then")


@register
@dataclass(frozen=True)
class LinkProbe(Message):
    """Coordinator -> node: time round trips to ``peer``'s probe endpoint with frames of
    these sizes (controlplane/link_probe.py) and report the link's figures."""

    TYPE: ClassVar[str] = "link_probe"
    probe_id: int
    peer: str
    peer_addr: str
    sizes: list[int]
    rounds: int = 5
    timeout_s: float = 5.0

    def check(self) -> None:
        need(self.peer_addr.startswith("tcp://"),
             f"link_probe.peer_addr {self.peer_addr!r} must be a tcp:// endpoint")
        need(bool(self.sizes) and all(s > 0 for s in self.sizes),
             "link_probe.sizes must be positive byte counts")
        need(1 <= self.rounds <= 100 and self.timeout_s > 0,
             "link_probe needs 1-100 rounds and a positive timeout")


@register
@dataclass(frozen=True)
class LinkReport(Message):
    """Node -> coordinator: the figures of the link to ``peer`` (or why there are none)."""

    TYPE: ClassVar[str] = "link_report"
    probe_id: int
    peer: str
    ok: bool
    rtt_s: float = 0.0
    forward_bps: float = 0.0
    backward_bps: float = 0.0
    error: str = ""

    def check(self) -> None:
        need(not self.ok or (self.rtt_s >= 0 and self.forward_bps > 0 and self.backward_bps > 0),
             "link_report: a link's figures are a round trip >= 0 and positive bandwidths")


@register
@dataclass(frozen=True)
class StatusRequest(Message):
    """Anyone -> coordinator: send me a status snapshot."""

    TYPE: ClassVar[str] = "status_request"


@register
@dataclass(frozen=True)
class StatusReply(Message):
    TYPE: ClassVar[str] = "status_reply"
    status: ClusterStatus


# -- encoding --------------------------------------------------------------------------
def encode_message(msg: object, protocol: int = PROTOCOL_VERSION) -> bytes:
    """One JSON frame for ``msg``, a registered message (``protocol`` is overridable only
    to test refusals)."""
    envelope = {"protocol": protocol, "type": type_tag(msg), "body": _json_fields(msg)}
    return json.dumps(envelope, separators=(",", ":"), default=_json_fields).encode()


def _json_fields(obj: Any) -> dict[str, Any]:
    """A dataclass as a shallow {field: value} mapping for json (which converts nested
    dataclasses through this hook again): the same JSON as ``asdict``, without its deep
    copy, which made a generation chunk cost ~0.4 ms on the generation thread."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in fields(obj)}
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def decode_message(data: bytes) -> Any:
    """Parse and validate one JSON frame; raise MessageError (or ProtocolMismatch)."""
    try:
        raw = json.loads(data)
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, an integer of > 4300 digits
        raise MessageError(f"not a JSON message ({len(data)} bytes): {exc}") from None
    except RecursionError:
        raise MessageError("JSON nested too deeply") from None
    if not isinstance(raw, dict):
        raise MessageError(f"a message must be a JSON object, got {type(raw).__name__}")
    extra = sorted(set(raw) - {"protocol", "type", "body"})
    if extra:
        raise MessageError(f"message envelope has unknown field(s) {', '.join(map(repr, extra))}")
    msg_type = raw.get("type")
    if not isinstance(msg_type, str):
        raise MessageError("message has no string 'type'")
    protocol = raw.get("protocol")
    if protocol != PROTOCOL_VERSION or isinstance(protocol, bool):
        if protocol is None:
            raise MessageError(f"message {msg_type!r} has no 'protocol' version")
        raise ProtocolMismatch(protocol, msg_type, raw.get("body"))
    cls = REGISTRY.get(msg_type)
    if cls is None:
        raise UnknownMessage(f"unknown message type {msg_type!r}")
    try:
        msg = build(cls, raw.get("body", {}), msg_type)
    except SchemaError as exc:
        raise MessageError(str(exc)) from None
    _REGISTRATIONS[cls].check(msg)
    return msg


def to_frames(msg: object, payload: bytes | memoryview | None = None,
              protocol: int = PROTOCOL_VERSION) -> list[Any]:
    """The frames of one message: [json] or [json, payload]."""
    tag, _, has_payload = registration(type(msg))
    if has_payload != (payload is not None):
        raise TypeError(f"{tag} {'needs' if has_payload else 'takes no'} payload frame")
    frames: list[Any] = [encode_message(msg, protocol)]
    if payload is not None:
        frames.append(payload)
    return frames


def from_frames(frames: list[bytes]) -> tuple[Any, bytes | None]:
    """Decode [json] or [json, payload]; the frame count must fit the message type."""
    if not frames:
        raise MessageError("empty message (no frames)")
    if len(frames) > 2:
        raise MessageError(f"a message has 1 or 2 frames, got {len(frames)}")
    msg = decode_message(frames[0])
    tag, _, has_payload = registration(type(msg))
    if has_payload:
        if len(frames) != 2:
            raise MessageError(f"{tag} needs a payload frame")
        payload = frames[1]
        size = getattr(msg, "size", len(payload))
        if len(payload) != size:
            raise MessageError(f"{tag} says {size} bytes but its payload has {len(payload)}")
        return msg, payload
    if len(frames) != 1:
        raise MessageError(f"{tag} takes no payload frame")
    return msg, None


def refusal_text(exc: ProtocolMismatch) -> str | None:
    """Best-effort reason from a Refuse sent in another protocol version (else None)."""
    if exc.msg_type == Refuse.TYPE and isinstance(exc.body.get("reason"), str):
        return exc.body["reason"]
    return None


def peer_node_id(exc: ProtocolMismatch) -> str:
    """Best-effort node id from an Enrol sent in another protocol version."""
    node_id = exc.body.get("node_id")
    return node_id if isinstance(node_id, str) and NODE_ID_RE.match(node_id) else "?"
