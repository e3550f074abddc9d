"""Cumulative metrics of an executor for a metrics scrape: histograms of per-stage compute
and per-hop network time, and the bytes each hop carried.

``StepMetrics`` is what an executor keeps. The hot path only appends a reply's raw
``TimingStamps`` (or a LocalChain step's stage times) to a queue, ~0.1 us; the queue is
folded into cumulative histograms in batches, vectorised (``derive_compute_network``,
~0.3 us a sample), when the executor is idle waiting for a reply, when a stats request
asks, or at once when ``DRAIN_AT`` samples pile up. No sample is dropped. Not
thread-safe: the thread that drives the executor owns its metrics.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from dataplane.wire.frames import TIMING
from dataplane.wire.timing import TimingStamps, derive_compute_network
from zctl.engine.executor import Executor

# Bucket upper bounds in ms for step times from 0.05 ms to 10 s: about x1.5 apart where
# compute and hops usually fall (0.1-300 ms), coarser outside.
DEFAULT_BOUNDS_MS: tuple[float, ...] = (
    0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
    50.0, 75.0, 100.0, 150.0, 200.0, 300.0, 500.0, 750.0, 1000.0, 2000.0, 5000.0, 10000.0)


class CumulativeHistogram:
    """Counts of observed values per bucket, and their sum, since it was made.

    ``bounds`` are ascending bucket upper bounds; a value v falls in the first bucket whose
    bound is >= v (Prometheus' ``le``), or in the implicit +Inf bucket after the last.
    ``counts`` are per bucket (not cumulative), ``len(bounds) + 1`` of them.
    """

    def __init__(self, bounds: Sequence[float] = DEFAULT_BOUNDS_MS) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        if not self.bounds or not all(math.isfinite(b) for b in self.bounds):
            raise ValueError("histogram bounds must be finite numbers, at least one")
        if any(a >= b for a, b in zip(self.bounds, self.bounds[1:], strict=False)):
            raise ValueError(f"histogram bounds must be strictly ascending: {self.bounds}")
        self._edges = np.asarray(self.bounds, dtype=np.float64)
        self._counts = np.zeros(len(self.bounds) + 1, dtype=np.int64)
        self.total = 0.0

    @property
    def counts(self) -> list[int]:
        return [int(c) for c in self._counts]

    @property
    def count(self) -> int:
        return int(self._counts.sum())

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += float(value)

    def observe_many(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        if values.size:
            self._counts += np.bincount(np.searchsorted(self._edges, values, side="left"),
                                        minlength=self._counts.size)
            self.total += float(values.sum())

    def merge(self, other: CumulativeHistogram) -> None:
        """Add ``other``'s observations (same bounds) to these."""
        if other.bounds != self.bounds:
            raise ValueError("cannot merge histograms with different bounds")
        self._counts += other._counts
        self.total += other.total

    def copy(self) -> CumulativeHistogram:
        out = CumulativeHistogram(self.bounds)
        out.merge(self)
        return out


def hop_names(num_stages: int) -> list[str]:
    """The hops of a ring of ``num_stages``: "0-1", "1-2", ..., and "<last>-c" back to the
    coordinator."""
    return [f"{i}-{i + 1}" for i in range(num_stages - 1)] + [f"{num_stages - 1}-c"]


class StepMetrics:
    """One executor's cumulative metrics: per-stage compute histograms, per-hop network
    histograms (``hops``: the executor sends frames) and byte counts.

    Bytes: ``sent_bytes`` is every frame stage 0 sent (hop 0-1), ``received_bytes`` every
    frame the coordinator received (the last hop), counted as they pass. A middle hop
    k-(k+1) of three or more stages is not seen here: it carries the same frames as hop
    0-1, each step frame with k more timing records (``hop_bytes`` counts it so), which is
    exact as long as no stage drops or refuses a frame.
    """

    DRAIN_AT = 1024  # queued samples that make add_* fold them in at once
    IDLE_DRAIN_AT = 128  # ... and that an idle executor folds in (``drain_when_idle``)

    def __init__(self, num_stages: int, hops: bool,
                 bounds: Sequence[float] = DEFAULT_BOUNDS_MS) -> None:
        self.num_stages = num_stages
        self.compute = [CumulativeHistogram(bounds) for _ in range(num_stages)]
        self.network = [CumulativeHistogram(bounds) for _ in range(num_stages)] if hops else []
        self.sent_bytes = 0
        self.received_bytes = 0
        self.step_frames = 0  # STEP frames stage 0 sent
        self._stamps: deque[TimingStamps] = deque()
        self._stage_ms: deque[Sequence[float]] = deque()

    @property
    def backlog(self) -> int:
        """Samples queued and not yet in the histograms."""
        return len(self._stamps) + len(self._stage_ms)

    def add_stamps(self, stamps: TimingStamps) -> None:
        """A reply's timing (the hot path: an append)."""
        self._stamps.append(stamps)
        if len(self._stamps) >= self.DRAIN_AT:
            self.drain()

    def add_stage_ms(self, stage_ms: Sequence[float]) -> None:
        """One in-process step's compute time per stage, in ms (no frames, no hops)."""
        self._stage_ms.append(stage_ms)
        if len(self._stage_ms) >= self.DRAIN_AT:
            self.drain()

    def drain_when_idle(self) -> None:
        """Fold the queue in if enough has piled up (call while waiting for a reply)."""
        if len(self._stamps) >= self.IDLE_DRAIN_AT:
            self.drain()

    def drain(self) -> None:
        """Fold every queued sample into the histograms."""
        if self._stamps:
            stamps = list(self._stamps)
            self._stamps.clear()
            by_stages: dict[int, list[TimingStamps]] = {}
            for s in stamps:  # (one group: every reply passed every stage)
                by_stages.setdefault(len(s.timings), []).append(s)
            for group in by_stages.values():
                compute, network = derive_compute_network(group)
                self._observe(self.compute, compute)
                self._observe(self.network, network)
        if self._stage_ms:
            rows = list(self._stage_ms)
            self._stage_ms.clear()
            widths = {len(r) for r in rows}
            for width in widths:
                self._observe(self.compute, np.array([r for r in rows if len(r) == width],
                                                     dtype=np.float64))

    @staticmethod
    def _observe(histograms: list[CumulativeHistogram], values: np.ndarray) -> None:
        for column, histogram in zip(values.T, histograms, strict=False):
            histogram.observe_many(column)

    def hop_bytes(self) -> list[int]:
        """Bytes per hop, in ``hop_names`` order (empty without hops); see the class doc."""
        if not self.network:
            return []
        middle = [self.sent_bytes + k * TIMING.size * self.step_frames
                  for k in range(1, self.num_stages - 1)]
        return [self.sent_bytes, *middle, self.received_bytes]

    def absorb(self, other: StepMetrics) -> None:
        """Add everything ``other`` measured (drained first) to these metrics."""
        other.drain()
        self.drain()
        for mine, theirs in ((self.compute, other.compute), (self.network, other.network)):
            for i, histogram in enumerate(theirs):
                if i < len(mine):
                    mine[i].merge(histogram)
                else:
                    mine.append(histogram.copy())
        self.num_stages = max(self.num_stages, other.num_stages)
        self.sent_bytes += other.sent_bytes
        self.received_bytes += other.received_bytes
        self.step_frames += other.step_frames


class MeasuredExecutor(Executor, Protocol):
    """An executor that keeps its metrics for a scrape and tells the KV its own stages
    hold: what the generation service reports (ClusterHead and LocalChain are both)."""

    metrics: StepMetrics

    def kv_slots(self) -> dict[int, int]:
        """KV slots each stage run in this process holds, by stage index."""
        ...
