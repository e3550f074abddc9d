"""Splits restricted to cut points (an export's stage boundaries), against brute force: the
least-total split, the best round of a split table, and whole plans."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.placement import PlacementError
from controlplane.planner.profile import Links
from controlplane.planner.search import PlanRequest, plan, predict
from controlplane.planner.shape import ModelShape
from controlplane.planner.split import SplitTable, StageBounds, min_sum_split
from tests.controlplane.planner.test_search import planned_and_truth, requests, tiny_profile

SAME = 1e-9


def splits(stages: list[StageBounds], num_layers: int, cuts: frozenset[int]):
    """Every split of ``num_layers`` over ``stages`` at ``cuts`` that fits their caps."""
    for bounds in itertools.combinations(sorted(cuts), len(stages) - 1):
        edges = (0, *bounds, num_layers)
        counts = [b - a for a, b in itertools.pairwise(edges)]
        if all(1 <= c <= s.max_layers for c, s in zip(counts, stages, strict=True)):
            yield counts


@st.composite
def split_cases(draw) -> tuple[list[StageBounds], int, frozenset[int]]:
    num_layers = draw(st.integers(1, 9))
    count = draw(st.integers(1, 4))
    stages = [StageBounds(draw(st.floats(0, 1e-2)), draw(st.floats(1e-4, 1e-2)),
                          draw(st.integers(0, num_layers)),
                          draw(st.sampled_from([1.0, 1.0, 1.5, 4.0]))) for _ in range(count)]
    cuts = frozenset(draw(st.sets(st.integers(1, max(1, num_layers - 1)), max_size=8))
                     & set(range(1, num_layers)))
    return stages, num_layers, cuts


def total(stages: list[StageBounds], counts: list[int]) -> float:
    return sum(s.fixed_s + c * s.per_layer_s for s, c in zip(stages, counts, strict=True))


@settings(max_examples=300, deadline=None)
@given(split_cases())
def test_the_least_total_split_at_cuts_is_the_brute_forces(case) -> None:
    stages, num_layers, cuts = case
    truth = min((total(stages, c) for c in splits(stages, num_layers, cuts)), default=None)
    found = min_sum_split(stages, num_layers, cuts=cuts)
    if truth is None:
        assert found is None
        return
    assert found is not None
    assert found[0] == pytest.approx(truth, rel=SAME)
    counts = list(found[1])
    assert counts in list(splits(stages, num_layers, cuts))
    assert total(stages, counts) == pytest.approx(found[0], rel=SAME)


@settings(max_examples=300, deadline=None)
@given(split_cases(), st.floats(0, 1e-2), st.floats(0, 1e-2), st.integers(1, 4))
def test_the_best_round_at_cuts_is_the_brute_forces(case, hop_s: float, busy_s: float,
                                                     groups: int) -> None:
    stages, num_layers, cuts = case

    def round_of(counts: list[int]) -> float:
        slowest = max((s.fixed_s + c * s.per_layer_s) * s.busy_scale  # a quota's, back to back
                      for s, c in zip(stages, counts, strict=True))
        return max(total(stages, counts) + hop_s, groups * max(slowest, busy_s))

    truth = min((round_of(c) for c in splits(stages, num_layers, cuts)), default=None)
    table = SplitTable(stages, num_layers, cuts)
    found = table.best_round(hop_s, busy_s, groups)
    if truth is None:
        assert found is None and math.isinf(table.lower_bound(hop_s, busy_s, groups))
        return
    assert found is not None
    assert found[0] == pytest.approx(truth, rel=SAME)
    assert list(found[1]) in list(splits(stages, num_layers, cuts))
    assert table.lower_bound(hop_s, busy_s, groups) <= found[0] * (1 + SAME)


def test_without_cuts_every_boundary_may_be_cut() -> None:
    stages = [StageBounds(0.0, 1.0, 5), StageBounds(0.0, 1.0, 5)]
    assert min_sum_split(stages, 6)[1] in ((1, 5), (2, 4), (3, 3), (4, 2), (5, 1))
    assert min_sum_split(stages, 6, cuts={4}) == (6.0, (4, 2))
    assert min_sum_split(stages, 6, cuts={5}) == (6.0, (5, 1))
    assert min_sum_split(stages, 6, cuts={1}) == (6.0, (1, 5))
    capped = [StageBounds(0.0, 1.0, 4), StageBounds(0.0, 1.0, 4)]
    assert min_sum_split(capped, 6, cuts={1, 5}) is None  # 5 layers on either: over its cap
    with pytest.raises(ValueError, match=r"cut points \[6\]"):
        min_sum_split(stages, 6, cuts={2, 6})


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.data())
def test_a_plan_at_cut_points_is_the_brute_forces_best(req: PlanRequest, data) -> None:
    layers = req.shape.num_layers
    cuts = frozenset(data.draw(st.sets(st.integers(1, max(1, layers - 1)), max_size=6))
                     & set(range(1, layers)))
    req = dataclasses.replace(req, cuts=cuts)
    truth, result = planned_and_truth(req)
    if result is None:
        return
    best = result.placements[0]
    assert best.score == pytest.approx(max(truth.values()), rel=SAME)
    for placement in result.placements:
        assert all(s.end in cuts for s in placement.stages[:-1])
        counts = [s.end - s.start for s in placement.stages]
        assert predict(req, placement.nodes, counts) == pytest.approx(placement.score, rel=SAME)


def test_cut_points_outside_the_model_are_refused() -> None:
    shape = ModelShape("tiny", 4, hidden=64, intermediate=128, heads=4, kv_heads=4,
                       head_dim=16, vocab=64)
    profile = tiny_profile(shape, 1e-3, 1.1, 1e-3, 1e-4, 10_000, 1 << 30)
    req = PlanRequest(shape, "int8", {"a": profile}, Links({}), cuts=frozenset({2, 4}))
    with pytest.raises(PlacementError, match=r"cut points \[4\] are not between layers 1 and 3"):
        plan(req)
    assert plan(dataclasses.replace(req, cuts=frozenset({2}))).placements[0].nodes == ("a",)
