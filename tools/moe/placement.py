"""Where the MoE benchmark's processes run (pure: the cores are passed in).

``split`` stands in for PCs of equal size on one machine: the cores are cut in as many
sets as the cluster has nodes, each node confined to its own set, and the benchmark's
process (openvino_genai and zctl's 1-stage shards, the one-PC systems) to the first set,
the coordinator's, so the monolithic baseline runs on one such PC and the cluster on
two. No stage then shares a core with another process's plugin threads (which spin for
a while after every inference), as nodes on separate PCs do not.

``shared`` leaves every process unconfined: each stage and the one-PC systems may use
every core, and the idle stage's spinning plugin thread takes a core from the stage
computing next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zctl.launcher.cpusets import CPU_SET_MODES, format_cpu_list, split_cpus

PLACEMENTS = CPU_SET_MODES


@dataclass(frozen=True)
class Placement:
    """CPU lists (None: unconfined): the benchmark's own process, and each cluster
    process, the coordinator first."""

    mode: str
    bench_cpus: str | None
    node_cpus: tuple[str | None, ...]


def bench_placement(mode: str, available: Sequence[int], nodes: int = 2) -> Placement:
    """The placement ``mode`` (one of PLACEMENTS) of a ``nodes``-node cluster and the
    benchmark's process on the cores ``available``; ValueError for an unknown mode, or
    for ``split`` with fewer cores than nodes."""
    if mode not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, not {mode!r}")
    if mode == "shared":
        return Placement(mode, None, (None,) * nodes)
    sets = tuple(format_cpu_list(cpus) for cpus in split_cpus(list(available), nodes))
    return Placement(mode, sets[0], sets)
