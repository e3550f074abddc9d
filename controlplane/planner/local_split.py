"""The layer ranges to export for a local cluster: processes that share one machine.

A local cluster of N processes (``zctl cluster up --local N``) runs N stages on one
machine; each process is the machine (its profile: measured by ``zctl node profile``, else
a reference) with a share of its free memory, and the processes pass hidden states over
loopback. The ranges are the planner's split of the model over the N processes in their
order (the coordinator's first), in place of an even split of cost.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from controlplane.placement import PlacementError
from controlplane.planner.profile import Links, NodeProfile
from controlplane.planner.references import REFERENCE_LINKS
from controlplane.planner.search import PlanRequest, split_order
from controlplane.planner.shape import ModelShape


def local_ranges(shape: ModelShape, weights: str, profile: NodeProfile,
                 processes: int) -> list[tuple[int, int]]:
    """Layer ranges, one per process, for ``processes`` processes sharing the machine
    ``profile`` describes (its ``free_memory`` shared among them); PlacementError when the
    model does not fit them."""
    if not 1 <= processes <= shape.num_layers:
        raise PlacementError(f"{processes} processes cannot each take some of the "
                             f"{shape.num_layers} layers of {shape.name}")
    names = [f"process{i}" for i in range(processes)]
    share = replace(profile, free_memory=profile.free_memory // processes)
    loopback = REFERENCE_LINKS["loopback"]
    links = Links({pair: loopback.to(loopback) for pair in itertools.combinations(names, 2)})
    req = PlanRequest(shape, weights, dict.fromkeys(names, share), links, head=names[0],
                      exact_experts=profile.key.exact_experts)
    found = split_order(req, names)
    if found is None:
        raise PlacementError(f"{shape.name} in {weights} does not fit {processes} process(es) "
                             f"sharing this machine's memory")
    return found.ranges()
