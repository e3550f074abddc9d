"""A step on a node held to a CPU quota: how long it takes, alone and back to back.

A CFS quota (controlplane/cpu_quota.py) grants a node ``q = share * period`` seconds of
CPU time in every ``period``; once its threads have used them, they wait for the next
period. A step that keeps ``rho`` cores busy while it runs uses ``c = rho * w`` CPU
seconds over its unthrottled wall time ``w``.

- **A step alone** (the node idle since the last period began, so the whole quota is
  left): it runs ``q / rho`` seconds, uses up the quota, and waits ``period - q / rho``
  for the next one; it does so once for every quota its CPU time needs beyond the first:
  ``ceil(c / q) - 1`` times. Its wall time is ``w + (ceil(c / q) - 1) * max(0, period -
  q / rho)``: ``w`` when one period's quota holds it, ``~c / share`` when it is many
  periods long. (Taken as starting with a period; one that starts late in a period may
  meet the refill sooner or later by up to a period.)
- **Steps back to back**: a node whose steps start ``T`` apart uses ``c`` per ``T`` and is
  granted ``share * T``; it runs unthrottled in the long run only if ``c <= share * T``.
  So a node that is kept busy (several streams' row groups, or one stream when it is the
  pipeline's bottleneck) cannot step faster than one step each ``c / share``: that is its
  time per step as a bottleneck, ``max(alone, c / share)``. A node that idles between its
  steps longer than that catches up on the quota in the gap and runs each at its time alone.

timing.py takes the first as a stage's time within a token's cycle and the second as the
stage's occupancy, so a round of row groups (or one stream's cycle) is never shorter than
the slowed node's ``c / share``. Pure.
"""

from __future__ import annotations

import math

DEFAULT_CPU_PER_WALL = 1.0  # a step whose CPU use was not measured keeps one core busy


def check_quota(share: float, period_s: float, cpu_per_wall: float) -> None:
    """ValueError unless ``share`` is 0 (no quota) or positive cores with a positive
    ``period_s``, and ``cpu_per_wall`` is >= 0 (0: not measured)."""
    for name, value in (("share", share), ("period", period_s), ("CPU per wall second",
                                                                 cpu_per_wall)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"a CPU quota's {name} must be a number >= 0, got {value!r}")
    if share > 0 and period_s <= 0:
        raise ValueError(f"a CPU quota of {share:g} cores needs a positive period, got "
                         f"{period_s!r}")


def step_cpu_s(wall_s: float, cpu_per_wall: float) -> float:
    """CPU seconds of a step of ``wall_s`` that keeps ``cpu_per_wall`` cores busy (0: not
    measured, taken as ``DEFAULT_CPU_PER_WALL``)."""
    return wall_s * (cpu_per_wall or DEFAULT_CPU_PER_WALL)


def alone_step_s(wall_s: float, cpu_per_wall: float, share: float, period_s: float) -> float:
    """A step's wall time on a node with its whole quota left (module docstring); ``wall_s``
    when there is no quota (``share`` 0)."""
    if share <= 0 or wall_s <= 0:
        return wall_s
    rho = cpu_per_wall or DEFAULT_CPU_PER_WALL
    quota = share * period_s
    waits = max(0, math.ceil(step_cpu_s(wall_s, rho) / quota - 1e-9) - 1)
    return wall_s + waits * max(0.0, period_s - quota / rho)


def busy_step_s(wall_s: float, cpu_per_wall: float, share: float, period_s: float) -> float:
    """A step's time on a node that steps back to back: its time alone, and never less than
    its CPU time over the share (module docstring); ``wall_s`` when there is no quota."""
    alone = alone_step_s(wall_s, cpu_per_wall, share, period_s)
    if share <= 0:
        return alone
    return max(alone, step_cpu_s(wall_s, cpu_per_wall) / share)



def busy_scale(cpu_per_wall: float, share: float) -> float:
    """How many times its unthrottled time a step long beside the quota's period takes back
    to back: ``max(1, rho / share)`` (1 with no quota). The split of layers ranks placements
    by it (a linear stand-in for ``busy_step_s``, exact when steps span many periods)."""
    if share <= 0:
        return 1.0
    return max(1.0, (cpu_per_wall or DEFAULT_CPU_PER_WALL) / share)
