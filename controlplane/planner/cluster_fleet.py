"""A running cluster as a fleet to plan on: its nodes' measured profiles and its links.

From ``zctl cluster status``'s snapshot: each live node's profile (measured for the served
model, kept as it reported it) with the memory it has free now plus what its stages hold
(a new plan would move them), and each link the coordinator probed. A pair of nodes whose
link was not probed (not neighbours in the pipeline) gets an estimate from the links each
of them was probed on: half of its quickest round trip for each end, and the narrower of
the two ends' best bandwidths. Each profile is taken at the node's speed now (its
``speed_factor``: controlplane/planner/speed.py), said in the notes when it is not 1. A
node without a usable profile, or without any measured
link, is left out with the reason in the notes; when no node is left, ProfileError says
why, naming each node's profile state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from controlplane.planner.measured import profile_of
from controlplane.planner.profile import LinkProfile, Links, NodeProfile, ProfileError
from controlplane.planner.shape import ModelShape
from controlplane.planner.speed import at_speed
from controlplane.records import ClusterStatus, LinkStatus, NodeStatus

DOWN = ("dead", "left")


@dataclass(frozen=True)
class ClusterFleet:
    profiles: dict[str, NodeProfile]
    links: Links
    head: str
    notes: tuple[str, ...]


def measured_links(links: list[LinkStatus]) -> dict[tuple[str, str], LinkProfile]:
    """Each probed pair's figures (a pair probed both ways: the mean of the two probes)."""
    seen: dict[tuple[str, str], list[LinkProfile]] = {}
    for link in links:
        if not link.measured_at or link.forward_bps <= 0 or link.backward_bps <= 0:
            continue
        figures = LinkProfile(link.rtt_s, link.forward_bps, link.backward_bps)
        if (link.b, link.a) in seen:
            seen[(link.b, link.a)].append(figures.reversed())
        else:
            seen.setdefault((link.a, link.b), []).append(figures)
    return {pair: LinkProfile(sum(f.rtt_s for f in got) / len(got),
                              sum(f.forward_bps for f in got) / len(got),
                              sum(f.backward_bps for f in got) / len(got))
            for pair, got in seen.items()}


def estimated_links(nodes: list[str], measured: Mapping[tuple[str, str], LinkProfile]
                    ) -> dict[tuple[str, str], LinkProfile]:
    """Every pair of ``nodes``: measured where probed, else estimated (module docstring);
    nodes without a measured link are missing from the pairs."""
    share: dict[str, float] = {}
    up: dict[str, float] = {}
    down: dict[str, float] = {}
    for (a, b), link in measured.items():
        for node in (a, b):
            share[node] = min(share.get(node, link.rtt_s / 2), link.rtt_s / 2)
        up[a] = max(up.get(a, 0.0), link.forward_bps)
        down[b] = max(down.get(b, 0.0), link.forward_bps)
        up[b] = max(up.get(b, 0.0), link.backward_bps)
        down[a] = max(down.get(a, 0.0), link.backward_bps)
    pairs = {}
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            if (a, b) in measured:
                pairs[(a, b)] = measured[(a, b)]
            elif (b, a) in measured:
                pairs[(a, b)] = measured[(b, a)].reversed()
            elif a in share and b in share:
                pairs[(a, b)] = LinkProfile(share[a] + share[b], min(up[a], down[b]),
                                            min(up[b], down[a]))
    return pairs


def usable_profile(node: NodeStatus, shape: ModelShape, weights: str
                   ) -> tuple[NodeProfile | None, str]:
    """``node``'s profile for ``shape`` in ``weights`` at the speed it runs now (its
    ``speed_factor``: controlplane/planner/speed.py), or None and why it has none usable."""
    if node.profile is None:
        return None, node.profile_state or "not profiled yet"
    record = node.profile
    if (record.shape, record.weights) != (shape.fingerprint(), weights):
        return None, (f"profiled for shape {record.shape} in {record.weights}, not "
                      f"{shape.fingerprint()} in {weights}")
    try:
        return at_speed(profile_of(record), node.speed_factor), ""
    except ProfileError as exc:
        return None, str(exc)


def cluster_fleet(status: ClusterStatus, shape: ModelShape, weights: str) -> ClusterFleet:
    """The fleet ``status`` describes for ``shape`` in ``weights`` (module docstring)."""
    held: dict[str, int] = {}
    for stage in status.stages:
        if stage.node_id:
            held[stage.node_id] = held.get(stage.node_id, 0) + stage.bytes
    profiles: dict[str, NodeProfile] = {}
    notes: list[str] = []
    for node in status.nodes:
        if node.state in DOWN:
            continue
        profile, why = usable_profile(node, shape, weights)
        if profile is None:
            notes.append(f"node {node.node_id} left out: {why}")
            continue
        profiles[node.node_id] = replace(profile,
                                         free_memory=node.ram_free + held.get(node.node_id, 0))
        if node.speed_factor != 1:
            notes.append(f"node {node.node_id} runs at speed factor {node.speed_factor:.2f} "
                         "(its reference workload's time now over when it was profiled): its "
                         "profile's times are scaled by it")
    if not profiles:
        states = "; ".join(f"{n.node_id}: {n.profile_state or 'not profiled yet'}"
                           for n in status.nodes if n.state not in DOWN)
        raise ProfileError(f"no node of the cluster at {status.endpoint} has a profile of "
                           f"{shape.name} in {weights} yet ({states}): a node measures its "
                           "profile when it joins (zctl node join), or run zctl node profile "
                           "on it")
    pairs = estimated_links(sorted(profiles), measured_links(status.links))
    linked = {n for pair in pairs for n in pair}
    if len(profiles) > 1:
        for node in sorted(set(profiles) - linked):
            notes.append(f"node {node} left out: none of its links is measured yet")
            del profiles[node]
    head = status.coordinator_id
    if head not in profiles:
        raise ProfileError(f"the coordinator {head} cannot be planned on: "
                           + next((n for n in notes if head in n), "it has no profile"))
    return ClusterFleet(profiles, Links({p: link for p, link in pairs.items()
                                         if p[0] in profiles and p[1] in profiles}),
                        head, tuple(notes))
