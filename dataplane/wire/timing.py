"""Per-step timing breakdown of a pipelined step, derived from the frames' timing records.

Pure functions. Every stage stamps a record (see dataplane.wire.frames.TIMING) as a frame
passes; the coordinator adds its own arrival record for the reply. From consecutive
records each hop splits into serialisation (sender's encode + receiver's decode),
queueing (the frame waited because the receiver was busy) and network (the rest of
the gap between the sender's send stamp and the receiver's arrival stamp).

Each sender stamps its send time after encoding, right before the send, so transit
(and network) time is what a raw ZeroMQ message would take: the send and receive calls,
the I/O threads, the kernel and the wake-up of the receiver. Per-hop figures compare
wall clocks of two machines: they are exact on one host and as good as the clock sync
(NTP/PTP) across hosts. ``transit_ms`` (all time between send and receive stamps)
uses only same-clock differences and is exact everywhere.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np

from dataplane.wire.frames import TIMING, TIMING_DTYPE

NS_PER_MS = 1e6


@dataclass(frozen=True)
class HopTiming:
    """One hop from stage ``src`` to stage ``dst`` (``dst`` = stage count: the coordinator)."""

    src: int
    dst: int
    serialise_ms: float
    queue_ms: float
    network_ms: float


@dataclass(frozen=True)
class StepTiming:
    """Where the time of one pipelined step went."""

    compute_ms: tuple[float, ...]  # runner time per stage, stage order
    hops: tuple[HopTiming, ...]  # stage 0 -> 1, ..., last stage -> coordinator
    total_ms: float  # submit start to reply built, on the coordinator's clock
    transit_ms: float  # time between send and receive stamps, all hops (clock-skew free)

    @property
    def network_ms(self) -> float:
        return sum(h.network_ms for h in self.hops)

    @property
    def overhead_ms(self) -> float:
        """Framework time: the step minus stage compute minus time in transit."""
        return self.total_ms - sum(self.compute_ms) - self.transit_ms


class TimingStamps(NamedTuple):
    """What the coordinator keeps per reply; cheap to make, derived only when looked at."""

    timings: bytes  # the reply's packed per-stage records
    recv_ns: int  # the coordinator's arrival stamp (wall clock)
    ready_ns: int  # when the coordinator started waiting for it
    decode_ns: int
    start_ns: int  # the step's submit (wall clock)
    end_ns: int  # reply decoded (wall clock)

    def derive(self) -> StepTiming:
        return derive_step_timing(*self)


def compute_ms(timings: bytes) -> list[float]:
    """Per-stage compute ms straight from packed timing records."""
    return [r[5] / NS_PER_MS for r in TIMING.iter_unpack(timings)]


def derive_step_timing(timings: bytes, coord_recv_ns: int, coord_ready_ns: int,
                       coord_decode_ns: int, start_ns: int, end_ns: int) -> StepTiming:
    """Build a StepTiming from a reply's timing records and the coordinator's own stamps.

    ``start_ns``/``end_ns`` bound the whole step on the coordinator (wall clock, ns);
    the coordinator's arrival (recv, ready, decode) closes the last hop.
    """
    records = list(TIMING.iter_unpack(timings))
    if not records:
        raise ValueError("a reply without timing records")
    hops = []
    busy_ns = end_ns - coord_recv_ns  # the coordinator's own work on the reply
    for i, (stage, recv, _ready, send, _decode, _compute, encode) in enumerate(records):
        busy_ns += send - recv
        if i + 1 < len(records):
            dst, next_recv, next_ready, _, next_decode, _, _ = records[i + 1]
        else:
            dst, next_recv, next_ready, next_decode = (stage + 1, coord_recv_ns, coord_ready_ns,
                                                       coord_decode_ns)
        gap = max(0, next_recv - send)
        queue = min(gap, max(0, next_ready - send))
        hops.append(HopTiming(src=stage, dst=dst, serialise_ms=(encode + next_decode) / NS_PER_MS,
                              queue_ms=queue / NS_PER_MS, network_ms=(gap - queue) / NS_PER_MS))
    total_ns = end_ns - start_ns
    return StepTiming(
        compute_ms=tuple(r[5] / NS_PER_MS for r in records), hops=tuple(hops),
        total_ms=total_ns / NS_PER_MS, transit_ms=max(0, total_ns - busy_ns) / NS_PER_MS,
    )


def derive_compute_network(stamps: Sequence[TimingStamps]) -> tuple[np.ndarray, np.ndarray]:
    """Per-stage compute ms and per-hop network ms of many replies at once, each [N, S]
    (S: the stage count; every reply must carry S records): ``derive_step_timing``'s
    ``compute_ms`` and ``hops[i].network_ms``, in a few numpy calls for the whole batch."""
    records = np.frombuffer(b"".join([s.timings for s in stamps]), TIMING_DTYPE)
    records = records.reshape(len(stamps), -1)
    if not records.shape[1]:
        raise ValueError("a reply without timing records")
    coordinator = np.array([(s.recv_ns, s.ready_ns) for s in stamps], dtype=np.int64)
    next_recv = np.concatenate((records["recv_ns"][:, 1:], coordinator[:, :1]), axis=1)
    next_ready = np.concatenate((records["ready_ns"][:, 1:], coordinator[:, 1:]), axis=1)
    send = records["send_ns"]
    gap = np.maximum(0, next_recv - send)
    queue = np.minimum(gap, np.maximum(0, next_ready - send))
    return records["compute_ns"] / NS_PER_MS, (gap - queue) / NS_PER_MS


def flatten(timing: StepTiming) -> dict[str, float]:
    """One flat name -> ms mapping (for tables, JSON and percentiles)."""
    out = {f"stage{i}.compute": ms for i, ms in enumerate(timing.compute_ms)}
    for hop in timing.hops:
        name = f"hop{hop.src}-{hop.dst}"
        for f in fields(HopTiming):
            if f.name.endswith("_ms"):
                out[f"{name}.{f.name[:-3]}"] = getattr(hop, f.name)
    out.update(total=timing.total_ms, transit=timing.transit_ms, network=timing.network_ms,
               overhead=timing.overhead_ms)
    return out


def percentiles(samples: list[dict[str, float]], qs: tuple[float, ...] = (50, 95)
                ) -> dict[str, dict[str, float]]:
    """For each name present in every sample: {"p50": ..., "p95": ...}."""
    if not samples:
        return {}
    names = [n for n in samples[0] if all(n in s for s in samples)]
    table = np.array([[s[n] for n in names] for s in samples], dtype=np.float64)
    values = np.percentile(table, qs, axis=0)
    return {n: {f"p{q:g}": float(values[j, i]) for j, q in enumerate(qs)}
            for i, n in enumerate(names)}


class TimingWindow:
    """The last ``size`` step timings, summarised as percentiles (readable from any thread).

    Raw TimingStamps may be added (the hot path does): each is derived and flattened
    once, the first time a summary needs it, so a summary costs the new samples plus one
    percentile pass, not a re-derivation of the whole window.
    """

    def __init__(self, size: int = 512) -> None:
        self._samples: deque[StepTiming | TimingStamps] = deque(maxlen=size)
        self._names: tuple[str, ...] = ()  # the flattened figures' names, in row order
        self._rows: deque[tuple[float, ...]] = deque(maxlen=size)  # their values, oldest first
        self._fresh = 0  # samples added since _rows last caught up (at most size)
        self._size = size
        self._lock = threading.Lock()

    def add(self, timing: StepTiming | TimingStamps) -> None:
        with self._lock:
            self._samples.append(timing)
            self._fresh = min(self._size, self._fresh + 1)

    def __len__(self) -> int:
        return len(self._samples)

    def samples(self) -> list[StepTiming]:
        with self._lock:
            raw = list(self._samples)
        return [t.derive() if isinstance(t, TimingStamps) else t for t in raw]

    def summary(self, qs: tuple[float, ...] = (50, 95)) -> dict[str, dict[str, float]]:
        """Percentiles of every flattened figure (``stage1.compute``, ``hop0-1.network``...)."""
        with self._lock:
            if self._fresh:
                for t in list(self._samples)[-self._fresh:]:
                    self._add_row(flatten(t.derive() if isinstance(t, TimingStamps) else t))
                self._fresh = 0
            names, rows = self._names, list(self._rows)
        if not rows:
            return {}
        values = np.percentile(np.array(rows, dtype=np.float64), qs, axis=0)
        return {n: {f"p{q:g}": float(values[j, i]) for j, q in enumerate(qs)}
                for i, n in enumerate(names)}

    def _add_row(self, flat: dict[str, float]) -> None:
        names = tuple(flat)
        if names != self._names:  # another stage count: older rows do not compare
            self._names = names
            self._rows.clear()
        self._rows.append(tuple(flat.values()))

    def clear(self) -> None:
        with self._lock:
            self._samples.clear()
            self._rows.clear()
            self._names = ()
            self._fresh = 0
