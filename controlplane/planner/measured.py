"""A node's measured figures made into its profile, and a profile as data (JSON, the wire).

``zctl node profile`` times synthetic stages of a model's layer shape (controlplane/
profiling.py): a base stage of one decoder layer, a stage of ``1 + k`` layers, and one
layer with the LM head, each at 1, 2, 4 and 8 rows, and a prompt on the first two. What
the planner needs comes out by difference, so the cost of the call itself separates out:

    layer(r)  = (more(r) - base(r)) / k        one decoder layer's decode step
    call      = base(1) - layer(1)             an inference call's fixed cost
    head(r)   = head_stage(r) - base(r)        the final norm and the LM head

The coordinator's own work per decode step at each row count (controlplane/engine_step.py)
is timed directly and taken as it is, and so is a node's framework work a hop (its frames
decoded, prepared and sealed around the decoder stages' steps: ``frame_s``).

A layer's prefill of a ``T``-token prompt, ``(more_prompt - base_prompt) / k``, is what
the planner's model of a chunk says it is (controlplane/planner/timing.py): a one-row step
and ``T - 1`` more tokens, with attention among them, at the layer's token rate; that is
solved for the rate. A layer's memory is the growth of the process between the two
stages' compiled models (their KV caches left out) over ``k``, and never less than its
weights. Noise cannot make a per-row figure fall as rows grow: each is at least the one
before (a running maximum), and never under a microsecond.

Pure: no OpenVINO, no clock. A profile file is ``profile_dict``'s JSON; ``read_profile``
checks one field by field and names the file in every error. A profile of an older format
(``OLD_FORMATS``: without the layer graph's version and the coordinator's step), or timed
on another version of the synthetic layer graph, is ``StaleProfile``: measured again,
never used (a profile of layer graph 3 or before timed its steps back to back, without
the frames' work). A record without the frames' work takes them as 0; one without the CPU
quota it ran under (measured before quotas were read) was under none, and its steps' CPU
use is taken as one core's. A profile of ``UNANCHORED_FORMATS`` timed the host's reference
workload in the profiling process (biased: controlplane/host_speed.py): it is read with
no reference time, which its node then takes from its own checks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from controlplane.planner.memory import layer_weight_bytes
from controlplane.planner.profile import (
    GRAPH_VERSION,
    ROWS,
    LinkProfile,
    NodeProfile,
    ProfileError,
    ProfileKey,
    experts_form_change,
)
from controlplane.planner.quota import check_quota
from controlplane.planner.shape import ModelShape
from controlplane.records import ProfileRecord
from controlplane.schema import SchemaError, build
from zctl.weights import named_int8_form

PROFILE_FORMAT = "zctl-node-profile/3"
OLD_FORMATS = ("zctl-node-profile/1",)  # read only to say they are stale
UNANCHORED_FORMATS = ("zctl-node-profile/2",)  # read without their reference time
PROFILES_FORMAT = "zctl-node-profiles/1"  # several devices' profiles: {"profiles": [...]}
FLOOR_S = 1e-6  # no per-step figure is taken below a microsecond


class StaleProfile(ProfileError):
    """A profile written by an older zctl or timed on another layer graph: ``why``."""

    def __init__(self, why: str, where: str = "") -> None:
        self.why = why
        super().__init__(f"{where + ': ' if where else ''}its profile is stale ({why}): "
                         "profile it again (zctl node profile)")


@dataclass(frozen=True)
class Measurement:
    """What one device's profiling timed (seconds; bytes)."""

    key: ProfileKey
    extra_layers: int  # k: the second stage's layers beyond the base stage's one
    base_s: tuple[float, ...]  # one layer's stage, a decode step at ROWS rows
    more_s: tuple[float, ...]  # 1 + k layers
    head_s: tuple[float, ...]  # one layer and the LM head
    prompt_tokens: int  # the prompt both decoder stages prefilled (no past)
    base_prompt_s: float
    more_prompt_s: float
    base_bytes: int  # the process's growth for the base stage, its KV left out
    more_bytes: int
    free_memory: int
    engine_s: tuple[float, ...]  # the coordinator's own work per decode step at ROWS rows
    frame_s: tuple[float, ...]  # a node's frames' work per decode step at ROWS rows
    rounds: int = 0  # how many rounds of steps each figure is the quantile of
    seconds: float = 0.0  # how long profiling the device took, building included
    # the CPU quota the profiling process ran under (0: none) and the process CPU seconds a
    # timed decode step used per second of its wall time (the median of the steps'; 0: not
    # measured)
    cpu_share: float = 0.0
    quota_period_s: float = 0.0
    cpu_per_wall: float = 0.0

    def __post_init__(self) -> None:
        if self.extra_layers < 1 or self.prompt_tokens < 2:
            raise ProfileError(f"a measurement needs extra_layers >= 1 and a prompt of >= 2 "
                               f"tokens, got {self.extra_layers} and {self.prompt_tokens}")
        for name in ("base_s", "more_s", "head_s", "engine_s", "frame_s"):
            values = getattr(self, name)
            if len(values) != len(ROWS) or not all(math.isfinite(v) and v > 0 for v in values):
                raise ProfileError(f"a measurement's {name} needs {len(ROWS)} positive "
                                   f"seconds, got {list(values)}")
        for name in ("base_prompt_s", "more_prompt_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ProfileError(f"a measurement's {name} must be positive, got {value!r}")
        try:
            check_quota(self.cpu_share, self.quota_period_s, self.cpu_per_wall)
        except ValueError as exc:
            raise ProfileError(f"a measurement's {exc}") from None


def rising(values: Sequence[float], floor: float = FLOOR_S) -> tuple[float, ...]:
    """``values`` with none below ``floor`` and none below the one before it."""
    out: list[float] = []
    for value in values:
        out.append(max(floor, value, out[-1] if out else floor))
    return tuple(out)


def prefill_rate(layer_prompt_s: float, layer_step_s: float, tokens: int,
                 shape: ModelShape) -> float:
    """Prompt tokens per second of one layer, from its prefill of ``tokens`` tokens with no
    past (``layer_prompt_s``) and its one-row step: the rate at which timing.chunk_s
    predicts that prefill (``tokens - 1`` tokens beyond the first, and attention among
    them at the rate scaled by a token's multiply-accumulates per earlier token)."""
    ratio = shape.attention_macs_per_past() / shape.active_layer_weights()
    work = (tokens - 1) + ratio * tokens * tokens / 2
    beyond = layer_prompt_s - layer_step_s
    token_s = beyond / work if beyond > 0 else layer_prompt_s / tokens
    return 1.0 / max(token_s, FLOOR_S / tokens)


def profile_from(m: Measurement, shape: ModelShape, source: str) -> NodeProfile:
    """The profile a measurement of ``shape`` gives (the module docstring's arithmetic)."""
    if m.key.shape != shape.fingerprint():
        raise ProfileError(f"a measurement of shape {m.key.shape} cannot profile "
                           f"{shape.fingerprint()}")
    k = m.extra_layers
    layer = rising([(more - base) / k for more, base in zip(m.more_s, m.base_s, strict=True)])
    head = rising([h - b for h, b in zip(m.head_s, m.base_s, strict=True)])
    call = max(0.0, m.base_s[0] - layer[0])
    layer_prompt = (m.more_prompt_s - m.base_prompt_s) / k
    rate = prefill_rate(max(layer_prompt, FLOOR_S), layer[0], m.prompt_tokens, shape)
    weights = math.ceil(layer_weight_bytes(shape, m.key.weights, m.key.int8_form,
                                           m.key.exact_experts))
    layer_bytes = max(weights, round((m.more_bytes - m.base_bytes) / k))
    return NodeProfile(key=m.key, decode_s=layer, head_decode_s=head, prefill_tokens_per_s=rate,
                       call_s=call, engine_decode_s=rising(m.engine_s),
                       layer_bytes=layer_bytes, free_memory=m.free_memory, source=source,
                       frame_decode_s=rising(m.frame_s), cpu_share=m.cpu_share,
                       quota_period_s=m.quota_period_s, cpu_per_wall=m.cpu_per_wall)


# -- a profile as data ------------------------------------------------------------------
def profile_record(profile: NodeProfile, measured_at: float = 0.0,
                   seconds: float = 0.0) -> ProfileRecord:
    """``profile`` as a record, measured at ``measured_at`` in ``seconds`` (the host's
    reference workload not timed yet: its node times it, controlplane/host_speed.py)."""
    key = profile.key
    return ProfileRecord(key.shape, key.weights, key.device, key.openvino,
                         list(profile.decode_s), list(profile.head_decode_s),
                         profile.prefill_tokens_per_s, profile.call_s, profile.layer_bytes,
                         profile.free_memory, profile.source, measured_at, seconds, key.graph,
                         list(profile.engine_decode_s), list(profile.frame_decode_s),
                         profile.cpu_share, profile.quota_period_s, profile.cpu_per_wall,
                         key.int8_form, exact_experts=key.exact_experts)


def staleness(record: ProfileRecord) -> str:
    """Why ``record`` cannot be used whatever it was measured for ("" when it can): it
    lacks the coordinator's step (an older zctl's), or it timed another layer graph."""
    if not record.engine_decode_s:
        return ("it was measured by an older zctl, without the coordinator's step and the "
                "layer graph's version")
    if record.graph != GRAPH_VERSION:
        return f"it timed layer graph {record.graph}, not {GRAPH_VERSION}"
    return ""


def profile_of(record: ProfileRecord) -> NodeProfile:
    """The planner's profile of a record (StaleProfile when it is stale, ProfileError when
    its figures cannot be)."""
    stale = staleness(record)
    if stale:
        raise StaleProfile(stale)
    if not (math.isfinite(record.reference_s) and record.reference_s >= 0):
        raise ProfileError(f"reference_s must be >= 0 seconds, got {record.reference_s!r}")
    return NodeProfile(
        ProfileKey(record.shape, record.weights, record.device, record.openvino, record.graph,
                   record.int8_form, record.exact_experts),
        tuple(record.decode_s), tuple(record.head_decode_s), record.prefill_tokens_per_s,
        record.call_s, tuple(record.engine_decode_s), record.layer_bytes, record.free_memory,
        record.source, tuple(record.frame_decode_s), record.cpu_share, record.quota_period_s,
        record.cpu_per_wall)


KEY_NAMES = {"shape": "shape", "weights": "weights", "device": "device", "openvino": "OpenVINO",
             "int8_form": "INT8 form"}


def measured_for(record: ProfileRecord, name: str) -> str | None:
    """``record``'s ``name`` (a KEY_NAMES field); its INT8 form, where it names none, the
    default of its format (``zctl.weights.named_int8_form``)."""
    if name == "int8_form":
        return named_int8_form(record.weights, record.int8_form)
    return str(getattr(record, name))


def mismatches(record: ProfileRecord, exact_experts: bool | None = None,
               **want: str | None) -> list[str]:
    """What ``record`` was measured for that is not what is wanted (``want``: some of its
    ``shape``, ``weights``, ``device``, ``openvino``, ``int8_form``; ``exact_experts``: the
    form of its experts, None for any), as "weights 'int4', not 'int8'"."""
    found = [f"{KEY_NAMES[name]} {measured_for(record, name)!r}, not {value!r}"
             for name, value in want.items() if measured_for(record, name) != value]
    if exact_experts is not None and record.exact_experts != exact_experts:
        found.append(experts_form_change(record.exact_experts, exact_experts))
    return found


def profile_dict(record: ProfileRecord, measurement: Measurement | None = None) -> dict[str, Any]:
    """A profile file's JSON: the format, the record's fields and what was timed."""
    out: dict[str, Any] = {"format": PROFILE_FORMAT, **asdict(record)}
    if measurement is not None:
        timed = asdict(measurement)
        timed.pop("key")
        out["measurement"] = timed
    return out


def record_from_dict(raw: Any, where: str) -> ProfileRecord:
    """The record in a profile file's parsed JSON; ProfileError naming ``where`` and the
    field for anything missing, of the wrong type or impossible."""
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: not a profile (a JSON object of {PROFILE_FORMAT})")
    if raw.get("format") in OLD_FORMATS:
        raise StaleProfile(f"format {raw.get('format')}, of an older zctl, without the "
                           "coordinator's step and the layer graph's version", where)
    if raw.get("format") in UNANCHORED_FORMATS:
        raw = {**raw, "reference_s": 0.0}
    elif raw.get("format") != PROFILE_FORMAT:
        raise ProfileError(f"{where}: format {raw.get('format')!r}, not {PROFILE_FORMAT!r}: "
                           "not a profile zctl node profile wrote")
    known = {f.name for f in fields(ProfileRecord)}
    try:
        record = build(ProfileRecord, {k: v for k, v in raw.items() if k in known}, "profile")
    except SchemaError as exc:
        raise ProfileError(f"{where}: {exc}") from None
    try:
        profile_of(record)
    except StaleProfile as exc:
        raise StaleProfile(exc.why, where) from None
    except ProfileError as exc:
        raise ProfileError(f"{where}: {exc}") from None
    return record


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{path}: not JSON: {exc}") from None


def read_profile(path: Path) -> ProfileRecord:
    """A profile file (one a node keeps, or ``zctl node profile --json`` of one device)."""
    return record_from_dict(_read_json(path), str(path))


def read_profiles(path: Path) -> list[ProfileRecord]:
    """The profiles of a file ``zctl node profile --json`` wrote: one device's, or several
    (``PROFILES_FORMAT``)."""
    raw = _read_json(path)
    if isinstance(raw, dict) and raw.get("format") == PROFILES_FORMAT:
        items = raw.get("profiles")
        if not isinstance(items, list) or not items:
            raise ProfileError(f"{path}: profiles must be a non-empty list")
        return [record_from_dict(item, f"{path}: profile #{i + 1}")
                for i, item in enumerate(items)]
    return [record_from_dict(raw, str(path))]


# -- a link ---------------------------------------------------------------------------------
MAX_BPS = 1e11  # a link faster than the probe can tell (loopback) is taken at 100 GB/s


@dataclass(frozen=True)
class LinkSample:
    """One probe round trip: ``out`` bytes sent, ``back`` bytes returned, in ``seconds``;
    ``idle``: after an idle gap (the echo's end asleep, as a pipeline's receiver is), else
    right after another round trip (both ends awake)."""

    out: int
    back: int
    seconds: float
    idle: bool = True


def _quantile(values: Sequence[float], q: float = 0.25) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _bandwidth(points: dict[int, float], rtt: float) -> float:
    """Bytes per second from round trips by size, the round trip without payload taken
    off: the least-squares slope of time over bytes (the largest size alone when the
    slope says nothing)."""
    sizes = sorted(points)
    if len(sizes) >= 2:
        mean_x = sum(sizes) / len(sizes)
        mean_y = sum(points[s] for s in sizes) / len(sizes)
        spread = sum((s - mean_x) ** 2 for s in sizes)
        slope = sum((s - mean_x) * (points[s] - mean_y) for s in sizes) / spread
        if slope > 0:
            return min(MAX_BPS, 1.0 / slope)
    largest = sizes[-1]
    extra = points[largest] - rtt
    return MAX_BPS if extra <= largest / MAX_BPS else largest / extra


def hop_round_trip(idle_s: float, awake_s: float | None) -> float:
    """Twice a pipeline hop's latency from the smallest round trips' medians: after an idle
    gap (``idle_s``: the way out wakes an idle receiver, the answer returns to a prober
    that has just sent) and back to back (``awake_s``: both ways awake; None: not timed).
    A hop is a way to an idle receiver, ``idle_s - awake_s / 2``; never under ``awake_s``
    nor, without it, other than ``idle_s``."""
    if awake_s is None:
        return idle_s
    return max(awake_s, 2 * idle_s - awake_s)


def link_from_samples(samples: Sequence[LinkSample]) -> LinkProfile:
    """A link's figures from probe round trips: the round trip as a pipeline's frames see
    it, both ways to a receiver idle for a step (``hop_round_trip`` of the smallest round
    trips' medians, after idle gaps and back to back: a pipeline's hops take their median),
    and each way's bandwidth from the round trips that carried bytes that way (a lower
    quartile of each size's times, less the awake round trip: they follow one another, and
    a busy moment only ever adds time)."""
    if not samples:
        raise ProfileError("no probe round trips to make a link's figures of")
    small = min(min(s.out, s.back) for s in samples)
    pings = [s for s in samples if s.out == small and s.back == small]
    idle = [s.seconds for s in pings if s.idle]
    awake = [s.seconds for s in pings if not s.idle]
    if not pings:
        raise ProfileError("the probe sent no round trip of its smallest size both ways")
    awake_rtt = _quantile(awake, 0.5) if awake else None
    rtt = hop_round_trip(_quantile(idle or awake, 0.5), awake_rtt)
    base = rtt if awake_rtt is None else awake_rtt

    def way(pick: Any) -> float:
        by_size: dict[int, list[float]] = {}
        for s in samples:
            size = pick(s)
            if size is not None:
                by_size.setdefault(size, []).append(s.seconds)
        return _bandwidth({size: _quantile(times) for size, times in by_size.items()}, base)

    forward = way(lambda s: s.out if s.back == small else None)
    backward = way(lambda s: s.back if s.out == small else None)
    return LinkProfile(rtt, forward, backward)
