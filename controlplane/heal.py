"""Healing onto the survivors, and giving stages back (pure): which surviving nodes take
a lost node's stages, and which of a node's stages a spare that appears takes over.

A fleet of PCs rarely has a spare: when a node is lost, its neighbours in the chain carry
its stages. A node runs a contiguous run of stages (dataplane.runtime.stage_chain), so the lost
node's run goes to the node before it, the node after it, or is cut between the two; of
the cuts whose stages fit the nodes' memory, the one whose busiest node holds the fewest
bytes wins (the pipeline runs at its slowest node's pace). Memory is the stages' needs
(weights, runtime overhead, KV reserve) against what each node reported usable.

When a node comes back (or a new one joins) while another carries several stages, the
newcomer takes the head or the tail of the busiest such run, so that every node keeps a
contiguous run and the busiest one holds the fewest bytes: the fleet spreads out again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from controlplane.placement import NodeCapacity, PlacementError, StageNeed, fmt_bytes


def hosts(plan: Mapping[int, str]) -> list[tuple[str, list[int]]]:
    """The chain of nodes in stage order, each with its run of stages; ValueError unless
    every node's stages are contiguous (a node appears once in the chain)."""
    chain: list[tuple[str, list[int]]] = []
    for stage in sorted(plan):
        node = plan[stage]
        if chain and chain[-1][0] == node:
            chain[-1][1].append(stage)
            continue
        if any(n == node for n, _ in chain):
            raise ValueError(f"node {node} holds stages that are not contiguous: {dict(plan)}")
        chain.append((node, [stage]))
    return chain


def heal_plan(plan: Mapping[int, str], lost: str, needs: Sequence[StageNeed],
              capacity: Mapping[str, NodeCapacity]) -> dict[int, str]:
    """``plan`` (stage -> node) with ``lost``'s stages moved to its neighbours in the chain.

    ``capacity`` holds the nodes that may take stages (the live ones). PlacementError,
    naming the stages and what each neighbour has, when no cut fits.
    """
    chain = hosts(plan)
    at = next((i for i, (node, _) in enumerate(chain) if node == lost), None)
    if at is None:
        return dict(plan)
    run = chain[at][1]
    before = chain[at - 1][0] if at > 0 else None
    after = chain[at + 1][0] if at + 1 < len(chain) else None
    held = {node: sum(needs[s].bytes for s in stages) for node, stages in chain}
    best: tuple[int, int, dict[int, str]] | None = None
    for cut in range(len(run) + 1):  # run[:cut] to the node before, run[cut:] after
        left, right = run[:cut], run[cut:]
        if (left and before not in capacity) or (right and after not in capacity):
            continue
        load = dict(held)
        for stages, node in ((left, before), (right, after)):
            if stages and node is not None:
                load[node] += sum(needs[s].bytes for s in stages)
        takers = [n for stages, n in ((left, before), (right, after)) if stages]
        if any(load[n] > capacity[n].memory_bytes for n in takers if n is not None):
            continue
        score = (max(load[n] for n in takers if n is not None), abs(len(left) - len(right)))
        if best is None or score < best[:2]:
            new = dict(plan)
            new.update({s: before for s in left if before is not None})
            new.update({s: after for s in right if after is not None})
            best = (*score, new)
    if best is None:
        raise PlacementError(_no_room(run, lost, needs, held, before, after, capacity))
    return best[2]


def _no_room(run: list[int], lost: str, needs: Sequence[StageNeed], held: Mapping[str, int],
             before: str | None, after: str | None, capacity: Mapping[str, NodeCapacity]) -> str:
    wanted = sum(needs[s].bytes for s in run)
    stages = ", ".join(str(s) for s in run)
    offers = []
    for node in (before, after):
        if node is None:
            continue
        if node not in capacity:
            offers.append(f"node {node} is down too")
            continue
        room = capacity[node].memory_bytes - held[node]
        offers.append(f"node {node} has {fmt_bytes(max(0, room))} to spare")
    where = "; ".join(offers) or "no node is left beside it"
    return (f"the survivors cannot hold stage(s) {stages} of lost node {lost} "
            f"({fmt_bytes(wanted)}): {where}")


def rebalance_plan(plan: Mapping[int, str], head: str, spare: NodeCapacity,
                   needs: Sequence[StageNeed]) -> dict[int, str] | None:
    """``plan`` with part of the busiest multi-stage run given to ``spare`` (a node that
    runs no stage), or None when no node runs more than one stage or no part fits the
    spare's memory. ``head`` (the coordinator) keeps stage 0, so the spare takes only the
    tail of its run; another node's run gives its head or its tail. Of the moves that fit,
    the one whose busier side holds the fewest bytes wins, then one whose shards the spare
    has cached, then the most even split, then the one that leaves the coordinator (which
    also runs the generation loop) the least."""
    held = {node: sum(needs[s].bytes for s in stages) for node, stages in hosts(plan)}
    best: tuple[tuple[int, ...], list[int]] | None = None
    for node, stages in hosts(plan):
        if len(stages) < 2:
            continue
        for cut in range(1, len(stages)):
            parts = [stages[cut:]] if node == head else [stages[cut:], stages[:cut]]
            for moved in parts:
                size = sum(needs[s].bytes for s in moved)
                if size > spare.memory_bytes:
                    continue
                uncached = any(needs[s].shard_hash not in spare.cached for s in moved)
                score = (-held[node], max(held[node] - size, size), int(uncached),
                         abs(len(stages) - 2 * len(moved)), -len(moved) * (node == head))
                if best is None or score < best[0]:
                    best = (score, moved)
    if best is None:
        return None
    return {**plan, **{s: spare.node_id for s in best[1]}}
