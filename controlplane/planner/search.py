"""The planner: which nodes take part, in what order, with which layers; who is left out.

``plan`` ranks placements of a model on a fleet by the objective: ``latency`` (one
stream's tok/s) or ``throughput`` (N streams' aggregate tok/s, row groups pipelined).
For an order of nodes the layers are split exactly (``split``); the orders are searched
exactly up to ``EXACT_NODES`` nodes (every subset, every first and last node, every order
of the nodes between) and heuristically beyond (the fastest nodes first, then local
search: add, drop, swap, replace). A node is left out when the plan is predicted faster
without it; each node left out gets its reason.

Every decoder layer of a shape costs the same, so the best split of an order depends only
on its first node, its last node and the set between (their order changes the hops alone):
splits are computed once per (first, set between, last) and row count, and orders are
pruned by a bound no order of that set can beat, best bounds first. At cut points
(``PlanRequest.cuts``) the order between moves the boundaries, so each order has its
splits; the bounds stay those of the set without cut points.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from controlplane.placement import PlacementError, fmt_bytes
from controlplane.planner.memory import (
    DEFAULT_CONTEXT,
    max_layers,
    model_bytes,
    stage_cost,
    stage_need,
    usable_bytes,
)
from controlplane.planner.profile import Links, NodeProfile, ProfileKey
from controlplane.planner.shape import ModelShape
from controlplane.planner.split import SplitTable, StageBounds
from controlplane.planner.timing import (
    PROMPT_TOKENS,
    FirstToken,
    Pipeline,
    Stage,
    Throughput,
    group_options,
    reply_frame_bytes,
    stage_terms,
    step_frame_bytes,
    step_times,
    stream_tok_s,
    throughput,
    ttft,
)
from zctl.weights import check_weight_format

OBJECTIVES = ("latency", "throughput")
EXACT_NODES = 8  # fleets up to this size are searched exactly
LOCAL_SEARCH_ROUNDS = 64
SAME = 1e-9  # relative: predictions this close are equal (ties go to fewer nodes)


def objective_problem(objective: str) -> str:
    """Why ``objective`` is not one to plan for ("" when it is), as a command says it."""
    if objective in OBJECTIVES:
        return ""
    return f"--objective is {' or '.join(OBJECTIVES)}, not {objective!r}"


PLAN_STREAMS = 4  # the streams a plan is judged at for throughput and reserves KV for


@dataclass(frozen=True)
class PlanRequest:
    """What to plan: a shape in a weight format, the nodes' profiles (by node id), the
    links between them, the objective and the streams it is judged at (``streams``: N for
    throughput, and the N every placement is also shown at). ``head``: the node that must
    run stage 0 (the coordinator), None to choose. KV is reserved for ``streams`` streams of
    ``context`` tokens on every stage. ``cuts``: the layer boundaries a stage may end at
    (an export's stage boundaries, when the placement runs its stages; None: any).
    ``exact_nodes``: fleets up to this size are searched exactly, larger ones by the
    heuristic (a caller that must answer quickly lowers it)."""

    shape: ModelShape
    weights: str
    profiles: Mapping[str, NodeProfile]
    links: Links
    objective: str = "latency"
    streams: int = PLAN_STREAMS
    head: str | None = None
    context: int = DEFAULT_CONTEXT
    prompt: int = PROMPT_TOKENS
    top: int = 5
    openvino: str | None = None  # the cluster's version, to refuse profiles of another
    cuts: frozenset[int] | None = None
    exact_nodes: int = EXACT_NODES
    exact_experts: bool = False  # the experts' weights exact (every profile timed them so)


@dataclass(frozen=True)
class StagePlan:
    """One node's part: layers [start, end), its memory, its decode step at one row, and
    the hop after it (to the next stage, or the reply to stage 0 from the last)."""

    node: str
    start: int
    end: int
    memory_used: int
    memory_free: int
    step_s: float
    hop_s: float


@dataclass(frozen=True)
class Placement:
    """A placement and its predictions: one stream's tok/s, N streams' (with the row
    groups it assumes), TTFT for the request's prompt; ``score`` is the objective's tok/s."""

    stages: tuple[StagePlan, ...]
    tok_s: float
    streams: Throughput
    first_token: FirstToken
    score: float

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(s.node for s in self.stages)

    def ranges(self) -> list[tuple[int, int]]:
        """Layer ranges in stage order, as ``placement.plan_layers`` gives them."""
        return [(s.start, s.end) for s in self.stages]


@dataclass(frozen=True)
class LeftOut:
    """A node the best placement does without, and why; ``with_tok_s``: the objective's
    tok/s of the best placement that uses it too (None: none fits)."""

    node: str
    reason: str
    with_tok_s: float | None


@dataclass(frozen=True)
class Plan:
    shape: ModelShape
    weights: str
    objective: str
    streams: int
    placements: tuple[Placement, ...]
    left_out: tuple[LeftOut, ...]
    exact: bool  # every order was searched (else: the heuristic)


@dataclass(frozen=True)
class _Candidate:
    order: tuple[str, ...]
    counts: tuple[int, ...]
    score: float

    def key(self) -> tuple[float, int, tuple[str, ...]]:
        return (-self.score, len(self.order), self.order)


@dataclass
class _Evaluator:
    """The objective of any order, from splits computed once per (first, set, last)."""

    request: PlanRequest
    nodes: tuple[str, ...] = ()
    caps: dict[tuple[str, bool, bool], int] = field(default_factory=dict)
    tables: dict[tuple[tuple[str, ...], int, bool], tuple[tuple[str, ...], SplitTable]] = (
        field(default_factory=dict))
    hops: dict[tuple[str, str, int, int], tuple[float, float]] = field(default_factory=dict)
    evaluated: dict[tuple[str, ...], _Candidate | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        req = self.request
        self.nodes = tuple(req.profiles)
        self.options = [(1, 1)] if req.objective == "latency" else group_options(req.streams)
        self.tokens = 1 if req.objective == "latency" else req.streams
        for node, profile in req.profiles.items():
            cost = stage_cost(req.shape, req.weights, profile.layer_bytes, req.context,
                              req.streams)
            usable = usable_bytes(profile.free_memory)
            for first, last in itertools.product((False, True), repeat=2):
                self.caps[(node, first, last)] = max_layers(cost, usable, req.shape.num_layers,
                                                            first, last)

    def cap(self, node: str, index: int, count: int) -> int:
        return self.caps[(node, index == 0, index == count - 1)]

    def table(self, order: Sequence[str], rows: int,
              cut: bool = True) -> tuple[tuple[str, ...], SplitTable]:
        """The split table of ``order`` at ``rows`` rows, and the order it is kept for: one
        per first node, set between and last node when any boundary may be cut (the order
        of the nodes between changes the hops alone), one per order at the request's cut
        points (there that order moves the boundaries). ``cut`` False: the table without
        the cut points, whose bounds hold for every order of the set."""
        cuts = self.request.cuts if cut else None
        first, last = order[0], order[-1]
        canon = (tuple(order) if cuts is not None else
                 (first, *sorted(order[1:-1]), last) if first != last else (first,))
        key = (canon, rows, cuts is not None)
        if key not in self.tables:
            bounds = []
            for i, node in enumerate(canon):
                profile = self.request.profiles[node]
                fixed, per_layer = stage_terms(profile, rows, i == len(canon) - 1, i == 0)
                bounds.append(StageBounds(fixed, per_layer, self.cap(node, i, len(canon)),
                                          profile.busy_scale()))
            self.tables[key] = (canon, SplitTable(bounds, self.request.shape.num_layers, cuts))
        return self.tables[key]

    def hop(self, a: str, b: str, rows: int, index: int) -> tuple[float, float]:
        """(latency, link busy) of stage ``index``'s frame a to b; ``index`` -1: the reply."""
        key = (a, b, rows, index)
        if key not in self.hops:
            link = self.request.links.link(a, b)
            nbytes = (reply_frame_bytes(rows, -index - 1) if index < 0
                      else step_frame_bytes(self.request.shape, rows, 1, index))
            self.hops[key] = (link.latency_s(nbytes), link.busy_s(nbytes))
        return self.hops[key]

    def hop_terms(self, order: Sequence[str], rows: int) -> tuple[float, float]:
        if len(order) == 1:
            return 0.0, 0.0
        hops = [self.hop(a, b, rows, i) for i, (a, b) in enumerate(zip(order, order[1:],
                                                                        strict=False))]
        hops.append(self.hop(order[-1], order[0], rows, -len(order) - 1))
        return sum(h for h, _ in hops), max(busy for _, busy in hops)

    def evaluate(self, order: tuple[str, ...], floor: float = 0.0) -> _Candidate | None:
        """The best split of ``order`` and its objective tok/s; None when it cannot hold
        the model, or cannot score above ``floor`` (then it is not remembered)."""
        if order in self.evaluated:
            known = self.evaluated[order]
            return known if known is not None and known.score > floor else None
        best = None
        skipped = False
        for groups, rows in self.options:
            hop_sum, link_busy = self.hop_terms(order, rows)
            beat = max(floor, best.score if best is not None else 0.0)
            if beat > 0 and self.request.cuts is not None and self.tokens / self.table(
                    order, rows, cut=False)[1].lower_bound(hop_sum, link_busy, groups) <= beat:
                skipped = True  # (the set's table, shared: no order's own is made for it)
                continue
            canon, table = self.table(order, rows)
            if beat > 0 and self.tokens / table.lower_bound(hop_sum, link_busy, groups) <= beat:
                skipped = True
                continue
            found = table.best_round(hop_sum, link_busy, groups)
            if found is None:
                break  # memory does not depend on rows: no option fits
            score = self.tokens / found[0]
            if best is None or score > best.score:
                by_node = dict(zip(canon, found[1], strict=True))
                best = _Candidate(order, tuple(by_node[n] for n in order), score)
        if not skipped:
            self.evaluated[order] = best
        return best if best is not None and best.score > floor else None

    def bound(self, first: str, middle: frozenset[str], last: str) -> float:
        """A tok/s no order of this first node, set between and last node can beat: every
        hop at least the set's quickest, every link at least as busy as its idlest."""
        members = (first, *middle, last) if first != last else (first,)
        best = 0.0
        for groups, rows in self.options:
            hop_sum, link_busy = 0.0, 0.0
            if len(members) > 1:
                forward = [self.hop(a, b, rows, 0) for a in members for b in members if a != b]
                reply = [self.hop(a, first, rows, -len(members) - 1) for a in members
                         if a != first]
                hop_sum = (len(members) - 1) * min(h for h, _ in forward) + min(h for h, _ in reply)
                link_busy = min(busy for _, busy in forward + reply)
            low = self.table(members, rows, cut=False)[1].lower_bound(hop_sum, link_busy,
                                                                      groups)
            if math.isinf(low):
                return 0.0
            best = max(best, self.tokens / low)
        return best


def _combos(nodes: Sequence[str], head: str | None):
    """Every (first, set between, last) of every subset of ``nodes`` (the head first)."""
    for size in range(1, len(nodes) + 1):
        for subset in itertools.combinations(nodes, size):
            if head is not None and head not in subset:
                continue
            firsts = [head] if head is not None else subset
            for first in firsts:
                if size == 1:
                    yield first, frozenset(), first
                    continue
                for last in subset:
                    if last != first:
                        yield first, frozenset(subset) - {first, last}, last


class _Ranking:
    """The best candidate of each node set found so far, and the objective's top ``top``."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.by_set: dict[frozenset[str], _Candidate] = {}

    def add(self, candidate: _Candidate | None) -> None:
        if candidate is None:
            return
        key = frozenset(candidate.order)
        held = self.by_set.get(key)
        if held is None or candidate.key() < held.key():
            self.by_set[key] = candidate

    def floor(self, nodes: frozenset[str]) -> float:
        """The score a candidate of set ``nodes`` must beat to change the top: its set's
        best so far, and the top's last once the top is full."""
        held = self.by_set.get(nodes)
        scores = sorted((c.score for c in self.by_set.values()), reverse=True)
        last = scores[self.top - 1] if len(scores) >= self.top else 0.0
        return max(held.score if held is not None else 0.0, last) * (1 + SAME)

    def ranked(self) -> list[_Candidate]:
        return sorted(self.by_set.values(), key=_Candidate.key)


def _search_combos(ev: _Evaluator, combos, ranking: _Ranking) -> None:
    """Evaluate every order of the (first, set between, last) ``combos``, best bound first,
    skipping those whose bound cannot change the ranking."""
    queue = []
    for first, middle, last in combos:
        bound = ev.bound(first, middle, last)
        if bound > 0:
            queue.append((-bound, first, tuple(sorted(middle)), last))
    heapq.heapify(queue)
    while queue:
        neg_bound, first, middle, last = heapq.heappop(queue)
        members = frozenset((first, *middle, last))
        if -neg_bound <= ranking.floor(members):
            continue
        for between in itertools.permutations(middle):
            order = (first, *between, last) if first != last else (first,)
            ranking.add(ev.evaluate(order, ranking.floor(members)))


def _search_exact(ev: _Evaluator, nodes: Sequence[str], ranking: _Ranking) -> None:
    combos = _combos(nodes, ev.request.head)
    if ev.request.cuts is not None:  # no more nodes than the cut points make stages
        most = len(ev.request.cuts) + 1
        combos = (c for c in combos if len(c[1]) + (2 if c[0] != c[2] else 1) <= most)
    _search_combos(ev, combos, ranking)


def _search_local(ev: _Evaluator, nodes: Sequence[str], ranking: _Ranking) -> None:
    """Seeds: each node alone, and the nodes that hold a layer taken fastest first (by
    their one-row layer time) or roomiest first, as many as help (and so with the second
    of them last); then local moves while
    any improves the best order: drop a node, add one at any place, swap two, replace one."""
    head = ev.request.head
    profiles = ev.request.profiles
    able = [n for n in nodes if max(ev.caps[(n, f, la)] for f in (False, True)
                                    for la in (False, True)) > 0]
    fastest = sorted(able, key=lambda n: (profiles[n].layer_s(1), -profiles[n].free_memory, n))
    roomiest = sorted(able, key=lambda n: (-profiles[n].free_memory, profiles[n].layer_s(1), n))
    seeds: list[tuple[str, ...]] = [(n,) for n in nodes if head is None or n == head]
    for ranked in (fastest, roomiest):
        if head is not None:
            ranked = [head, *(n for n in ranked if n != head)]
        seeds.extend(tuple(ranked[:size]) for size in range(2, len(ranked) + 1))
        # the same nodes with the second at the far end: the first and last stages hold the
        # embedding and the head, so the two best of a list may be needed at both ends
        seeds.extend((ranked[0], *ranked[2:size], ranked[1])
                     for size in range(3, len(ranked) + 1))
    best: _Candidate | None = None
    for order in seeds:
        found = ev.evaluate(order)
        ranking.add(found)
        if found is not None and (best is None or found.key() < best.key()):
            best = found
    for order in () if best is not None else _short_orders(able, head):
        best = ev.evaluate(order)
        ranking.add(best)
        if best is not None:
            break  # a start for the local moves
    if best is None:
        return
    for _ in range(LOCAL_SEARCH_ROUNDS):
        improved = False
        for order in _moves(best.order, nodes, head):
            found = ev.evaluate(order)
            ranking.add(found)
            if found is not None and found.key() < best.key():
                best, improved = found, True
        if not improved:
            break


FALLBACK_ORDERS = 20_000  # orders of 2 and 3 nodes tried when no seed of the local search fits


def _short_orders(nodes: Sequence[str], head: str | None):
    """Every order of 2, then 3 of ``nodes`` (the head first, if one is fixed), up to
    FALLBACK_ORDERS of them: where memory is tight the seeds may all fail while some
    pairing of ends and middle fits."""
    orders = itertools.chain.from_iterable(
        itertools.permutations(nodes, size) for size in (2, 3))
    fitting = (o for o in orders if head is None or o[0] == head)
    return itertools.islice(fitting, FALLBACK_ORDERS)


def _moves(order: tuple[str, ...], nodes: Sequence[str], head: str | None):
    fixed = 1 if head is not None else 0
    unused = [n for n in nodes if n not in order]
    for i in range(fixed, len(order)):
        if len(order) > 1:
            yield order[:i] + order[i + 1:]
        for n in unused:
            yield order[:i] + (n,) + order[i + 1:]
    for n in unused:
        for i in range(fixed, len(order) + 1):
            yield order[:i] + (n,) + order[i:]
    for i, j in itertools.combinations(range(fixed, len(order)), 2):
        swapped = list(order)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        yield tuple(swapped)


def _search(ev: _Evaluator, nodes: Sequence[str], ranking: _Ranking) -> bool:
    if len(nodes) <= ev.request.exact_nodes:
        _search_exact(ev, nodes, ranking)
        return True
    _search_local(ev, nodes, ranking)
    return False


def _pipeline(req: PlanRequest, candidate: _Candidate) -> Pipeline:
    stages, start = [], 0
    for node, count in zip(candidate.order, candidate.counts, strict=True):
        stages.append(Stage(node, req.profiles[node], start, start + count))
        start += count
    order = candidate.order
    hops = tuple(req.links.link(a, b) for a, b in zip(order, order[1:], strict=False))
    reply = req.links.link(order[-1], order[0]) if len(order) > 1 else None
    return Pipeline(req.shape, tuple(stages), hops, reply)


def _placement(req: PlanRequest, candidate: _Candidate) -> Placement:
    pipe = _pipeline(req, candidate)
    times = step_times(pipe, 1)
    count = len(pipe.stages)
    stages = []
    for i, stage in enumerate(pipe.stages):
        profile = req.profiles[stage.node]
        cost = stage_cost(req.shape, req.weights, profile.layer_bytes, req.context, req.streams)
        used = stage_need(cost, stage.layers, i == 0, i == count - 1)
        hop = times.hop_s[i] if i < count - 1 else times.reply_s
        stages.append(StagePlan(stage.node, stage.start, stage.end, used,
                                usable_bytes(profile.free_memory) - used, times.stage_s[i], hop))
    return Placement(tuple(stages), stream_tok_s(pipe), throughput(pipe, req.streams),
                     ttft(pipe, req.prompt), candidate.score)


def _left_out(ev: _Evaluator, best: _Candidate, nodes: Sequence[str]) -> list[LeftOut]:
    req = ev.request
    out = []
    shown = "tok/s" if req.objective == "latency" else f"tok/s at {req.streams} streams"
    for node in nodes:
        if node in best.order:
            continue
        if all(ev.caps[(node, f, last)] < 1 for f in (False, True) for last in (False, True)):
            profile = req.profiles[node]
            cost = stage_cost(req.shape, req.weights, profile.layer_bytes, req.context,
                              req.streams)
            out.append(LeftOut(node, f"too little memory for one layer: it needs about "
                                     f"{fmt_bytes(stage_need(cost, 1, False, False))} and "
                                     f"{fmt_bytes(usable_bytes(profile.free_memory))} is usable",
                               None))
            continue
        with_it = _best_of_set(ev, (*best.order, node))
        if with_it is None:
            out.append(LeftOut(node, "the model fits without it (no placement uses it as well)",
                               None))
        elif with_it.score < best.score * (1 - SAME):
            out.append(LeftOut(node, f"slows the pipeline: {with_it.score:.2f} {shown} with it, "
                                     f"{best.score:.2f} without", with_it.score))
        else:
            out.append(LeftOut(node, f"the model fits without it, and it adds nothing "
                                     f"({with_it.score:.2f} {shown} with it)", with_it.score))
    return out


def _best_of_set(ev: _Evaluator, members: Sequence[str]) -> _Candidate | None:
    """The best order using every one of ``members``: exact up to the request's
    ``exact_nodes``, else the best place to insert the last member into the others' order."""
    head = ev.request.head
    if len(members) <= ev.request.exact_nodes:
        ranking = _Ranking(1)
        firsts = [head] if head is not None else members
        combos = ((f, frozenset(members) - {f, last}, last) for f in firsts for last in members
                  if last != f or len(members) == 1)
        _search_combos(ev, combos, ranking)
        return ranking.by_set.get(frozenset(members))
    rest, node = tuple(members[:-1]), members[-1]
    orders = (rest[:i] + (node,) + rest[i:] for i in range(1 if head else 0, len(rest) + 1))
    found = [c for c in map(ev.evaluate, orders) if c is not None]
    return min(found, key=_Candidate.key, default=None)


def _no_fit(req: PlanRequest, ev: _Evaluator) -> str:
    shape, nodes = req.shape, ev.nodes
    usable = {n: usable_bytes(req.profiles[n].free_memory) for n in nodes}
    cost = stage_cost(req.shape, req.weights, req.profiles[nodes[0]].layer_bytes, req.context,
                      req.streams)
    need = model_bytes(shape, cost)
    have = sum(usable.values())
    listing = ", ".join(f"{n} {fmt_bytes(usable[n])}" for n in nodes)
    what = (f"{shape.name} in {req.weights} (KV for {req.streams} stream(s) of {req.context} "
            f"tokens)")
    if need > have:
        return (f"{what} needs about {fmt_bytes(need)} but the {len(nodes)} node(s) have "
                f"{fmt_bytes(have)} usable ({listing}): short by {fmt_bytes(need - have)}; add "
                "memory or nodes, or use a smaller weight format")
    first_ok = [n for n in nodes if ev.caps[(n, True, False)] or ev.caps[(n, True, True)]]
    last_ok = [n for n in nodes if ev.caps[(n, False, True)] or ev.caps[(n, True, True)]]
    roomiest = max(nodes, key=lambda n: usable[n])
    if not first_ok or (req.head is not None and req.head not in first_ok):
        holder = req.head if req.head is not None else roomiest
        return (f"{what}: no node can hold the embedding and one layer (about "
                f"{fmt_bytes(stage_need(cost, 1, True, False))}); {holder} has "
                f"{fmt_bytes(usable[holder])} usable")
    if not last_ok:
        return (f"{what}: no node can hold the LM head and one layer (about "
                f"{fmt_bytes(stage_need(cost, 1, False, True))}); the roomiest, {roomiest}, "
                f"has {fmt_bytes(usable[roomiest])} usable")
    return (f"{what} needs about {fmt_bytes(need)} and the nodes have {fmt_bytes(have)} "
            f"usable ({listing}), but no split fits: the embedding and the head each take "
            f"about {fmt_bytes(cost.first_extra)} on one node; add a roomier node or use a "
            "smaller weight format")


def check_request(req: PlanRequest) -> None:
    """ValueError (PlacementError, ProfileError) for a request that cannot be planned."""
    check_weight_format(req.weights)
    if req.objective not in OBJECTIVES:
        raise ValueError(f"objective {req.objective!r} is not one of {', '.join(OBJECTIVES)}")
    if req.streams < 1 or req.top < 1 or req.prompt < 1 or req.exact_nodes < 1:
        raise ValueError("streams, top, prompt and exact_nodes must be >= 1")
    if not req.profiles:
        raise PlacementError("no nodes to plan for")
    if req.head is not None and req.head not in req.profiles:
        raise PlacementError(f"the head node {req.head} is not among the nodes")
    for node, profile in req.profiles.items():
        profile.check_for(ProfileKey(req.shape.fingerprint(), req.weights, profile.key.device,
                                     req.openvino or "reference",
                                     exact_experts=req.exact_experts), node)
    req.links.check_nodes(req.profiles)
    if req.cuts is not None:
        bad = sorted(c for c in req.cuts if not 0 < c < req.shape.num_layers)
        if bad:
            raise PlacementError(f"cut points {bad} are not between layers 1 and "
                                 f"{req.shape.num_layers - 1} of {req.shape.name}")


def split_order(req: PlanRequest, order: Sequence[str]) -> Placement | None:
    """The best split of the layers over ``order`` (every node of it taking part, in that
    order) and its predictions; None when no split fits the nodes' memory."""
    check_request(req)
    found = _Evaluator(req).evaluate(tuple(order))
    return None if found is None else _placement(req, found)


def predict(req: PlanRequest, order: Sequence[str], counts: Sequence[int]) -> float:
    """The objective's tok/s of ``order`` running ``counts`` layers each (in order): what
    ``Placement.score`` is for the placement the planner would choose."""
    if len(order) != len(counts) or sum(counts) != req.shape.num_layers or min(counts) < 1:
        raise PlacementError(f"{list(counts)} layers on {list(order)} do not cover the "
                             f"{req.shape.num_layers} layers of {req.shape.name}")
    pipe = _pipeline(req, _Candidate(tuple(order), tuple(counts), 0.0))
    if req.objective == "latency":
        return stream_tok_s(pipe)
    return throughput(pipe, req.streams).tok_s


def plan(req: PlanRequest) -> Plan:
    """Placements of ``req.shape`` on the nodes, best first by the objective, and the nodes
    the best one leaves out with their reasons; PlacementError naming the shortfall when
    the model fits on no subset of the nodes."""
    check_request(req)
    ev = _Evaluator(req)
    ranking = _Ranking(req.top)
    exact = _search(ev, ev.nodes, ranking)
    ranked = ranking.ranked()[:req.top]
    if not ranked:
        raise PlacementError(_no_fit(req, ev))
    placements = tuple(_placement(req, c) for c in ranked)
    return Plan(req.shape, req.weights, req.objective, req.streams, placements,
                tuple(_left_out(ev, ranked[0], ev.nodes)), exact)
