"""The host's reference workload and the check that times it again while a node runs: only
when due, while the process and the machine's other processes are idle and the machine's
turn to profile is free."""

from __future__ import annotations

import time
from pathlib import Path

from controlplane.host_speed import (
    IDLE_SHARE,
    MACHINE_IDLE_CORES,
    SpeedCheck,
    machine_cpu_s,
    reference_s,
)
from controlplane.profile_turn import HeldTurn, ProfilingTurn


class Clocks:
    """A wall clock, the process's CPU clock and the machine's, which the test moves."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0
        self.machine = 0.0

    def advance(self, wall: float, cpu: float = 0.0, others: float = 0.0) -> None:
        """``wall`` seconds pass, the process uses ``cpu`` seconds of CPU and the machine's
        other processes ``others``."""
        self.wall += wall
        self.cpu += cpu
        self.machine += cpu + others


def _check(clocks: Clocks, turn: HeldTurn | None | str = "free",
           timings: list[float] | None = None) -> SpeedCheck:
    times = iter(timings or [0.004, 0.005, 0.006])

    def take() -> HeldTurn | None:
        return None if turn is None else _FreeTurn()

    return SpeedCheck(every_s=10.0, timer=lambda: next(times), turn=take,
                      clock=lambda: clocks.wall, cpu_clock=lambda: clocks.cpu,
                      machine_clock=lambda: clocks.machine)


class _FreeTurn(HeldTurn):
    def __init__(self) -> None:  # noqa: D107 - no lock file: the test's turn
        pass

    def release(self) -> None:
        pass


def test_an_idle_process_is_checked_at_once_then_once_every_period() -> None:
    clocks = Clocks()
    check = _check(clocks, timings=[0.004, 0.010, 0.005, 0.006, 0.007])
    clocks.advance(1.0, 0.01)
    assert check.poll() == 0.004 and check.latest_s == 0.004
    clocks.advance(1.0, 0.01)
    assert check.poll() is None  # the first ones FIRST_EVERY_S apart
    clocks.advance(1.5, 0.01)
    assert check.poll() == 0.007  # the median of 4 and a burst's 10 ms
    clocks.advance(2.5, 0.01)
    assert check.poll() == 0.005  # of 4, 10 and 5 ms: the burst moves it little
    clocks.advance(5.0, 0.01)
    assert check.poll() is None  # KEPT are in: every_s apart now
    clocks.advance(6.0, 0.01)
    assert check.poll() == 0.006 and check.latest_s == 0.006  # of 10, 5 and 6 ms


def test_a_busy_process_is_not_checked_its_own_load_would_read_as_a_slow_host() -> None:
    clocks = Clocks()
    check = _check(clocks)
    clocks.advance(1.0, 2 * IDLE_SHARE)  # it served steps since the last look
    assert check.poll() is None and check.latest_s == 0.0
    clocks.advance(1.0, 0.0)  # idle again
    assert check.poll() == 0.004


def test_no_check_while_other_processes_load_the_machine() -> None:
    """A coordinator serving while its nodes still compile: their load is not the host's."""
    clocks = Clocks()
    check = _check(clocks)
    clocks.advance(1.0, 0.0, 2 * MACHINE_IDLE_CORES)
    assert check.poll() is None and check.latest_s == 0.0
    clocks.advance(1.0, 0.05, 0.5 * MACHINE_IDLE_CORES)  # quiet again (its own CPU aside)
    assert check.poll() == 0.004


def test_the_machine_s_cpu_time_grows() -> None:
    first = machine_cpu_s()
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    # /proc/stat counts in clock ticks (10 ms): a tick may be lost at either end
    assert machine_cpu_s() - first >= 0.05 - 2 * 0.01 - 1e-9


def test_no_check_while_a_profile_holds_the_machine_s_turn() -> None:
    clocks = Clocks()
    check = _check(clocks, turn=None)
    clocks.advance(20.0)
    assert check.poll() is None and check.latest_s == 0.0


def test_a_failing_timer_leaves_the_last_time_and_the_node_running() -> None:
    clocks = Clocks()

    def broken() -> float:
        raise RuntimeError("no CPU plugin")

    check = SpeedCheck(timer=broken, turn=lambda: _FreeTurn(), clock=lambda: clocks.wall,
                       cpu_clock=lambda: clocks.cpu, machine_clock=lambda: clocks.machine)
    clocks.advance(20.0)
    assert check.poll() is None and check.latest_s == 0.0


def test_the_real_reference_is_timed_in_the_machine_s_turn(tmp_path: Path) -> None:
    turn = ProfilingTurn(tmp_path / "profile.lock")
    # the machine read as quiet: the test's neighbours (a CI's other worker) are not its
    check = SpeedCheck(every_s=0.0, turn=turn.try_take, machine_clock=lambda: 0.0)
    time.sleep(0.3)  # the process idle since the check began to look
    first = check.poll()
    assert first is not None and 0 < first < 1.0 and reference_s() > 0
    held = turn.try_take()  # a profile takes the turn: no check meanwhile
    assert held is not None
    try:
        time.sleep(0.3)
        assert check.poll() is None and check.latest_s == first
    finally:
        held.release()
