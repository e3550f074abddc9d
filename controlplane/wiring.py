"""The coordinator's pipeline state machine: which node runs which stage, and the wiring.

No sockets: given the membership table it decides the placement (once enough nodes
are alive), which nodes are due a shard offer, and which nodes need a new
``AssignStage``. Every change of wiring bumps the epoch. A node runs a contiguous run of
stages (one, or more once it took a lost neighbour's: ``heal``); each node in the chain
binds its data address and sends to the next node's; the last sends to the coordinator,
which runs stage 0 (and every stage when it is the only node, from the start or once the
others are gone).

Placement is the planner's (``controlplane.stage_planner``) when every candidate node has a
usable profile of the served model: it chooses the nodes, their order and how many of the
export's stages each runs, and the nodes it leaves out stay spares with its reason. Else
the stages are placed by memory (``placement.assign_runs``) and ``placement_note`` says
why; an explicit placement always wins. While the pipeline serves, a change of the fleet
(a node that joined and settled, a profile that arrived, a link measured, a node healed
away) makes the planner place again; a placement predicted faster by more than the gain
threshold becomes ``pending``: its nodes fetch the shards they lack while the pipeline
serves on (``pending_offers``), then the plan switches and the pipeline is re-wired
between steps. A node whose fetch fails, or that goes down, abandons the pending plan; a
switched plan whose node cannot start its stage goes back to the previous one. Only the
planner moves a placement it made: a node that joins is given stages by memory only
while the plan is not the planner's (placed by memory, or healed since).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

from controlplane import membership as ms
from controlplane.heal import heal_plan, hosts, rebalance_plan
from controlplane.messages import AssignStage
from controlplane.placement import (
    NodeCapacity,
    PlacementError,
    StageNeed,
    assign_runs,
    layer_range,
    node_memory,
)
from controlplane.records import (
    UNCOUNTED_REPLAN_KINDS,
    LinkStatus,
    ReplanStatus,
    StageInfo,
    StageStatus,
)
from controlplane.stage_planner import PlannedStages, PlanUnusable, StagePlanner
from dataplane.runtime.config import RuntimeSpec
from zctl.manifest import ExportManifest

log = logging.getLogger("zctl.controlplane")

# What a planned node's state means for the steps running through it.
DOWN_REASONS = {ms.DEAD: "stopped answering (missed its heartbeats)",
                ms.LEFT: "left the cluster", ms.FAILED: "failed"}
# how long the first placement waits for an enrolled node to answer the profile request
# (its profile, or why it has none) before placing without it
PROFILE_ANSWER_S = 5.0


class PipelinePlan:
    """Placement and wiring of one export's stages over the enrolled nodes."""

    def __init__(self, manifest: ExportManifest, needs: list[StageNeed], head: str,
                 runtime: RuntimeSpec, expect_nodes: int | None = None,
                 explicit: Mapping[int, str] | None = None,
                 planner: StagePlanner | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.manifest = manifest
        self.needs = needs
        self.head = head
        self.runtime = runtime
        self.num_stages = len(manifest.stages)
        self.expect_nodes = self.num_stages - 1 if expect_nodes is None else expect_nodes
        self.explicit = dict(explicit or {})
        self.hashes = [manifest.stage_hash(i) for i in range(self.num_stages)]
        self.plan: dict[int, str] | None = None
        self.plan_error = ""
        self.heal_error = ""  # why a lost node's stages found no survivor to take them
        self.epoch = 0
        self._wiring: dict[int, tuple[str, str, str]] | None = None
        self.planner = planner
        self.placement_note = ""  # how the stages were placed, and why not by the planner
        self.left_out: dict[str, str] = {}  # spares the planner left out, with its reasons
        self.last_replan = ReplanStatus()  # the last re-plan's outcome
        self._clock = clock  # Unix seconds: when a re-plan's outcome came
        # the running plan is the planner's (placed or re-planned by it, not healed since):
        # only the planner moves it, so a spare not yet profiled gets no stages by memory
        self.by_planner = False
        self.pending: dict[int, str] | None = None  # a re-plan whose shards are moving
        self.previous: dict[int, str] | None = None  # the plan before a switch, until it serves
        self._considered: tuple[object, bool] | None = None  # (fleet signature, planner usable)

    def capacity(self, member: ms.Member) -> NodeCapacity:
        info = member.info
        memory = node_memory(info.devices, info.ram_free, self.runtime.device)
        return NodeCapacity(member.node_id, memory, info.tok_s, frozenset(member.shards))

    def try_plan(self, members: Mapping[str, ms.Member], links: Sequence[LinkStatus] = (),
                 now: float | None = None) -> bool:
        """Place the stages once ``expect_nodes`` remote nodes are alive, on the nodes there
        are (fewer nodes than stages: contiguous runs, the coordinator's first): by the
        planner when every node has a usable profile (waiting for the nodes' answers to the
        profile request when ``now`` is given: ``_awaits_profiles``), else by memory;
        False while waiting, or while the stages do not fit them (``plan_error`` says why)."""
        if self.plan is not None:
            return True
        remote = [m for m in members.values() if not m.local and m.state in (ms.IDLE, ms.READY)]
        if len(remote) < self.expect_nodes:
            return False
        candidates = [members[self.head], *remote]
        if self._awaits_profiles(candidates, now):
            return False
        nodes = [self.capacity(m) for m in candidates]
        planned, note = None, "explicit (the placement setting)"
        if not self.explicit:
            try:
                planned = self._planned(candidates, links, nodes)
            except PlanUnusable as exc:
                note = f"by memory, not by the planner: {exc}"
            else:
                if planned is None:
                    return False  # the planner's search runs (off this loop)
        if planned is not None:
            plan = planned.stages
            note = (f"by the planner: predicted {planned.score:.2f} tok/s "
                    f"({self._objective()})" + (f", {planned.assumed_links} link(s) assumed "
                                                "until probed" if planned.assumed_links else ""))
        else:
            try:
                plan = assign_runs(self.needs, nodes, head=self.head, explicit=self.explicit)
            except PlacementError as exc:
                if str(exc) != self.plan_error:
                    log.error("placement failed: %s", exc)
                self.plan_error = str(exc)
                return False
        self.plan, self.plan_error, self.placement_note = plan, "", note
        self.by_planner = planned is not None
        self.left_out = dict(planned.left_out) if planned is not None else {}
        self._mark_stages(members)
        log.info("placement %s: %s", note, ", ".join(f"stage {s} -> {n}"
                                                     for s, n in sorted(plan.items())))
        for node, why in sorted(self.left_out.items()):
            log.info("node %s is left out (a spare): %s", node, why)
        return True

    def _awaits_profiles(self, candidates: Sequence[ms.Member], now: float | None) -> bool:
        """Whether to wait for a node's answer to the profile request: only while every
        node that answered has a profile (else the planner cannot place anyway), for
        ``PROFILE_ANSWER_S`` after it enrolled at most."""
        if self.planner is None or self.explicit or now is None:
            return False
        answered = [m for m in candidates if m.profile_answered]
        return all(m.profile is not None for m in answered) and any(
            not m.profile_answered and now - m.enrolled_at < PROFILE_ANSWER_S
            for m in candidates)

    def _planned(self, candidates: Sequence[ms.Member], links: Sequence[LinkStatus],
                 nodes: Sequence[NodeCapacity]) -> PlannedStages | None:
        """The planner's placement; None while its search runs."""
        if self.planner is None:
            raise PlanUnusable("the export's model shape is unknown")
        memory = {c.node_id: c.memory_bytes for c in nodes}
        return self.planner.place_soon((self._signature(candidates, links),
                                        tuple(sorted(memory.items()))), candidates, links, memory)

    @staticmethod
    def _signature(fleet: Sequence[ms.Member], links: Sequence[LinkStatus]) -> tuple[object, ...]:
        """What a placement on ``fleet`` depends on: its nodes, their profiles, the links."""
        return (tuple(sorted((m.node_id, m.profile.measured_at if m.profile else -1.0,
                              m.profile_state) for m in fleet)),
                tuple(sorted((link.a, link.b, link.measured_at) for link in links)))

    def _objective(self) -> str:
        return self.planner.objective if self.planner is not None else "latency"

    def reassign(self, members: Mapping[str, ms.Member], now: float, grace: float) -> list[int]:
        """Give the stage of a node down for ``grace`` seconds to an idle spare that fits.

        Returns the stages moved. The node that comes back later is a spare itself.
        """
        if self.plan is None:
            return []
        moved = []
        for stage, node_id in sorted(self.plan.items()):
            old = members[node_id]
            if old.local or old.state not in (ms.DEAD, ms.LEFT) or now - old.down_since < grace:
                continue
            need = self.needs[stage]
            spares = [self.capacity(m) for m in members.values()
                      if not m.local and m.state == ms.IDLE and m.node_id not in
                      self.plan.values()]
            fitting = [c for c in spares if c.memory_bytes >= need.bytes]
            if not fitting:
                continue
            best = max(fitting, key=lambda c: (need.shard_hash in c.cached, c.tok_s or 0.0,
                                               c.memory_bytes))
            self.plan[stage] = best.node_id
            self._mark_stages(members)
            log.warning("stage %d moves from %s (%s) to spare %s", stage, node_id, old.state,
                        best.node_id)
            moved.append(stage)
        return moved

    def heal(self, members: Mapping[str, ms.Member], now: float, grace: float,
             spares_first: bool = True) -> list[int]:
        """Give the stages of a node down for ``grace`` seconds to its live neighbours in the
        chain (``controlplane.heal``) when no idle spare could take them (``spares_first``:
        ``reassign`` gives them to spares; else the neighbours take them whatever spares
        there are, and a re-plan may use the spares once the pipeline serves again);
        returns the stages moved. The node that comes back later is a spare. When the
        survivors cannot hold them, ``heal_error`` says why and the pipeline stays down."""
        if self.plan is None:
            return []
        moved: list[int] = []
        for node_id, stages in hosts(self.plan):
            old = members[node_id]
            if old.local or old.state not in (ms.DEAD, ms.LEFT) or now - old.down_since < grace:
                continue
            if spares_first and any(self._spare_for(members, s) for s in stages):
                continue  # ``reassign`` gives the stage to the spare
            live = {n: self.capacity(members[n]) for n in set(self.plan.values())
                    if n != node_id and members[n].alive}
            try:
                plan = heal_plan(self.plan, node_id, self.needs, live)
            except PlacementError as exc:
                if str(exc) != self.heal_error:
                    log.error("cannot heal: %s", exc)
                self.heal_error = str(exc)
                continue
            self.plan, self.heal_error, self.by_planner = plan, "", False
            self._mark_stages(members)
            log.warning("node %s (%s) is lost: %s", node_id, old.state, ", ".join(
                f"stage {s} -> {plan[s]}" for s in stages))
            moved += stages
        return moved

    def rebalance(self, members: Mapping[str, ms.Member], now: float, settled: float,
                  links: Sequence[LinkStatus] = (), give_back: bool = True) -> list[int]:
        """While the pipeline serves, spread it over the fleet again: by the planner when
        every node has a usable profile (``replan``), else (``give_back``: when healing is
        on; and not while the plan is the planner's: a spare still profiling, or whose
        profile failed, is not given stages it may be too slow for) by giving part of a
        node's run of
        several stages (it took a lost node's) to a spare, one that runs none and has been
        enrolled for ``settled`` seconds without a lapse (a node that flaps gets nothing;
        a node the planner left out is not taken). One move per call, to the spare whose
        move leaves the busiest node lightest. Returns the stages moved; the spare is
        offered their shards and the pipeline is re-wired once it holds them (generations
        pause for that, and resume as after any re-wiring)."""
        if self.plan is None:
            return []
        state = self.state(members)
        self._settle_switch(members, state)
        if state != "serving":
            if self.pending is not None:
                self.abandon(f"the pipeline is {self.state(members)}")
            return []
        if self.pending is not None:
            return self._switch_when_ready(members)
        if self.planner is not None and not self.explicit and self.replan(
                members, now, settled, links):
            return []
        if not give_back or self.by_planner:
            return []
        spares = [m for m in members.values()
                  if not m.local and m.state == ms.IDLE and m.node_id not in self.plan.values()
                  and m.node_id not in self.left_out
                  and now - m.enrolled_at >= settled and not m.recent_lapses(now, settled)]
        moves = [(m, rebalance_plan(self.plan, self.head, self.capacity(m), self.needs))
                 for m in spares]
        moves = [(m, plan) for m, plan in moves if plan is not None]
        if not moves:
            return []
        member, plan = min(moves, key=lambda mp: (self._busiest(mp[1]), mp[0].node_id))
        moved = sorted(s for s, n in plan.items() if n == member.node_id)
        self.plan = plan
        self._mark_stages(members)
        log.warning("node %s takes stage(s) %s back: %s", member.node_id,
                    ", ".join(map(str, moved)), ", ".join(f"stage {s} -> {n}" for s, n in
                                                          sorted(plan.items())))
        return moved

    # -- re-planning -----------------------------------------------------------------------
    def _fleet(self, members: Mapping[str, ms.Member], now: float, settled: float
               ) -> list[ms.Member]:
        """The nodes a re-plan may use: the pipeline's, and the spares that are settled."""
        assert self.plan is not None
        planned = set(self.plan.values())
        return [m for m in members.values() if m.node_id in planned or (
            not m.local and m.state in (ms.IDLE, ms.READY) and now - m.enrolled_at >= settled
            and not m.recent_lapses(now, settled))]

    @property
    def replan_note(self) -> str:
        """The last re-plan's outcome in words ("": none yet)."""
        return self.last_replan.note

    def _replanned(self, kind: str, note: str) -> None:
        """Record a re-plan's outcome (one the same as the last is not counted again)."""
        last = self.last_replan
        if (kind, note) == (last.kind, last.note):
            return
        self.last_replan = ReplanStatus(kind, note, self._clock(),
                                        last.count + (kind not in UNCOUNTED_REPLAN_KINDS))

    def replan(self, members: Mapping[str, ms.Member], now: float, settled: float,
               links: Sequence[LinkStatus]) -> bool:
        """Place again by the planner when the fleet changed since the last time (its
        nodes, their profiles, the links measured, the plan): a placement predicted faster
        than the current one by more than the planner's gain becomes ``pending``; one that
        is not is logged with both predictions. False when the planner cannot place (why
        is logged once), True when it could (whatever it decided) or while its search runs
        (off this loop: a later call takes its result, or starts another when the fleet
        changed meanwhile)."""
        assert self.planner is not None and self.plan is not None
        fleet = self._fleet(members, now, settled)
        signature = (tuple(sorted(self.plan.items())), *self._signature(fleet, links))
        if self._considered is not None and self._considered[0] == signature:
            return self._considered[1]
        memory = {m.node_id: self.capacity(m).memory_bytes for m in fleet}
        try:
            found = self.planner.replan_soon(signature, self.plan, fleet, links, memory)
            if found is None:
                return True
        except PlanUnusable as exc:
            self._considered = (signature, False)
            note = f"no re-plan: {exc}"
            if note != self.replan_note:
                log.warning("%s", note)
            self._replanned("unusable", note)
            return False
        self._considered = (signature, True)
        planned, objective = found.planned, self._objective()
        spares = {m.node_id for m in fleet if m.node_id not in self.plan.values()}
        if planned.stages == self.plan:
            self._left_out({n: planned.left_out.get(n, "the planner leaves it out")
                            for n in spares}, self.plan)
            if self.last_replan.kind == "unusable":  # its note would outlive its cause
                self._replanned("kept", f"the plan stands: {found.describe(objective)}")
            return True
        if not found.worth_it:
            self._replanned("not_applied", f"re-plan not applied: {found.describe(objective)}")
            log.info("%s: %s", self.replan_note, planned.describe(self.manifest))
            self._left_out({n: planned.left_out.get(
                n, f"a re-plan using it is not worth re-wiring ({found.describe(objective)})")
                for n in spares}, self.plan)
            return True
        self.pending = planned.stages
        self._left_out(planned.left_out, planned.stages)
        self._replanned("planning", f"re-planning: {found.describe(objective)}")
        log.warning("%s: %s; the nodes fetch the shards they lack while the pipeline serves, "
                    "then it is re-wired", self.replan_note, planned.describe(self.manifest))
        return True

    def _left_out(self, reasons: Mapping[str, str], plan: Mapping[int, str]) -> None:
        """The planner's reasons for the nodes ``plan`` leaves out (a node not considered
        this time, e.g. one not settled yet, keeps the reason it had)."""
        self.left_out = {node: why for node, why in {**self.left_out, **reasons}.items()
                         if node not in plan.values()}

    def pending_offers(self, members: Mapping[str, ms.Member]
                       ) -> list[tuple[ms.Member, int, bool]]:
        """Shard offers for the pending plan, with whether each is quiet: to a node that
        runs a stage now, whose fetch must leave its state (and the pipeline) as it is."""
        if self.pending is None or self.plan is None:
            return []
        running = set(self.plan.values())
        due = []
        for node_id, stages in hosts(self.pending):
            member = members[node_id]
            if member.local or member.offered is not None or not member.alive:
                continue
            missing = [s for s in stages if self.hashes[s] not in member.shards]
            if missing and member.state != ms.FAILED:
                due.append((member, missing[0], node_id in running))
        return due

    def abandon(self, why: str) -> None:
        """Drop the pending plan: the pipeline serves on as it is placed."""
        if self.pending is None:
            return
        self.pending = None
        self._replanned("abandoned", f"re-plan abandoned: {why}; serving on the current "
                        "placement")
        log.error("%s", self.replan_note)

    def _switch_when_ready(self, members: Mapping[str, ms.Member]) -> list[int]:
        """Switch to the pending plan once each of its nodes holds its shards (abandon it
        when one is down or failed); returns the stages that moved."""
        assert self.pending is not None and self.plan is not None
        for node_id, stages in hosts(self.pending):
            member = members[node_id]
            why = DOWN_REASONS.get(member.state)
            if why is not None:
                self.abandon(f"node {node_id} {why}" + (f": {member.error}" if member.error
                                                         else ""))
                return []
            if member.offered is not None or any(self.hashes[s] not in member.shards
                                                 for s in stages):
                return []
        moved = sorted(s for s, n in self.pending.items() if self.plan[s] != n)
        self.previous, self.plan, self.pending = self.plan, self.pending, None
        self.by_planner = True
        self._mark_stages(members)
        self._replanned("applied", self.replan_note.replace("re-planning", "re-planned", 1))
        log.warning("re-plan applied, re-wiring: %s", ", ".join(
            f"stage {s} -> {n}" for s, n in sorted(self.plan.items())))
        return moved

    def _settle_switch(self, members: Mapping[str, ms.Member], state: str) -> None:
        """After a switch: forget the previous plan once the new one serves (or a node of it
        is down: healing takes over); go back to it when a node cannot start its stage."""
        if self.previous is None or self.plan is None:
            return
        if state == "serving" or state == "degraded":
            self.previous = None
            return
        if state != "failed" or not all(members[n].alive for n in self.previous.values()):
            return
        problem = self.problem(members) or "a node failed"
        self.plan, self.previous, self._wiring = self.previous, None, None
        self._mark_stages(members)
        self._replanned("failed", f"re-plan failed ({problem}): back on the previous "
                        "placement")
        log.error("%s", self.replan_note)

    def releases(self, members: Mapping[str, ms.Member]) -> list[ms.Member]:
        """Live remote nodes that run a stage no longer in the plan (a re-plan left them
        out): to be released from it, as spares."""
        if self.plan is None:
            return []
        planned = set(self.plan.values())
        return [m for m in members.values() if not m.local and m.alive and m.assigned is not None
                and m.node_id not in planned]

    def _busiest(self, plan: Mapping[int, str]) -> int:
        """The bytes the busiest node of ``plan`` holds."""
        return max(sum(self.needs[s].bytes for s in stages) for _, stages in hosts(plan))

    def _spare_for(self, members: Mapping[str, ms.Member], stage: int) -> bool:
        assert self.plan is not None
        need = self.needs[stage].bytes
        return any(not m.local and m.state == ms.IDLE and m.node_id not in self.plan.values()
                   and self.capacity(m).memory_bytes >= need for m in members.values())

    def _mark_stages(self, members: Mapping[str, ms.Member]) -> None:
        """Each member's ``stage``: the first of the stages it runs (None: a spare)."""
        assert self.plan is not None
        first = {node: stages[0] for node, stages in hosts(self.plan)}
        for member in members.values():
            member.stage = first.get(member.node_id)

    def offers_due(self, members: Mapping[str, ms.Member]) -> list[tuple[ms.Member, int]]:
        """Planned remote nodes due a shard offer, with the stage: one that (re-)enrolled
        (its first stage: cached shards are checked too), or one that lacks the shard of a
        stage it now runs (it took a lost node's)."""
        if self.plan is None:
            return []
        due = []
        for node_id, stages in hosts(self.plan):
            member = members[node_id]
            if member.local or member.offered is not None:
                continue
            missing = [s for s in stages if self.hashes[s] not in member.shards]
            if member.state == ms.IDLE:
                due.append((member, stages[0]))
            elif missing and member.state in (ms.READY, ms.WIRING, ms.SERVING):
                due.append((member, missing[0]))
        return due

    def assignments(self, members: Mapping[str, ms.Member]) -> list[tuple[ms.Member, AssignStage]]:
        """AssignStage messages for nodes whose wiring changed (empty until all hold shards)."""
        if self.plan is None:
            return []
        chain = [(members[n], stages) for n, stages in hosts(self.plan)]
        for member, stages in chain:
            if not member.alive or member.state == ms.TRANSFERRING or \
                    any(self.hashes[s] not in member.shards for s in stages):
                return []
        count = len(chain)
        # a node that enrolled again is a new process (or lost its coordinator's link): its
        # stage starts empty, so the wiring is new even at the same addresses, and steps
        # still queued for the old process are dropped as stale, not taken as lost frames
        wiring = {m.node_id: (tuple(stages), m.info.data_addr,
                              chain[(k + 1) % count][0].info.data_addr, m.info.data_key,
                              m.enrolments)
                  for k, (m, stages) in enumerate(chain)}
        if wiring != self._wiring:
            self.epoch += 1
            self._wiring = wiring
            log.info("wiring the pipeline (epoch %d): %s", self.epoch,
                     " -> ".join(f"{m.node_id}@{m.info.data_addr} (stage "
                                 f"{layer_range(stages[0], stages[-1] + 1)})"
                                 for m, stages in chain))
        due = []
        curve = bool(members[self.head].info.data_key)  # the coordinator runs CURVE
        for k, (member, stages) in enumerate(chain):
            after, before = chain[(k + 1) % count][0], chain[k - 1][0]
            infos = [self._stage_info(s) for s in stages]
            keys = ({"peer_key": after.info.data_key, "admit_keys": [before.info.data_key]}
                    if curve else {})
            msg = AssignStage(self.epoch, infos[0], self.num_stages, self.manifest.model.name,
                              self.hashes[stages[0]], member.info.data_addr,
                              after.info.data_addr, self.runtime, **keys,
                              more_stages=infos[1:],
                              more_hashes=[self.hashes[s] for s in stages[1:]])
            if member.assigned != msg:
                member.assigned = msg
                due.append((member, msg))
        return due

    def _stage_info(self, stage: int) -> StageInfo:
        spec = self.manifest.stages[stage]
        return StageInfo(spec.index, spec.layer_start, spec.layer_end, spec.xml, spec.bin,
                         spec.first, spec.last)

    def describe(self) -> str:
        """How the stages were placed (by the planner, or why not) and the last re-plan."""
        return "; ".join(note for note in (self.placement_note, self.replan_note) if note)

    def state(self, members: Mapping[str, ms.Member]) -> str:
        """waiting, degraded, failed, transferring, wiring or serving."""
        if self.plan is None:
            return "waiting"
        planned = [members[n] for n in self.plan.values()]
        if any(m.state in (ms.DEAD, ms.LEFT) for m in planned):
            return "degraded"
        if any(m.state == ms.FAILED for m in planned):
            return "failed"
        if any(m.state == ms.TRANSFERRING for m in planned):
            return "transferring"
        if all(m.state == ms.SERVING and m.ready_epoch == self.epoch for m in planned):
            return "serving"
        return "wiring"

    def problem(self, members: Mapping[str, ms.Member]) -> str | None:
        """Why the placed pipeline cannot run steps now: a planned node is dead, gone or
        failed (the first such stage, named with its layers and node), or the pipeline is
        being re-wired (shards moving, stages starting); None when it serves, and before
        it is first placed."""
        if self.plan is None:
            return None
        for stage, node_id in sorted(self.plan.items()):
            member = members[node_id]
            why = DOWN_REASONS.get(member.state)
            if why is None:
                continue
            spec = self.manifest.stages[stage]
            detail = f": {member.error}" if member.state == ms.FAILED and member.error else ""
            if self.heal_error and member.state in (ms.DEAD, ms.LEFT):
                detail = f"; {self.heal_error}"
            return (f"stage {stage} (layers {layer_range(spec.layer_start, spec.layer_end)}) "
                    f"on node {node_id} at {member.info.host} {why}{detail}")
        state = self.state(members)
        return None if state == "serving" else f"the pipeline is {state} (epoch {self.epoch})"

    def stage_status(self, members: Mapping[str, ms.Member]) -> list[StageStatus]:
        out = []
        for spec, need in zip(self.manifest.stages, self.needs, strict=True):
            node_id = self.plan.get(spec.index) if self.plan else None
            state = members[node_id].state if node_id else "unplaced"
            out.append(StageStatus(spec.index, spec.layer_start, spec.layer_end,
                                   self.hashes[spec.index], need.bytes, node_id, state))
        return out
