"""What the planner knows of a node and of a link: their figures, as data.

A ``NodeProfile`` is what ``zctl node profile`` measures on a node for one model shape,
weight format, device, OpenVINO version and synthetic layer graph (its ``ProfileKey``):
one layer's decode step at 1, 2, 4 and 8 rows, the LM head's, prefill throughput per
layer, the fixed cost of one inference call, the coordinator's own work per decode step
(the generation engine and the head's frames, at the same rows: counted when the node is
stage 0's), the node's framework work a hop per decode step (its frames decoded, prepared
and sealed: counted on every other stage), the memory one layer needs, and the node's free
memory, and the CPU quota the node is held to (a share of cores per period, with how many
cores its steps keep busy: controlplane/planner/quota.py). Until a node is
measured, ``references.derive_profile`` makes one from named reference figures. A
``LinkProfile`` is a link between two nodes: round-trip time and bandwidth each way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from controlplane.planner.quota import alone_step_s, busy_scale, busy_step_s, check_quota
from zctl.weights import named_int8_form

ROWS = (1, 2, 4, 8)  # the row counts a decode step is profiled at
# The version of the synthetic layer graph a profile times (dataplane/runtime/synthetic.py),
# part of its key: 1, seven MatMuls a layer; 2, Q/K/V and gate/up fused (four), as the
# exporter makes a layer now; 3, one-token steps on the one-token graph where a stage of
# such layers compiles one (dataplane/runtime/one_token.py); 4, the same graph's decode steps
# timed as a pipeline's stage runs them (after idle gaps, their median, through the worker's
# frame path, whose work is a figure of its own: controlplane/profiling.py); 5, INT8 in the
# symmetric i8 groups an int8 export is written in, not u8 per channel (zctl.weights); 6,
# the layers' weights on huge pages, as a paged stage (a cluster node's) holds them now.
GRAPH_VERSION = 6


class ProfileError(ValueError):
    """A profile is missing, malformed or was measured for something else."""


@dataclass(frozen=True)
class ProfileKey:
    """What a profile was measured for: a shape (``ModelShape.fingerprint``), a weight
    format, a device, an OpenVINO version ("reference" for derived profiles), the version
    of the synthetic layer graph it timed (``GRAPH_VERSION``; 0 for derived profiles) and
    the form of the INT8 weights it timed (zctl.weights.INT8_FORMS: the served export's;
    None in a float format, a derived profile, or a key that asks for any form), and whether
    a mixture of experts' weights were in their exact i8 form (``zctl export
    --exact-experts``) rather than in the format."""

    shape: str
    weights: str
    device: str
    openvino: str
    graph: int = 0
    int8_form: str | None = None
    exact_experts: bool = False


def experts_form_text(exact_experts: bool) -> str:
    return "exact experts" if exact_experts else "experts in the weight format"


def experts_form_change(have: bool, want: bool) -> str:
    """A profile's form of the experts, ``have``, against another one wanted, as a key's
    other fields are said: "exact experts, not experts in the weight format"."""
    return f"{experts_form_text(have)}, not {experts_form_text(want)}"


def _check_rows(name: str, values: tuple[float, ...], where: str) -> None:
    if len(values) != len(ROWS):
        raise ProfileError(f"{where}: {name} needs {len(ROWS)} figures (at {ROWS} rows), "
                           f"got {len(values)}")
    if any(not math.isfinite(v) or v <= 0 for v in values):
        raise ProfileError(f"{where}: {name} must be positive seconds, got {list(values)}")
    if any(b < a for a, b in zip(values, values[1:], strict=False)):
        raise ProfileError(f"{where}: {name} must not fall as rows grow, got {list(values)}")


def at_rows(values: tuple[float, ...], rows: float) -> float:
    """A per-step figure at ``rows`` rows from its values at ``ROWS``: linear between them,
    and beyond 8 rows along the 4-to-8 slope."""
    if rows <= ROWS[0]:
        return values[0]
    for (r0, v0), (r1, v1) in zip(zip(ROWS, values, strict=True),
                                  zip(ROWS[1:], values[1:], strict=True), strict=False):
        if rows <= r1:
            return v0 + (v1 - v0) * (rows - r0) / (r1 - r0)
    slope = (values[-1] - values[-2]) / (ROWS[-1] - ROWS[-2])
    return values[-1] + slope * (rows - ROWS[-1])


@dataclass(frozen=True)
class NodeProfile:
    """One node's figures for one model shape and weight format on one device."""

    key: ProfileKey
    decode_s: tuple[float, ...]  # one decoder layer's step at ROWS rows
    head_decode_s: tuple[float, ...]  # the final norm and LM head at ROWS rows
    prefill_tokens_per_s: float  # one decoder layer, prompt tokens with no past
    call_s: float  # the fixed cost of one inference call on this node (dispatch, frames)
    engine_decode_s: tuple[float, ...]  # the coordinator's own work per step at ROWS rows
    layer_bytes: int  # resident memory of one decoder layer (weights and buffers)
    free_memory: int  # bytes this node can give the model
    source: str = ""  # where the figures come from
    # a node's frames' work per decode step at ROWS rows (none: not known, taken as 0)
    frame_decode_s: tuple[float, ...] = ()
    # the CPU quota it is held to: cores of CPU time per period (0: none), and the cores a
    # decode step keeps busy (0: not measured, taken as one)
    cpu_share: float = 0.0
    quota_period_s: float = 0.0
    cpu_per_wall: float = 0.0

    def __post_init__(self) -> None:
        where = f"profile of {self.key.device} ({self.source or 'no source'})"
        try:
            check_quota(self.cpu_share, self.quota_period_s, self.cpu_per_wall)
        except ValueError as exc:
            raise ProfileError(f"{where}: {exc}") from None
        _check_rows("decode_s", self.decode_s, where)
        _check_rows("head_decode_s", self.head_decode_s, where)
        _check_rows("engine_decode_s", self.engine_decode_s, where)
        if self.frame_decode_s:
            _check_rows("frame_decode_s", self.frame_decode_s, where)
        for name in ("prefill_tokens_per_s", "call_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (name == "prefill_tokens_per_s"
                                                         and value == 0):
                raise ProfileError(f"{where}: {name} must be a positive number, got {value!r}")
        if self.layer_bytes < 1 or self.free_memory < 0:
            raise ProfileError(f"{where}: layer_bytes must be positive and free_memory not "
                               f"negative, got {self.layer_bytes} and {self.free_memory}")

    def layer_s(self, rows: float) -> float:
        return at_rows(self.decode_s, rows)

    def head_s(self, rows: float) -> float:
        return at_rows(self.head_decode_s, rows)

    def engine_s(self, rows: float) -> float:
        """The coordinator's own work per decode step of ``rows`` rows on this node."""
        return at_rows(self.engine_decode_s, rows)

    def frame_s(self, rows: float) -> float:
        """A node's frames' work per decode step of ``rows`` rows (0 when not known)."""
        return at_rows(self.frame_decode_s, rows) if self.frame_decode_s else 0.0

    def alone_s(self, wall_s: float) -> float:
        """A step that takes ``wall_s`` unthrottled, on this node after an idle gap (its
        quota's slowing, if any: controlplane/planner/quota.py)."""
        return alone_step_s(wall_s, self.cpu_per_wall, self.cpu_share, self.quota_period_s)

    def busy_s(self, wall_s: float) -> float:
        """The same step on this node stepping back to back: never under its CPU time
        over its quota's share."""
        return busy_step_s(wall_s, self.cpu_per_wall, self.cpu_share, self.quota_period_s)

    def busy_scale(self) -> float:
        """``busy_s`` as a factor of a long step's time (the split's linear stand-in)."""
        return busy_scale(self.cpu_per_wall, self.cpu_share)

    def check_for(self, key: ProfileKey, node: str) -> None:
        """ProfileError when this profile was measured for another shape, format, device,
        OpenVINO version, layer graph, INT8 form or form of the experts than ``key`` (a
        derived profile, or a key of version "reference" or graph 0, matches any version or
        graph; a key without an INT8 form, any form)."""
        mine = self.key
        stale = [f"{what} {have!r}, not {want!r}" for what, have, want in (
            ("shape", mine.shape, key.shape), ("weights", mine.weights, key.weights),
            ("device", mine.device, key.device)) if have != want]
        if mine.openvino != "reference" and key.openvino not in ("reference", mine.openvino):
            stale.append(f"OpenVINO {mine.openvino}, not {key.openvino}")
        if mine.graph and key.graph and mine.graph != key.graph:
            stale.append(f"layer graph {mine.graph}, not {key.graph}")
        form = named_int8_form(mine.weights, mine.int8_form)
        if mine.graph and key.int8_form is not None and form != key.int8_form:
            stale.append(f"INT8 form {form!r}, not {key.int8_form!r}")
        if mine.graph and mine.exact_experts != key.exact_experts:
            stale.append(experts_form_change(mine.exact_experts, key.exact_experts))
        if stale:
            raise ProfileError(f"node {node}: its profile was measured for {'; '.join(stale)}: "
                               "profile it again (zctl node profile)")


