"""CPU sets for co-located nodes: parse ``--cpus`` lists, split a machine's cores among
the processes of a local cluster, and confine this process to its set.

Several nodes on one machine (``zctl cluster up --local N``) share its cores. With
``shared`` CPU sets every stage uses every core, which gives one stream the lowest
latency. With ``split`` each node gets its own cores, as if it were its own PC: the
stages then compute different streams at the same time without stealing each other's
cores, which is what pipelined micro-batching needs. OpenVINO sizes its thread pool
from the affinity mask, so confining a process before its first compile is enough.
"""

from __future__ import annotations

import os

CPU_SET_MODES = ("shared", "split")


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,6"`` -> ``[0, 1, 2, 3, 6]`` (sorted, unique); ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad CPU list {text!r}: expected numbers and ranges like 0-3,6")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"bad CPU range {part!r} in {text!r}: the end is below the start")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def format_cpu_list(cpus: list[int]) -> str:
    """``[0, 1, 2, 3, 6]`` -> ``"0-3,6"`` (the inverse of parse_cpu_list)."""
    runs: list[str] = []
    ordered = sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(runs)


def split_cpus(available: list[int], parts: int) -> list[list[int]]:
    """Split ``available`` cores into ``parts`` disjoint, contiguous, near-equal sets.

    The first sets get the extra cores (stage 0 also runs the coordinator's loop).
    """
    cores = sorted(set(available))
    if parts < 1:
        raise ValueError(f"cannot split CPUs into {parts} sets")
    if len(cores) < parts:
        raise ValueError(f"{parts} nodes need at least {parts} CPUs for split CPU sets; this "
                         f"process may use {len(cores)} ({format_cpu_list(cores)}); use "
                         "shared CPU sets")
    base, extra = divmod(len(cores), parts)
    sets, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        sets.append(cores[start:start + size])
        start += size
    return sets


def local_cpu_sets(mode: str, nodes: int) -> list[str | None]:
    """The ``--cpus`` value of each of ``nodes`` local processes (None: no confinement)."""
    if mode not in CPU_SET_MODES:
        raise ValueError(f"CPU sets must be one of {CPU_SET_MODES}, not {mode!r}")
    if mode == "shared":
        return [None] * nodes
    return [format_cpu_list(s) for s in split_cpus(sorted(os.sched_getaffinity(0)), nodes)]


def confine_to(text: str) -> list[int]:
    """Confine this process (and threads it starts later) to the CPUs in ``text``."""
    cpus = parse_cpu_list(text)
    allowed = os.sched_getaffinity(0)
    missing = [c for c in cpus if c not in allowed]
    if missing:
        raise ValueError(f"--cpus {text}: CPU {format_cpu_list(missing)} is not available to "
                         f"this process (it may use {format_cpu_list(sorted(allowed))})")
    os.sched_setaffinity(0, cpus)
    return cpus
