"""The host's reference workload, and the check that times it again while a node runs.

A profile is cached (by shape, format, device and OpenVINO version) and used as long as
it matches, but the host it was measured on may run faster or slower later: a VM's host
busier or quieter, a laptop on battery. The reference workload is fixed whatever the
model: ``LAYERS`` MatMuls in a chain, ``ROWS`` rows by a ``SIZE`` x ``SIZE`` float32
weight each (48 MB in all, more than a desktop CPU's last-level cache: it streams from
memory as a stage's weights do, and multiplies as its rows do), compiled once on the CPU
with one inference thread (the speed of a core, whatever the node's threads), run
``WARMUP`` times untimed and ``RUNS`` times timed, the lower quartile counting (a run
another process pre-empted says nothing of the host's speed; on a loaded 2-vCPU VM the
median of one-MatMul runs spread 0.4-2.3 ms between profiles minutes apart): some 30 ms
in all. A running node times it now and then (``SpeedCheck``), and its profile keeps the
time it took when the profile was new (``ProfileSpeed``): the ratio is its speed factor
(controlplane/planner/speed.py), which the coordinator applies to the node's profile when
it plans and predicts.

A check is taken only when it can say something of the host rather than of the node's
own load, and counts as the median of the last ``KEPT``: at most every ``EVERY_S`` seconds
(``FIRST_EVERY_S`` until ``KEPT`` are in), when the process used less than
``IDLE_SHARE`` of a core since the last look (it serves no steps), when the machine's
other processes used less than ``MACHINE_IDLE_CORES`` of a core meanwhile (``/proc/stat``:
a local cluster's coordinator is serving while its nodes still compile and probe links,
and its checks then read its neighbours' load as a slower host: 1.12-1.50 in every case
of a quiet bench run, 2026-12-07, against 0.85-1.30 for the nodes), and holding this
machine's turn to profile (controlplane/profile_turn.py: no profile runs on the machine
meanwhile, neither the node's nor another process's).

The profile's own time is the median of the node's first ``KEPT`` checks once it holds
the profile, taken the same way in the same process as every later check, never the
profiling process's: timed there at the end of the profile, it read the host some 11%
faster than the nodes' checks did minutes later (48 of 60 stages' factors above 1, median
1.12, over four bench plan runs, 2026-12-07, AMD EPYC) while their stages ran at their
profiles' speed, and every factor carried that bias. A profile whose time is not known
yet (new, or written by ``zctl node profile``) is taken at the host's speed as it is
(factor 1) until its checks are in; the node then keeps the time with the profile
(``anchor``) and reports it.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from controlplane.profile_turn import HeldTurn, ProfilingTurn
from controlplane.records import ProfileRecord

log = logging.getLogger("zctl.controlplane")
ROWS, SIZE, LAYERS = 4, 2048, 3
WARMUP, RUNS = 2, 9
QUANTILE = 0.25  # of the runs' times
EVERY_S = 10.0  # the least time between two checks of a running node
KEPT = 3  # the checks whose median counts
FIRST_EVERY_S = 2.0  # the least time between the first KEPT checks
IDLE_SHARE = 0.10  # of a core: a process busier than this since the last look is serving
MACHINE_IDLE_CORES = 0.25  # the other processes' CPU, in cores, a check is taken beside
_compiled: Any = None


def _reference() -> Any:
    global _compiled
    if _compiled is None:
        import openvino as ov
        import openvino.opset13 as ops

        from dataplane.runtime.ov_core import shared_core

        x = ops.parameter([ROWS, SIZE], np.float32, name="x")
        rng = np.random.default_rng(0)
        y = x
        for _ in range(LAYERS):
            w = rng.random((SIZE, SIZE), np.float32) - np.float32(0.5)
            y = ops.matmul(y, ops.constant(w * np.float32(1 / SIZE)), False, False)
        model = ov.Model([y], [x], "zctl-reference")
        _compiled = shared_core().compile_model(model, "CPU", {
            "INFERENCE_NUM_THREADS": 1, "INFERENCE_PRECISION_HINT": "f32"})
    return _compiled


def machine_cpu_s() -> float:
    """CPU seconds every process of the machine has used since boot (``/proc/stat``: user,
    nice, system, irq, softirq and steal time over all CPUs); 0.0 where it cannot be read,
    so that the machine counts as idle."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return 0.0
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def reference_s(clock: Callable[[], float] = time.perf_counter) -> float:
    """The reference workload's time on this host now: the lower quartile of ``RUNS``
    runs."""
    request = _reference().create_infer_request()
    x = np.ones((ROWS, SIZE), np.float32)
    for _ in range(WARMUP):
        request.infer({0: x})
    times = []
    for _ in range(RUNS):
        start = clock()
        request.infer({0: x})
        times.append(clock() - start)
    return float(np.quantile(times, QUANTILE))


