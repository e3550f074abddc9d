"""The cluster's events, read from the difference between two cluster status snapshots:
nodes joining, lost, leaving and coming back, stages healed onto survivors or given back
to a node, re-plans, version (and other) refusals, and the pipeline degrading and serving
again. ``status_events`` is pure; ``Timeline`` keeps the latest events of a watched
cluster, each with an id that only grows.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from controlplane.membership import ALIVE, DEAD, LEFT
from controlplane.records import ClusterStatus, NodeStatus

SERVING = "serving"
DOWN_PIPELINES = ("degraded", "failed")
KINDS = ("joined", "lost", "left", "returned", "healed", "given_back", "replan", "refused",
         "degraded", "serving")


@dataclass(frozen=True)
class ClusterEvent:
    """One event: its kind (one of KINDS), when (Unix seconds, as the coordinator's clock
    says), what happened in a sentence, and the node it is about ("" for the pipeline)."""

    kind: str
    time: float
    text: str
    node: str = ""


def _node_events(before: dict[str, NodeStatus], after: dict[str, NodeStatus], time: float
                 ) -> list[ClusterEvent]:
    events = []
    for node_id, node in after.items():
        name = node.name
        old = before.get(node_id)
        if old is None:
            if node.state in ALIVE:
                events.append(ClusterEvent("joined", time, f"{name} joined from {node.host}",
                                           name))
        elif old.state in ALIVE and node.state == DEAD:
            events.append(ClusterEvent("lost", time, f"{name} stopped answering "
                                                     "(no heartbeat)", name))
        elif old.state in ALIVE and node.state == LEFT:
            events.append(ClusterEvent("left", time, f"{name} left the cluster", name))
        elif old.state in (DEAD, LEFT) and node.state in ALIVE:
            events.append(ClusterEvent("returned", time, f"{name} is back", name))
    for node_id, old in before.items():
        if node_id not in after and old.state in ALIVE:
            name = old.name
            events.append(ClusterEvent("left", time, f"{name} left the cluster", name))
    return events


def _stage_events(before: ClusterStatus, after: ClusterStatus, nodes: dict[str, NodeStatus],
                  replanned: bool, time: float) -> list[ClusterEvent]:
    events = []
    old_places = {s.index: s.node_id for s in before.stages}
    for stage in sorted(after.stages, key=lambda s: s.index):
        old, new = old_places.get(stage.index), stage.node_id
        if old is None or new is None or old == new:
            continue
        left = nodes.get(old)
        old_name = left.name if left is not None else old
        new_name = nodes[new].name if new in nodes else new
        if left is None or left.state not in ALIVE:
            events.append(ClusterEvent("healed", time, f"stage {stage.index} moved from "
                                       f"{old_name} (lost) to {new_name}", new_name))
        elif replanned:
            events.append(ClusterEvent("replan", time, f"stage {stage.index} moved from "
                                       f"{old_name} to {new_name} (re-plan)", new_name))
        else:
            events.append(ClusterEvent("given_back", time, f"stage {stage.index} given back: "
                                       f"{old_name} to {new_name}", new_name))
    return events


def status_events(before: ClusterStatus | None, after: ClusterStatus) -> list[ClusterEvent]:
    """What happened between two snapshots of one cluster, oldest first; with no
    ``before``, only the refusals ``after`` remembers (each at its own time)."""
    time = after.time_s
    if before is None:
        return [ClusterEvent("refused", time - r.age_s, f"{r.node_id} ({r.host}) refused: "
                             f"{r.reason}", r.node_id) for r in after.refused]
    events = _node_events({n.node_id: n for n in before.nodes},
                          {n.node_id: n for n in after.nodes}, time)
    replanned = after.replan.count > before.replan.count
    nodes = {n.node_id: n for n in after.nodes}
    events += _stage_events(before, after, nodes, replanned, time)
    if replanned:
        events.append(ClusterEvent("replan", after.replan.time_s or time, after.replan.note))
    fresh = after.counters.get("refused", 0) - before.counters.get("refused", 0)
    if fresh > 0:
        events += [ClusterEvent("refused", time - r.age_s, f"{r.node_id} ({r.host}) "
                                f"refused: {r.reason}", r.node_id)
                   for r in after.refused[-fresh:]]
    if after.pipeline != before.pipeline:
        if after.pipeline in DOWN_PIPELINES:
            events.append(ClusterEvent("degraded", time, f"the pipeline is {after.pipeline}: "
                                       "generations pause until it is healed"))
        elif after.pipeline == SERVING:
            events.append(ClusterEvent("serving", time, f"the pipeline serves again "
                                       f"(epoch {after.epoch})"))
    return events


class Timeline:
    """The latest ``size`` events of a cluster, fed its status snapshots as they come."""

    def __init__(self, size: int = 100) -> None:
        self._events: deque[tuple[int, ClusterEvent]] = deque(maxlen=size)
        self._next_id = 1
        self._last: ClusterStatus | None = None

    def feed(self, status: ClusterStatus) -> list[ClusterEvent]:
        """The events since the last snapshot fed (kept), and this one kept for the next."""
        if self._last is not None and self._last.session != status.session:
            self._last = None  # another coordinator: nothing to compare with
        events = status_events(self._last, status)
        self._last = status
        for event in events:
            self._events.append((self._next_id, event))
            self._next_id += 1
        return events

    def recent(self) -> list[dict[str, Any]]:
        """The events kept, oldest first, as JSON-ready mappings with their ids."""
        return [{"id": i, **asdict(event)} for i, event in self._events]
