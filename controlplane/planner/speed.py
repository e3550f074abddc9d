"""A profile taken at another host speed: the speed factor and the profile at that speed.

A node times a fixed reference workload (controlplane/host_speed.py) when it measures its
profile, and again now and then while it runs. A host whose speed drifts (a VM whose host
is busier or quieter, a laptop on battery) runs every step of its stages slower or faster
than when it was profiled: the speed factor is the reference's time now over its time
then, bounded to ``[1 / MAX_FACTOR, MAX_FACTOR]`` (a reference timed while something else
held the core would otherwise swing a prediction without end), and 1 when either time is
unknown. ``at_speed`` scales a profile's per-step times by it (each layer's step, the
head's, the call, the coordinator's step and the frames' work: all of them the node's CPU
work) and its prompt rate by its inverse; memory, the CPU quota and the links stay. Pure.
"""

from __future__ import annotations

import math
from dataclasses import replace

from controlplane.planner.profile import NodeProfile

MAX_FACTOR = 1.5  # the most a host is taken to have slowed (or sped up) since its profile


def speed_factor(profiled_s: float, now_s: float, bound: float = MAX_FACTOR) -> float:
    """How many times slower the host runs now than when profiled: ``now_s / profiled_s``
    within ``[1 / bound, bound]``; 1 when either time is 0 (not timed). ValueError on a
    negative or non-finite time or a bound under 1."""
    for name, value in (("profiled", profiled_s), ("current", now_s)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"a reference workload's {name} time must be >= 0 s, got {value!r}")
    if not bound >= 1:
        raise ValueError(f"a speed factor's bound must be >= 1, got {bound!r}")
    if profiled_s == 0 or now_s == 0:
        return 1.0
    return min(bound, max(1 / bound, now_s / profiled_s))


def at_speed(profile: NodeProfile, factor: float) -> NodeProfile:
    """``profile`` on a host ``factor`` times slower than when it was profiled (module
    docstring); the profile itself at 1. ValueError unless ``factor`` is positive."""
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"a speed factor must be positive, got {factor!r}")
    if factor == 1:
        return profile

    def scaled(values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(v * factor for v in values)

    return replace(profile, decode_s=scaled(profile.decode_s),
                   head_decode_s=scaled(profile.head_decode_s),
                   prefill_tokens_per_s=profile.prefill_tokens_per_s / factor,
                   call_s=profile.call_s * factor,
                   engine_decode_s=scaled(profile.engine_decode_s),
                   frame_decode_s=scaled(profile.frame_decode_s))
