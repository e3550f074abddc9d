"""The layers of an order of nodes: contiguous ranges chosen exactly by dynamic programming.

Given the nodes in pipeline order, each in its role (stage 0 holds the embedding, the last
stage the LM head), a stage of ``c`` layers on node ``i`` takes ``fixed_i + c * per_layer_i``
seconds a step and holds at most ``max_layers_i`` layers in its memory. ``min_sum_split``
finds the counts (every node at least one layer) with the least total stage time under an
optional limit on every stage's time, by dynamic programming over nodes and layers.
``SplitTable`` answers, for one such order, the split that minimises a round of row
groups, ``max(total + hops, groups * max(slowest stage, busiest link))``: the round as a
function of the limit T is the larger of a falling and a rising function, so the best T is
where they cross, found by bisection over the stage times that can occur.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StageBounds:
    """One node in its role: a step takes ``fixed_s + layers * per_layer_s``; it holds at
    most ``max_layers`` layers."""

    fixed_s: float
    per_layer_s: float
    max_layers: int


def min_sum_split(stages: Sequence[StageBounds], num_layers: int,
                  caps: Sequence[int] | None = None) -> tuple[float, tuple[int, ...]] | None:
    """The layer counts, one per stage in order and summing to ``num_layers``, with the
    least total stage time; ``caps`` (default: each stage's ``max_layers``) bound the
    counts. None when no split fits."""
    caps = [s.max_layers for s in stages] if caps is None else list(caps)
    if not stages or len(stages) > num_layers or min(caps) < 1:
        return None
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


class SplitTable:
    """Splits of one order of stages (at one row count), memoised by the caps a limit on
    the slowest stage implies."""

    def __init__(self, stages: Sequence[StageBounds], num_layers: int) -> None:
        self.stages = tuple(stages)
        self.num_layers = num_layers
        self._times = [s.fixed_s + np.arange(1, min(s.max_layers, num_layers) + 1) * s.per_layer_s
                       for s in self.stages]
        self.limits = (np.unique(np.concatenate(self._times)) if self._times
                       else np.zeros(0))
        self._memo: dict[tuple[int, ...], tuple[float, tuple[int, ...]] | None] = {}

    def under(self, limit: float) -> tuple[float, tuple[int, ...]] | None:
        """The least-total split whose every stage takes at most ``limit`` seconds."""
        caps = tuple(int(np.searchsorted(t, limit, side="right")) for t in self._times)
        if caps not in self._memo:
            self._memo[caps] = min_sum_split(self.stages, self.num_layers, caps)
        return self._memo[caps]

    def best_round(self, hop_s: float, link_busy_s: float,
                   groups: int) -> tuple[float, tuple[int, ...]] | None:
        """The split minimising ``max(total + hop_s, groups * max(slowest, link_busy_s))``
        and that round; None when no split fits."""
        def rounds(index: int) -> tuple[float, float, tuple[int, ...] | None]:
            limit = float(self.limits[index])
            found = self.under(limit)
            total = math.inf if found is None else found[0] + hop_s
            return total, groups * max(limit, link_busy_s), None if found is None else found[1]

        if not len(self.limits) or self.under(float(self.limits[-1])) is None:
            return None
        low, high = 0, len(self.limits) - 1
        while low < high:  # the first limit where the rising term reaches the falling one
            mid = (low + high) // 2
            total, rising, _ = rounds(mid)
            if rising >= total:
                high = mid
            else:
                low = mid + 1
        choices = [rounds(i) for i in (low - 1, low) if i >= 0]
        best = min((max(total, rising), counts) for total, rising, counts in choices
                   if counts is not None)
        return best[0], best[1]

    def lower_bound(self, groups: int) -> float:
        """A round no split can beat, whatever the hops, from relaxed counts (fractions of a
        layer allowed): every stage at least its fixed time and one layer, the least total,
        and the least slowest stage."""
        need = self.num_layers
        stages = self.stages
        if not stages or sum(min(s.max_layers, need) for s in stages) < need or len(stages) > need:
            return math.inf
        total = sum(s.fixed_s + s.per_layer_s for s in stages)
        left = need - len(stages)
        for s in sorted(stages, key=lambda s: s.per_layer_s):
            take = min(left, min(s.max_layers, need) - 1)
            total += take * s.per_layer_s
            left -= take
        def holds(limit: float) -> float:
            return sum(min(min(s.max_layers, need), max(0.0, (limit - s.fixed_s) / s.per_layer_s))
                       if s.per_layer_s > 0 else min(s.max_layers, need) * (limit >= s.fixed_s)
                       for s in stages)
        low = max(s.fixed_s + s.per_layer_s for s in stages)
        high = max(s.fixed_s + min(s.max_layers, need) * s.per_layer_s for s in stages)
        for _ in range(60):
            mid = (low + high) / 2
            if holds(mid) >= need:
                high = mid
            else:
                low = mid
        return max(total, groups * low)
