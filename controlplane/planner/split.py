"""The layers of an order of nodes: contiguous ranges chosen exactly by dynamic programming.

Given the nodes in pipeline order, each in its role (stage 0 holds the embedding, the last
stage the LM head), a stage of ``c`` layers on node ``i`` takes ``fixed_i + c * per_layer_i``
seconds a step and holds at most ``max_layers_i`` layers in its memory. ``min_sum_split``
finds the counts (every node at least one layer) with the least total stage time under an
optional limit on every stage's time, by dynamic programming over nodes and layers.
``SplitTable`` answers, for one such order, the split that minimises a round of row
groups, ``max(total + hops, groups * max(slowest stage, busiest link))``: the round as a
function of the limit T is the larger of a falling and a rising function, so the best T is
where they cross, found by bisection over the stage times that can occur. A stage's time
as the slowest may be its time scaled (``busy_scale``: a node held to a CPU quota steps no
faster back to back than its CPU time over its share), its time within the total not.

Both may be given the layer boundaries a split may cut at (``cuts``: an export's stage
boundaries, when a placement must run whole exported stages): a stage may then end only at
one of them, every other boundary being out of reach.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StageBounds:
    """One node in its role: a step takes ``fixed_s + layers * per_layer_s``; it holds at
    most ``max_layers`` layers; stepping back to back (as the slowest stage) it takes
    ``busy_scale`` times that (above 1 on a node whose CPU quota holds it to less)."""

    fixed_s: float
    per_layer_s: float
    max_layers: int
    busy_scale: float = 1.0


def cut_positions(cuts: Collection[int], num_layers: int) -> np.ndarray:
    """The boundaries a stage may start or end at: 0, the ``cuts`` and ``num_layers``,
    ascending; ValueError for a cut outside ``1..num_layers - 1``."""
    bad = sorted(c for c in cuts if not 0 < c < num_layers)
    if bad:
        raise ValueError(f"cut points {bad} are not between layers 1 and {num_layers - 1}")
    return np.array(sorted({0, *cuts, num_layers}))


def min_sum_split(stages: Sequence[StageBounds], num_layers: int,
                  caps: Sequence[int] | None = None,
                  cuts: Collection[int] | None = None) -> tuple[float, tuple[int, ...]] | None:
    """The layer counts, one per stage in order and summing to ``num_layers``, with the
    least total stage time; ``caps`` (default: each stage's ``max_layers``) bound the
    counts, ``cuts`` (default: any) are the boundaries a stage may end at. None when no
    split fits."""
    caps = [s.max_layers for s in stages] if caps is None else list(caps)
    if not stages or len(stages) > num_layers or min(caps) < 1:
        return None
    if cuts is not None:
        return _min_sum_at_cuts(stages, num_layers, caps, cut_positions(cuts, num_layers))
    best = np.full(num_layers + 1, np.inf)
    best[0] = 0.0
    rows = np.arange(num_layers + 1)
    picks = []
    for stage, cap in zip(stages, caps, strict=True):
        counts = np.arange(1, min(cap, num_layers) + 1)
        before = rows[:, None] - counts[None, :]  # layers held by the stages before
        take = (np.where(before >= 0, best[np.maximum(before, 0)], np.inf)
                + counts[None, :] * stage.per_layer_s)
        pick = take.argmin(axis=1)
        best = take[rows, pick] + stage.fixed_s
        picks.append(counts[pick])
    if not math.isfinite(best[num_layers]):
        return None
    counts_back, left = [], num_layers
    for pick in reversed(picks):
        count = int(pick[left])
        counts_back.append(count)
        left -= count
    return float(best[num_layers]), tuple(reversed(counts_back))


def _min_sum_at_cuts(stages: Sequence[StageBounds], num_layers: int, caps: Sequence[int],
                     positions: np.ndarray) -> tuple[float, tuple[int, ...]] | None:
    """``min_sum_split`` with stages starting and ending only at ``positions``: the DP
    over those boundaries (best[i]: the least total of the stages so far ending at
    positions[i])."""
    span = positions[:, None] - positions[None, :]  # layers from boundary j to boundary i
    best = np.full(len(positions), np.inf)
    best[0] = 0.0
    rows = np.arange(len(positions))
    picks = []
    for stage, cap in zip(stages, caps, strict=True):
        take = np.where((span >= 1) & (span <= cap),
                        best[None, :] + span * stage.per_layer_s, np.inf)
        pick = take.argmin(axis=1)  # the boundary the stage starts at
        best = take[rows, pick] + stage.fixed_s
        picks.append(pick)
    if not math.isfinite(best[-1]):
        return None
    counts_back, at = [], len(positions) - 1
    for pick in reversed(picks):
        start = int(pick[at])
        counts_back.append(int(positions[at] - positions[start]))
        at = start
    return float(best[-1]), tuple(reversed(counts_back))


class SplitTable:
    """Splits of one order of stages (at one row count), memoised by the caps a limit on
    the slowest stage implies; ``cuts``: the boundaries a stage may end at (None: any)."""

    def __init__(self, stages: Sequence[StageBounds], num_layers: int,
                 cuts: Collection[int] | None = None) -> None:
        self.stages = tuple(stages)
        self.num_layers = num_layers
        self.cuts = None if cuts is None else frozenset(cuts)
        times = [(s.fixed_s + np.arange(1, min(s.max_layers, num_layers) + 1) * s.per_layer_s)
                 * s.busy_scale for s in self.stages]
        self.limits = np.unique(np.concatenate(times)) if times else np.zeros(0)
        # caps[j, i]: the layers stage i can take within limits[j]
        self._caps = (np.stack([np.searchsorted(t, self.limits, side="right") for t in times],
                               axis=1) if times else np.zeros((0, 0), dtype=int))
        fits = ((self._caps.min(axis=1, initial=num_layers) >= 1)
                & (self._caps.sum(axis=1) >= num_layers)) if len(self.limits) else np.zeros(0, bool)
        # the first limit any split fits under (a split fits when every stage can take a
        # layer and together they can take them all), len(limits) when none does
        self.first_fit = (int(np.argmax(fits)) if len(self.stages) <= num_layers and fits.any()
                          else len(self.limits))
        self._memo: dict[tuple[int, ...], tuple[float, tuple[int, ...]] | None] = {}
        self._by_index: dict[int, tuple[float, tuple[int, ...]] | None] = {}
        self._least_total: float | None = None
        if self.cuts is not None:
            self.first_fit = self._first_fit_at_cuts()

    def _first_fit_at_cuts(self) -> int:
        """The first limit some split at the cuts fits under (looser limits fit more
        splits: found by bisection), len(limits) when none does."""
        low, high = self.first_fit, len(self.limits)
        if low >= high or self.under(high - 1) is None:
            return len(self.limits)
        high -= 1
        while low < high:
            mid = (low + high) // 2
            if self.under(mid) is None:
                low = mid + 1
            else:
                high = mid
        return low

    def under(self, index: int) -> tuple[float, tuple[int, ...]] | None:
        """The least-total split whose every stage takes at most ``limits[index]`` seconds."""
        if index not in self._by_index:
            caps = tuple(int(c) for c in self._caps[index])
            if caps not in self._memo:
                self._memo[caps] = min_sum_split(self.stages, self.num_layers, caps,
                                                 self.cuts)
            self._by_index[index] = self._memo[caps]
        return self._by_index[index]

    def best_round(self, hop_s: float, link_busy_s: float,
                   groups: int) -> tuple[float, tuple[int, ...]] | None:
        """The split minimising ``max(total + hop_s, groups * max(slowest, link_busy_s))``
        and that round; None when no split fits."""
        if self.first_fit >= len(self.limits):
            return None

        def rounds(index: int) -> tuple[float, float, tuple[int, ...]]:
            found = self.under(index)
            assert found is not None  # every limit from first_fit on has a split
            return (found[0] + hop_s, groups * max(float(self.limits[index]), link_busy_s),
                    found[1])

        low, high = self.first_fit, len(self.limits) - 1
        while low < high:  # the first limit where the rising term reaches the falling one
            mid = (low + high) // 2
            total, rising, _ = rounds(mid)
            if rising >= total:
                high = mid
            else:
                low = mid + 1
        choices = [rounds(i) for i in (low - 1, low) if i >= self.first_fit]
        best = min((max(total, rising), counts) for total, rising, counts in choices)
        return best[0], best[1]

    def lower_bound(self, hop_s: float, link_busy_s: float, groups: int) -> float:
        """A round no split beats with hops of at least ``hop_s`` and links busy at least
        ``link_busy_s``: the least total (every stage its fixed time and a layer, the rest
        on the cheapest layers first) and the least slowest stage any split fits under."""
        if self.first_fit >= len(self.limits):
            return math.inf
        if self._least_total is None:
            need = self.num_layers
            total = sum(s.fixed_s + s.per_layer_s for s in self.stages)
            left = need - len(self.stages)
            for s in sorted(self.stages, key=lambda s: s.per_layer_s):
                take = min(left, min(s.max_layers, need) - 1)
                total += take * s.per_layer_s
                left -= take
            self._least_total = total
        return max(self._least_total + hop_s,
                   groups * max(float(self.limits[self.first_fit]), link_busy_s))
