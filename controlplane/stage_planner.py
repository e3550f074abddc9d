"""Placing an export's stages by the planner, and judging a re-plan (pure, no sockets).

The coordinator's members carry the profiles they measured for the served model and the
coordinator keeps the links' figures; from them ``StagePlanner`` builds the planner's
request (controlplane/planner/search.py) over whole exported stages: the split may cut
only at the export's stage boundaries, and the coordinator runs stage 0. The planner
chooses which nodes take part, in what order and how many stages each runs; the nodes it
leaves out stay spares, each with the planner's reason.

Links: a pair the coordinator probed has its figures; a pair not probed, whose two nodes
each have some probed link, is estimated from those (``cluster_fleet.estimated_links``);
any other pair is assumed to be a reference link (``references.REFERENCE_LINKS``):
loopback between processes on one host (or on loopback addresses: a local cluster),
gigabit Ethernet between hosts, until probed.

``PlanUnusable`` says why the planner cannot place (a node without a usable profile, a
placement that does not fit the export's stage sizes, ...): the coordinator then places
as it did before the planner, and says why.

The coordinator's loop also answers heartbeats, and an exact search of 8 nodes at cut
points takes 1.3-2.5 s on a busy 2-vCPU VM (nodes are marked dead after 2.5 s of
silence). ``place_soon`` and ``replan_soon`` therefore search a fleet of more than
``INLINE_NODES`` nodes on a worker thread (``BackgroundSearch``): the request is built on
the loop from the members as they are, the search runs meanwhile, and the loop takes its
result on a later tick; a fleet that changed in the meantime asks again, and the stale
result is dropped. Smaller fleets take milliseconds and are searched at once.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from controlplane import membership as ms
from controlplane.heal import hosts
from controlplane.placement import StageNeed, fmt_bytes, layer_range, node_memory
from controlplane.planner.cluster_fleet import estimated_links, measured_links
from controlplane.planner.measured import profile_of
from controlplane.planner.profile import Links, NodeProfile, ProfileError, ProfileKey
from controlplane.planner.references import REFERENCE_LINKS
from controlplane.planner.search import PLAN_STREAMS, PlanRequest, plan, predict
from controlplane.planner.shape import ModelShape
from controlplane.planner.speed import at_speed
from controlplane.records import DEFAULT_REPLAN_GAIN, LinkStatus
from zctl.manifest import ExportManifest
from zctl.weights import export_int8_form

SAME_HOST_LINK = "loopback"
OTHER_HOST_LINK = "ethernet"
# Fleets up to this size are searched exactly (larger ones by the heuristic); searches of
# more than INLINE_NODES nodes run off the coordinator's loop (module docstring): an exact
# search of 8 nodes at cut points took 1.3-2.5 s on a busy 2-vCPU VM, of 4 milliseconds.
COORDINATOR_EXACT_NODES = 8
INLINE_NODES = 4
T = TypeVar("T")


def same_machine(a: str, b: str) -> bool:
    """Whether two hosts are one machine: the same address, or two loopback addresses (a
    local cluster's processes on 127.0.0.1, 127.0.0.2, ...)."""
    if a == b:
        return True
    try:
        return ipaddress.ip_address(a).is_loopback and ipaddress.ip_address(b).is_loopback
    except ValueError:
        return False


class PlanUnusable(ValueError):
    """Why the planner cannot place the stages now (the coordinator falls back)."""


@dataclass(frozen=True)
class PlannedStages:
    """The planner's placement of the export's stages: {stage: node}, its predicted
    objective tok/s, and the nodes it leaves out with the planner's reasons."""

    stages: dict[int, str]
    score: float
    left_out: dict[str, str]
    assumed_links: int  # pairs whose link was assumed (not probed, not estimated)

    def describe(self, manifest: ExportManifest) -> str:
        parts = []
        for node, stages in hosts(self.stages):
            first, last = manifest.stages[stages[0]], manifest.stages[stages[-1]]
            parts.append(f"{node} stage(s) {stages[0]}-{stages[-1]} (layers "
                         f"{layer_range(first.layer_start, last.layer_end)})")
        return ", ".join(parts)


@dataclass(frozen=True)
class Replan:
    """A re-plan considered: the current placement's prediction and the new one's."""

    planned: PlannedStages
    current_score: float
    gain: float  # required: apply when planned.score > current_score * (1 + gain)

    @property
    def worth_it(self) -> bool:
        return self.planned.score > self.current_score * (1 + self.gain)

    def describe(self, objective: str) -> str:
        return (f"predicted {self.current_score:.2f} tok/s ({objective}) now, "
                f"{self.planned.score:.2f} re-planned (a re-plan needs "
                f"+{100 * self.gain:.0f}%)")


IDLE, SEARCHING = "idle", "searching"  # BackgroundSearch's states


class BackgroundSearch(Generic[T]):
    """Searches run one at a time on a worker thread, each for a key (what it was asked
    on): ``take`` starts one, and gives its result (or raises what it raised) on a later
    call for the same key once it has arrived. ``state`` is SEARCHING while one is in
    flight, else IDLE. A call for another key while one is in flight makes that one
    stale: its result is dropped (never given), and the new key's search is started."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None  # made on the first search
        self.key: Hashable = None
        self._future: Future[T] | None = None
        self.dropped = 0  # stale searches whose results were dropped

    @property
    def state(self) -> str:
        return SEARCHING if self._future is not None else IDLE

    def take(self, key: Hashable, search: Callable[[], T]) -> T | None:
        """``search``'s result for ``key`` once it has arrived, None while it runs."""
        if self._future is not None and self.key != key:
            self._future.cancel()  # not started yet; else it ends unheard
            self._future = None
            self.dropped += 1
        if self._future is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="zctl-plan")
            self.key, self._future = key, self._pool.submit(search)
            return None
        if not self._future.done():
            return None
        future, self._future = self._future, None
        return future.result()

    def close(self) -> None:
        """Drop any search in flight; the worker ends after the one it runs."""
        self._future = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class StagePlanner:
    """The planner's placement of one export's stages on the coordinator's members."""

    def __init__(self, manifest: ExportManifest, shape: ModelShape, needs: Sequence[StageNeed],
                 head: str, device: str, openvino: str, gain: float = DEFAULT_REPLAN_GAIN,
                 objective: str = "latency", streams: int = PLAN_STREAMS) -> None:
        if not gain >= 0:
            raise ValueError(f"the re-plan gain must be >= 0 (0.10: 10%), got {gain!r}")
        if shape.num_layers != manifest.model.num_layers:
            raise ValueError(f"the shape has {shape.num_layers} layers, the export "
                             f"{manifest.model.num_layers}")
        self.manifest = manifest
        self.shape = shape
        self.needs = list(needs)
        self.head = head
        self.device = device
        self.openvino = openvino
        self.gain = gain
        self.objective = objective
        self.streams = streams  # the throughput objective's streams; KV reserved for them
        self.cuts = frozenset(s.layer_end for s in manifest.stages[:-1])
        self.search: BackgroundSearch[PlannedStages | Replan] = BackgroundSearch()

    # -- the fleet -----------------------------------------------------------------------
    def profile(self, member: ms.Member) -> NodeProfile:
        """``member``'s profile for the served model, with the memory it reported free;
        PlanUnusable naming the node and why it has none."""
        if member.profile is None:
            raise PlanUnusable(f"node {member.node_id} has no profile of "
                               f"{self.shape.name}: {member.profile_state}")
        key = ProfileKey(self.shape.fingerprint(), self.manifest.weight_format, self.device,
                         self.openvino, int8_form=export_int8_form(self.manifest.weight_format,
                                                                  self.manifest.int8_form),
                         exact_experts=self.manifest.exact_experts)
        try:
            profile = at_speed(profile_of(member.profile), member.speed_factor)
            profile.check_for(key, member.node_id)
        except ProfileError as exc:
            raise PlanUnusable(f"node {member.node_id}'s profile cannot be used: {exc}") from None
        info = member.info
        return replace(profile, free_memory=node_memory(info.devices, info.ram_free,
                                                        self.device, headroom=1.0))

    def links(self, members: Sequence[ms.Member], probed: Sequence[LinkStatus]
              ) -> tuple[Links, int]:
        """Every pair of ``members``' links (module docstring), and how many were assumed."""
        nodes = sorted(m.node_id for m in members)
        known = {pair: link for pair, link in measured_links(list(probed)).items()
                 if pair[0] in nodes and pair[1] in nodes}
        pairs = estimated_links(nodes, known)
        host = {m.node_id: m.info.host for m in members}
        assumed = 0
        for i, a in enumerate(nodes):
            for b in nodes[i + 1:]:
                if (a, b) not in pairs:
                    name = SAME_HOST_LINK if same_machine(host[a], host[b]) else OTHER_HOST_LINK
                    access = REFERENCE_LINKS[name]
                    pairs[(a, b)] = access.to(access)
                    assumed += 1
        return Links(pairs), assumed

    def request(self, members: Sequence[ms.Member], probed: Sequence[LinkStatus]
                ) -> tuple[PlanRequest, int]:
        profiles = {m.node_id: self.profile(m) for m in members}
        if self.head not in profiles:
            raise PlanUnusable(f"the coordinator {self.head} is not among the nodes")
        links, assumed = self.links(members, probed)
        return PlanRequest(self.shape, self.manifest.weight_format, profiles, links,
                           objective=self.objective, streams=self.streams, head=self.head,
                           top=1,
                           openvino=self.openvino, cuts=self.cuts,
                           exact_nodes=COORDINATOR_EXACT_NODES,
                           exact_experts=self.manifest.exact_experts), assumed

    # -- placing -------------------------------------------------------------------------
    def place(self, members: Sequence[ms.Member], probed: Sequence[LinkStatus],
              memory: Mapping[str, int]) -> PlannedStages:
        """The planner's best placement of the stages on ``members`` (the coordinator
        among them); ``memory``: each node's usable bytes, against which the export's real
        stage sizes are checked. PlanUnusable says why there is none."""
        req, assumed = self.request(members, probed)
        return self._placed(req, assumed, dict(memory))

    def place_soon(self, key: Hashable, members: Sequence[ms.Member],
                   probed: Sequence[LinkStatus], memory: Mapping[str, int]
                   ) -> PlannedStages | None:
        """``place``, off the loop for a large fleet (module docstring): None while the
        search for ``key`` (what the fleet is now) runs."""
        req, assumed = self.request(members, probed)
        frozen = dict(memory)
        return self._soon(("place", key), len(members),
                          lambda: self._placed(req, assumed, frozen))  # type: ignore[return-value]

    def _soon(self, key: Hashable, nodes: int, search: Callable[[], T]) -> T | None:
        if nodes <= INLINE_NODES:
            return search()
        return self.search.take(key, search)  # type: ignore[arg-type,return-value]

    def _placed(self, req: PlanRequest, assumed: int, memory: Mapping[str, int]
                ) -> PlannedStages:
        try:
            found = plan(req)
        except (ProfileError, ValueError) as exc:
            raise PlanUnusable(f"the planner found no placement: {exc}") from None
        best = found.placements[0]
        stages: dict[int, str] = {}
        for spec in self.manifest.stages:
            owner = next(s.node for s in best.stages
                         if s.start <= spec.layer_start and spec.layer_end <= s.end)
            stages[spec.index] = owner
        for node, run in hosts(stages):
            need = sum(self.needs[s].bytes for s in run)
            if need > memory[node]:
                raise PlanUnusable(
                    f"the planner gives node {node} stage(s) {run[0]}-{run[-1]}, but they need "
                    f"about {fmt_bytes(need)} and it has {fmt_bytes(memory[node])} usable")
        left_out = {out.node: out.reason for out in found.left_out}
        return PlannedStages(stages, best.score, left_out, assumed)

    def predict(self, stages: Mapping[int, str], members: Sequence[ms.Member],
                probed: Sequence[LinkStatus]) -> float:
        """The objective's tok/s the planner predicts for ``stages`` (stage -> node)."""
        return self._prediction(stages, members, probed)()

    def _prediction(self, stages: Mapping[int, str], members: Sequence[ms.Member],
                    probed: Sequence[LinkStatus]) -> Callable[[], float]:
        """``predict`` as its request (built now) and the search to run."""
        chain = hosts(stages)
        req, _ = self.request([m for m in members if m.node_id in dict(chain)], probed)
        specs = self.manifest.stages
        counts = [specs[run[-1]].layer_end - specs[run[0]].layer_start for _, run in chain]
        order = [node for node, _ in chain]

        def search() -> float:
            try:
                return predict(req, order, counts)
            except (ProfileError, ValueError) as exc:
                raise PlanUnusable(f"the current placement cannot be predicted: {exc}") from None
        return search

    def replan(self, current: Mapping[int, str], members: Sequence[ms.Member],
               probed: Sequence[LinkStatus], memory: Mapping[str, int]) -> Replan:
        """The best placement on ``members`` against the current one's prediction;
        PlanUnusable when either cannot be predicted."""
        return self._replanning(current, members, probed, memory)()

    def replan_soon(self, key: Hashable, current: Mapping[int, str],
                    members: Sequence[ms.Member], probed: Sequence[LinkStatus],
                    memory: Mapping[str, int]) -> Replan | None:
        """``replan``, off the loop for a large fleet (module docstring): None while the
        search for ``key`` (what the fleet is now) runs."""
        return self._soon(("replan", key), len(members),  # type: ignore[return-value]
                          self._replanning(current, members, probed, memory))

    def _replanning(self, current: Mapping[int, str], members: Sequence[ms.Member],
                    probed: Sequence[LinkStatus], memory: Mapping[str, int]
                    ) -> Callable[[], Replan]:
        req, assumed = self.request(members, probed)
        frozen = dict(memory)
        current_score = self._prediction(current, members, probed)
        return lambda: Replan(self._placed(req, assumed, frozen), current_score(), self.gain)
