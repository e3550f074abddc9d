"""The planner against a brute force over every subset, order and contiguous split, and on
fleets of unequal memory, compute and links."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.placement import PlacementError
from controlplane.planner import search
from controlplane.planner.memory import stage_cost, stage_need, usable_bytes
from controlplane.planner.presets import PRESETS
from controlplane.planner.profile import ROWS, LinkProfile, Links, NodeProfile, ProfileError, ProfileKey
from controlplane.planner.references import REFERENCE_LINKS, derive_profile, reference_speed
from controlplane.planner.search import PlanRequest, plan
from controlplane.planner.shape import ModelShape
from controlplane.planner.timing import Pipeline, Stage, stream_tok_s, throughput

GiB = 1 << 30
SAME = 1e-9
ENGINE = (1e-4, 1.2e-4, 1.5e-4, 2e-4)  # the coordinator's step at ROWS rows


def brute_force(req: PlanRequest) -> dict[frozenset[str], float]:
    """The best objective tok/s of every node set, from every order and every split."""
    best: dict[frozenset[str], float] = {}
    nodes, layers = list(req.profiles), req.shape.num_layers
    for size in range(1, len(nodes) + 1):
        for order in itertools.permutations(nodes, size):
            if req.head is not None and order[0] != req.head:
                continue
            for cuts in itertools.combinations(range(1, layers), size - 1):
                if req.cuts is not None and not set(cuts) <= req.cuts:
                    continue  # a split only at the allowed cut points
                bounds = (0, *cuts, layers)
                stages = []
                for i, node in enumerate(order):
                    profile = req.profiles[node]
                    cost = stage_cost(req.shape, req.weights, profile.layer_bytes, req.context,
                                      req.streams)
                    count = bounds[i + 1] - bounds[i]
                    if stage_need(cost, count, i == 0, i == size - 1) > usable_bytes(
                            profile.free_memory):
                        break
                    stages.append(Stage(node, profile, bounds[i], bounds[i + 1]))
                else:
                    hops = tuple(req.links.link(a, b) for a, b in itertools.pairwise(order))
                    reply = req.links.link(order[-1], order[0]) if size > 1 else None
                    pipe = Pipeline(req.shape, tuple(stages), hops, reply)
                    score = (stream_tok_s(pipe) if req.objective == "latency"
                             else throughput(pipe, req.streams).tok_s)
                    key = frozenset(order)
                    best[key] = max(best.get(key, 0.0), score)
    return best


def tiny_profile(shape: ModelShape, layer_s: float, growth: float, head_s: float, call_s: float,
                 layer_bytes: int, free: int) -> NodeProfile:
    decode = tuple(layer_s * growth ** i for i in range(len(ROWS)))
    head = tuple(head_s * (1 + 0.1 * i) + 1e-6 for i in range(len(ROWS)))
    return NodeProfile(ProfileKey(shape.fingerprint(), "int8", "CPU", "reference"), decode, head,
                       5000.0, call_s, ENGINE, layer_bytes, free)


@st.composite
def requests(draw, max_nodes: int = 4, max_layers: int = 7) -> PlanRequest:
    """Small fleets whose nodes each hold anything from nothing to the whole model."""
    shape = ModelShape("tiny", draw(st.integers(1, max_layers)),
                       hidden=draw(st.sampled_from([64, 512])), intermediate=128, heads=4,
                       kv_heads=4, head_dim=16, vocab=draw(st.sampled_from([64, 512, 4096])))
    count = draw(st.integers(1, max_nodes))
    names = [f"pc{i}" for i in range(count)]
    fine = st.floats(1e-4, 5e-2)
    streams, context = draw(st.integers(1, 6)), 16
    profiles = {}
    for name in names:
        layer_bytes = draw(st.integers(10_000, 400_000))
        whole = stage_need(stage_cost(shape, "int8", layer_bytes, context, streams),
                           shape.num_layers, True, True)
        free = int(whole * draw(st.floats(0.2, 1.3)) / 0.9)
        profiles[name] = tiny_profile(shape, draw(fine), draw(st.floats(1.0, 1.6)),
                                      draw(st.floats(0, 2e-2)), draw(st.floats(0, 3e-3)),
                                      layer_bytes, free)
        if draw(st.booleans()):  # held to a CPU quota whose period's share holds any step
            profiles[name] = dataclasses.replace(
                profiles[name], cpu_share=draw(st.floats(0.1, 2.0)), quota_period_s=100.0,
                cpu_per_wall=draw(st.sampled_from([0.0, 0.6, 1.0, 1.8])))
    links = Links({(a, b): LinkProfile(draw(st.floats(0, 0.05)), draw(st.floats(1e5, 1e9)),
                                       draw(st.floats(1e5, 1e9)))
                   for a, b in itertools.combinations(names, 2)})
    objective = draw(st.sampled_from(search.OBJECTIVES))
    return PlanRequest(shape, "int8", profiles, links, objective=objective, streams=streams,
                       context=context, head=draw(st.sampled_from([None, names[0]])), top=3)


def planned_and_truth(req: PlanRequest) -> tuple[dict[frozenset[str], float], search.Plan | None]:
    """The brute force's best of every node set, and the plan (None, once the planner was
    seen to refuse it, when nothing fits)."""
    truth = brute_force(req)
    if not truth:
        with pytest.raises(PlacementError):
            plan(req)
        return truth, None
    return truth, plan(req)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_the_plan_is_the_brute_forces_best(req: PlanRequest) -> None:
    truth, result = planned_and_truth(req)
    if result is None:
        return
    assert result.exact
    best = result.placements[0]
    assert best.score == pytest.approx(max(truth.values()), rel=SAME)
    # the ranked list is the top of the node sets, each at its best order and split
    top = sorted(truth.values(), reverse=True)[:req.top]
    assert [p.score for p in result.placements] == pytest.approx(top, rel=SAME)
    for placement in result.placements:
        assert placement.score == pytest.approx(truth[frozenset(placement.nodes)], rel=SAME)
        shown = (placement.tok_s if req.objective == "latency" else placement.streams.tok_s)
        assert shown == pytest.approx(placement.score, rel=SAME)
        ranges = placement.ranges()
        assert ranges[0][0] == 0 and ranges[-1][1] == req.shape.num_layers
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(ranges))
        assert all(s.memory_free >= 0 for s in placement.stages)
        if req.head is not None:
            assert placement.nodes[0] == req.head
    for out in result.left_out:
        assert out.node not in best.nodes
        with_it = truth.get(frozenset((*best.nodes, out.node)))
        if with_it is None:
            assert out.with_tok_s is None
        else:
            assert out.with_tok_s == pytest.approx(with_it, rel=SAME)
            assert with_it <= best.score * (1 + SAME)
    assert {o.node for o in result.left_out} == set(req.profiles) - set(best.nodes)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests(max_nodes=5, max_layers=6), st.data())
def test_the_heuristic_never_beats_the_exact_search_and_always_fits(req: PlanRequest,
                                                                    data) -> None:
    try:
        exact = plan(req)
    except PlacementError:
        return
    rough = plan(dataclasses.replace(req, exact_nodes=data.draw(st.integers(1, 2))))
    assert rough.placements[0].score <= exact.placements[0].score * (1 + SAME)
    assert all(s.memory_free >= 0 for p in rough.placements for s in p.stages)
    if len(req.profiles) > 2:
        assert not rough.exact


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests(max_nodes=3, max_layers=6), st.floats(1e-4, 5e-2), st.integers(0, 3_000_000))
def test_another_node_never_makes_the_plan_slower(req: PlanRequest, layer_s: float,
                                                  free: int) -> None:
    try:
        before = plan(req).placements[0].score
    except PlacementError:
        return
    extra = tiny_profile(req.shape, layer_s, 1.2, 1e-3, 1e-3, 100_000, free)
    names = list(req.profiles)
    links = {(a, b): req.links.link(a, b) for a, b in itertools.combinations(names, 2)}
    links.update({(n, "new"): LinkProfile(0.05, 1e6, 1e6) for n in names})
    grown = dataclasses.replace(req, profiles={**req.profiles, "new": extra}, links=Links(links))
    assert plan(grown).placements[0].score >= before * (1 - SAME)


# -- unequal fleets ------------------------------------------------------------------------
def fleet(shape: ModelShape, weights: str, pcs: dict[str, tuple[str, float, str]],
          **options) -> PlanRequest:
    profiles = {name: derive_profile(reference_speed(speed), shape, weights, int(gb * GiB))
                for name, (speed, gb, _) in pcs.items()}
    links = Links({(a, b): REFERENCE_LINKS[pcs[a][2]].to(REFERENCE_LINKS[pcs[b][2]])
                   for a, b in itertools.combinations(pcs, 2)})
    return PlanRequest(shape, weights, profiles, links, **options)


def test_a_node_a_quarter_as_fast_gets_its_share_and_beats_an_equal_split() -> None:
    shape = PRESETS["llama-3.1-8b"]
    base = derive_profile(reference_speed("desktop-ddr4"), shape, "int4", 6 * GiB)
    slow = dataclasses.replace(base, decode_s=tuple(4 * t for t in base.decode_s),
                               head_decode_s=tuple(4 * t for t in base.head_decode_s))
    links = Links({("fast", "slow"): REFERENCE_LINKS["ethernet"].to(REFERENCE_LINKS["ethernet"])})
    req = PlanRequest(shape, "int4", {"fast": base, "slow": slow}, links, streams=8,
                      objective="throughput", context=1024)
    best = plan(req).placements[0]
    layers = {s.node: s.end - s.start for s in best.stages}
    assert set(layers) == {"fast", "slow"}  # neither holds the model alone
    assert layers["fast"] > 2 * layers["slow"]
    equal = Pipeline(shape, (Stage("fast", base, 0, 16), Stage("slow", slow, 16, 32)),
                     (links.link("fast", "slow"),), links.link("slow", "fast"))
    assert best.score >= 1.3 * throughput(equal, 8).tok_s


def test_a_slow_node_and_a_node_behind_a_slow_link_are_left_out() -> None:
    req = fleet(PRESETS["llama-3.2-1b"], "int4", {
        "a": ("desktop-ddr4", 16, "ethernet"), "b": ("desktop-ddr4", 16, "ethernet"),
        "old": ("mini-pc-old", 8, "ethernet"), "far": ("desktop-ddr5", 32, "wifi")},
        streams=8, objective="throughput")
    result = plan(req)
    reasons = {o.node: o.reason for o in result.left_out}
    assert "old" in reasons and "slows the pipeline" in reasons["old"]
    two = plan(dataclasses.replace(req, profiles={n: req.profiles[n] for n in ("a", "b")}))
    assert result.placements[0].score >= two.placements[0].score


def test_a_model_that_fits_on_one_node_leaves_the_others_out_with_a_reason() -> None:
    req = fleet(PRESETS["smollm2-135m"], "int8", {
        "big": ("desktop-ddr5", 32, "ethernet"), "small": ("laptop", 16, "wifi")})
    result = plan(req)
    assert result.placements[0].nodes == ("big",)
    (out,) = result.left_out
    assert out.node == "small" and out.with_tok_s is not None
    assert "slows the pipeline" in out.reason or "fits without it" in out.reason


def test_a_model_that_fits_nowhere_names_the_shortfall() -> None:
    req = fleet(PRESETS["llama-3.1-70b"], "fp32", {
        "a": ("desktop-ddr5", 64, "ethernet"), "b": ("laptop", 16, "wifi")})
    with pytest.raises(PlacementError, match=r"llama-3.1-70b in fp32 .*needs about .* short by"):
        plan(req)
    tiny = fleet(PRESETS["llama-3.1-8b"], "int4", {
        "a": ("laptop", 0.5, "ethernet"), "b": ("laptop", 0.5, "ethernet")})
    with pytest.raises(PlacementError, match="needs about"):
        plan(tiny)
    embed = fleet(PRESETS["llama-3.1-8b"], "fp32", {
        f"pc{i}": ("laptop", 3.5, "ethernet") for i in range(14)})
    with pytest.raises(PlacementError, match="embedding"):
        plan(embed)


def test_bad_requests_are_refused() -> None:
    req = fleet(PRESETS["smollm2-135m"], "int8", {"a": ("laptop", 8, "ethernet"),
                                                  "b": ("laptop", 8, "ethernet")})
    with pytest.raises(PlacementError, match="head node z"):
        plan(dataclasses.replace(req, head="z"))
    with pytest.raises(ValueError, match="objective"):
        plan(dataclasses.replace(req, objective="speed"))
    with pytest.raises(ValueError, match="weight format"):
        plan(dataclasses.replace(req, weights="int2"))
    with pytest.raises(PlacementError, match="no nodes"):
        plan(dataclasses.replace(req, profiles={}))
    with pytest.raises(ValueError, match="exact_nodes must be >= 1"):
        plan(dataclasses.replace(req, exact_nodes=0))
    with pytest.raises(ProfileError, match="no link figures between a and c"):
        plan(dataclasses.replace(req, profiles={**req.profiles, "c": req.profiles["a"]}))
    stale = dataclasses.replace(req.profiles["b"], key=ProfileKey("other", "int8", "CPU", "x"))
    with pytest.raises(ProfileError, match="node b: its profile was measured for shape"):
        plan(dataclasses.replace(req, profiles={**req.profiles, "b": stale}))
    other = derive_profile(reference_speed("laptop"), PRESETS["smollm2-135m"], "int4", GiB)
    with pytest.raises(ProfileError, match="weights 'int4', not 'int8'"):
        plan(dataclasses.replace(req, profiles={**req.profiles, "b": other}))


def test_the_head_runs_stage_zero() -> None:
    req = fleet(PRESETS["llama-3.1-8b"], "int4", {
        "slow": ("laptop", 16, "wifi"), "fast": ("desktop-ddr5", 8, "ethernet"),
        "mid": ("desktop-ddr4", 8, "ethernet")}, head="slow")
    result = plan(req)
    assert all(p.nodes[0] == "slow" for p in result.placements)
    assert "slow" not in {o.node for o in result.left_out}


def test_a_large_fleet_is_planned_heuristically_and_fast() -> None:
    pcs = {f"old{i}": ("mini-pc-old", 8, "ethernet") for i in range(10)}
    pcs.update({"big": ("desktop-ddr5", 64, "ethernet"), "mid": ("desktop-ddr4", 32, "wifi")})
    req = fleet(PRESETS["llama-3.1-70b"], "int4", pcs)
    result = plan(req)
    assert not result.exact
    best = result.placements[0]
    assert "big" in best.nodes and all(s.memory_free >= 0 for s in best.stages)
    assert len(result.left_out) == len(pcs) - len(best.nodes)
    assert best.score > 0 and math.isfinite(best.first_token.seconds)