class SpeedCheck:
    """Times the reference workload again now and then, while the process is idle and no
    profile runs on the machine (module docstring); ``latest_s`` is the median of the last
    ``KEPT`` times taken (0: none yet), the first ``KEPT`` of them at least ``FIRST_EVERY_S``
    apart, the others ``every_s``: one check held up by another process's burst moves it
    little."""

    def __init__(self, every_s: float = EVERY_S, timer: Callable[[], float] = reference_s,
                 turn: Callable[[], HeldTurn | None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] = time.process_time,
                 machine_clock: Callable[[], float] = machine_cpu_s) -> None:
        self.every_s = every_s
        self.latest_s = 0.0
        self._kept: deque[float] = deque(maxlen=KEPT)
        self._timer = timer
        self._turn = turn or ProfilingTurn().try_take
        self._clock, self._cpu_clock, self._machine_clock = clock, cpu_clock, machine_clock
        self._looked = (clock(), cpu_clock(), machine_clock())
        self._checked = float("-inf")

    @property
    def kept(self) -> int:
        """How many checks ``latest_s`` is the median of (at most ``KEPT``)."""
        return len(self._kept)

    def restart(self) -> None:
        """Forget the checks taken: the next ``KEPT`` are taken ``FIRST_EVERY_S`` apart."""
        self._kept.clear()
        self.latest_s = 0.0

    def poll(self) -> float | None:
        """Take a check if one is due, the process and the machine's other processes have
        been idle since the last look and the machine's turn to profile is free; the new
        time, or None when none was taken."""
        now, cpu, machine = self._clock(), self._cpu_clock(), self._machine_clock()
        then, cpu_then, machine_then = self._looked
        if now - then <= 0:
            return None
        self._looked = (now, cpu, machine)
        own = cpu - cpu_then
        others = (machine - machine_then - own) / (now - then)
        idle = own / (now - then) < IDLE_SHARE and others < MACHINE_IDLE_CORES
        every = self.every_s if len(self._kept) >= KEPT else min(self.every_s, FIRST_EVERY_S)
        if not idle or now - self._checked < every:
            return None
        try:
            turn = self._turn()
        except OSError:
            return None
        if turn is None:
            return None
        with turn:
            try:
                self._kept.append(self._timer())
            except Exception:  # noqa: BLE001 - a check must never stop a node
                log.debug("the host's reference workload could not be timed", exc_info=True)
                return None
        self._checked = self._clock()
        # its own CPU is not the node's, nor the machine's load
        self._looked = (self._checked, self._cpu_clock(), self._machine_clock())
        self.latest_s = float(np.median(self._kept))
        return self.latest_s


NO_PROFILE, ANCHORING, CHECKING = "no profile", "anchoring", "checking"


class ProfileSpeed:
    """A node's host speed against the profile it holds (module docstring). Without a
    profile it takes no checks (``NO_PROFILE``). Given one whose reference time is not
    known (``reference_s`` 0) it is ``ANCHORING``: once the first ``KEPT`` checks are in,
    ``poll`` hands over the profile with their median as its time, once, kept by
    ``anchor`` (the profile store's), for the node to report; it is then ``CHECKING``, as
    with a profile that came with its time."""

    def __init__(self, anchor: Callable[[ProfileRecord, float], ProfileRecord],
                 check: SpeedCheck | None = None) -> None:
        self.check = check or SpeedCheck()
        self.state = NO_PROFILE
        self.profile: ProfileRecord | None = None
        self._anchor = anchor

    @property
    def latest_s(self) -> float:
        """The reference workload's time as last checked (0: not yet)."""
        return self.check.latest_s

    def hold(self, profile: ProfileRecord | None) -> ProfileRecord | None:
        """The profile the node holds now (None: none); returns it as the node should
        report it. The same profile again changes nothing, its checks go on; so does the
        same profile without the time this node anchored it at (its store could not keep
        the time), which is returned with that time."""
        if profile == self.profile:
            return profile
        if self.profile is not None and profile is not None and profile.reference_s == 0 \
                and replace(self.profile, reference_s=0.0) == profile:
            return self.profile  # the profile this node anchored, before or without its time
        self.profile = profile
        if profile is None:
            self.state = NO_PROFILE
        elif profile.reference_s > 0:
            self.state = CHECKING
        else:
            self.state = ANCHORING
            self.check.restart()  # its time is the next KEPT checks', not earlier ones
        return profile

    def poll(self) -> ProfileRecord | None:
        """Take a check if one is due (``SpeedCheck.poll``); the profile with its time once
        anchoring ends, else None."""
        if self.state == NO_PROFILE:
            return None
        self.check.poll()
        if self.state != ANCHORING or self.check.kept < KEPT:
            return None
        assert self.profile is not None
        self.profile = self._anchor(self.profile, self.check.latest_s)
        self.state = CHECKING
        log.info("the profile's reference workload takes %.3f ms on this host",
                 self.check.latest_s * 1e3)
        return self.profile