@dataclass(frozen=True)
class LinkProfile:
    """A link between two nodes a and b: round-trip time and bytes per second each way.
    A probed link's round trip is as a pipeline's frames see it, each way to a receiver
    idle for a step (controlplane/planner/measured.py, ``hop_round_trip``)."""

    rtt_s: float
    forward_bps: float  # a to b
    backward_bps: float  # b to a

    def __post_init__(self) -> None:
        if not math.isfinite(self.rtt_s) or self.rtt_s < 0:
            raise ProfileError(f"a link's round-trip time must be >= 0 s, got {self.rtt_s!r}")
        for bps in (self.forward_bps, self.backward_bps):
            if not bps > 0:
                raise ProfileError(f"a link's bandwidth must be positive, got {bps!r}")

    def reversed(self) -> LinkProfile:
        return LinkProfile(self.rtt_s, self.backward_bps, self.forward_bps)

    def latency_s(self, nbytes: float) -> float:
        """From the send of ``nbytes`` a to b to their arrival: half the round trip, and
        the bytes at the forward bandwidth."""
        return self.rtt_s / 2 + nbytes / self.forward_bps

    def busy_s(self, nbytes: float) -> float:
        """How long ``nbytes`` a to b occupy the link (the next frame waits that long)."""
        return nbytes / self.forward_bps


class Links:
    """The links between nodes, by pair: ``link(a, b)`` is a to b (a pair given as (b, a)
    is the same link reversed)."""

    def __init__(self, pairs: Mapping[tuple[str, str], LinkProfile]) -> None:
        self._pairs: dict[tuple[str, str], LinkProfile] = {}
        for (a, b), link in pairs.items():
            if a == b:
                raise ProfileError(f"a link from {a} to itself")
            if (a, b) in self._pairs:
                raise ProfileError(f"the link between {a} and {b} is given twice")
            self._pairs[(a, b)] = link
            self._pairs[(b, a)] = link.reversed()

    def link(self, a: str, b: str) -> LinkProfile:
        try:
            return self._pairs[(a, b)]
        except KeyError:
            raise ProfileError(f"no link figures between {a} and {b}") from None

    def check_nodes(self, nodes: Iterable[str]) -> None:
        """ProfileError naming the first pair of ``nodes`` without a link."""
        names = list(nodes)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                self.link(a, b)
