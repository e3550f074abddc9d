"""The host's reference workload and the check that times it again while a node runs: only
when due, while the process and the machine's other processes are idle and the machine's
turn to profile is free; a new profile's own time is its node's first checks'."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from controlplane.host_speed import (
    ANCHORING,
    CHECKING,
    IDLE_SHARE,
    KEPT,
    MACHINE_IDLE_CORES,
    NO_PROFILE,
    ProfileSpeed,
    SpeedCheck,
    machine_cpu_s,
    reference_s,
)
from controlplane.planner.profile import GRAPH_VERSION
from controlplane.profile_store import ProfileStore
from controlplane.profile_turn import HeldTurn, ProfilingTurn
from controlplane.records import ProfileRecord
from tests.helpers.control import seed_profile


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


def _profile(reference: float = 0.0, measured_at: float = 1.0) -> ProfileRecord:
    return ProfileRecord("shape", "int4", "CPU", "2026.4.1", [1e-4] * 4, [1e-3] * 4, 1e4, 1e-4,
                         1 << 20, 1 << 30, measured_at=measured_at, graph=GRAPH_VERSION,
                         engine_decode_s=[1e-4] * 4, reference_s=reference)


class _Anchors:
    """The profile store's ``anchor``, recording what it was given."""

    def __init__(self) -> None:
        self.given: list[tuple[ProfileRecord, float]] = []

    def __call__(self, record: ProfileRecord, reference: float) -> ProfileRecord:
        self.given.append((record, reference))
        return replace(record, reference_s=reference)


def _speed(clocks: Clocks, timings: list[float]) -> tuple[ProfileSpeed, _Anchors]:
    anchors = _Anchors()
    return ProfileSpeed(anchors, _check(clocks, timings=timings)), anchors


def _polls(speed: ProfileSpeed, clocks: Clocks, n: int) -> list[ProfileRecord | None]:
    out = []
    for _ in range(n):
        clocks.advance(20.0, 0.01)  # idle, and every check due
        out.append(speed.poll())
    return out


def test_without_a_profile_no_check_is_taken() -> None:
    clocks = Clocks()
    speed, anchors = _speed(clocks, [])  # a timer that would fail if it were called
    assert _polls(speed, clocks, 3) == [None] * 3
    assert speed.state == NO_PROFILE and speed.latest_s == 0.0 and not anchors.given


def test_a_new_profile_s_time_is_its_node_s_first_checks() -> None:
    """Timed in the profiling process the reference read the host faster than the node's
    checks did: its time is the node's own first checks', and the factor starts at 1."""
    clocks = Clocks()
    speed, anchors = _speed(clocks, [0.005, 0.009, 0.006, 0.008, 0.012, 0.012])
    new = _profile()
    speed.hold(new)
    assert speed.state == ANCHORING
    first = _polls(speed, clocks, KEPT)
    assert first[:-1] == [None] * (KEPT - 1)
    assert first[-1] == replace(new, reference_s=0.006)  # the median of 5, 9 and 6 ms
    assert anchors.given == [(new, 0.006)] and speed.state == CHECKING
    assert speed.latest_s == 0.006  # a factor of 1 until later checks move it
    assert _polls(speed, clocks, 3) == [None] * 3  # handed over once
    assert speed.latest_s == 0.012 and len(anchors.given) == 1


def test_a_profile_that_comes_with_its_time_is_checked_against_it() -> None:
    clocks = Clocks()
    speed, anchors = _speed(clocks, [0.004, 0.005, 0.006])
    speed.hold(_profile(reference=0.004))
    assert speed.state == CHECKING
    assert _polls(speed, clocks, 3) == [None] * 3
    assert speed.latest_s == 0.005 and not anchors.given


def test_a_profile_measured_again_is_anchored_on_checks_after_it() -> None:
    clocks = Clocks()
    speed, anchors = _speed(clocks, [0.004, 0.004, 0.004, 0.010, 0.011, 0.012])
    speed.hold(_profile(reference=0.004))
    _polls(speed, clocks, 3)
    again = _profile(measured_at=2.0)  # a new quota, say: measured again
    speed.hold(again)
    assert speed.state == ANCHORING and speed.latest_s == 0.0  # the old checks forgotten
    assert _polls(speed, clocks, 3)[-1] == replace(again, reference_s=0.011)
    assert anchors.given == [(again, 0.011)]


def test_the_same_profile_held_again_goes_on_with_its_checks() -> None:
    """Asked for its profile again, a node answers with the same one: nothing restarts."""
    clocks = Clocks()
    speed, _ = _speed(clocks, [0.005, 0.006, 0.007])
    new = _profile()
    speed.hold(new)
    _polls(speed, clocks, KEPT - 1)
    speed.hold(new)
    assert _polls(speed, clocks, 1) == [replace(new, reference_s=0.006)]
    # as the store still holds it when it could not keep the time: still checking, and
    # reported with the time
    assert speed.hold(new) == replace(new, reference_s=0.006)
    assert speed.state == CHECKING and speed.profile == replace(new, reference_s=0.006)
    speed.hold(None)
    assert speed.state == NO_PROFILE and speed.poll() is None


def test_the_store_keeps_the_anchor_with_the_profile_it_was_taken_for(tmp_path: Path) -> None:
    from controlplane.planner.presets import PRESETS

    shape = PRESETS["smollm2-135m"]
    seed_profile(tmp_path, shape, "int4")
    store = ProfileStore(tmp_path)
    record, _ = store.load(shape, "int4", "CPU")
    assert record is not None and record.reference_s == 0
    anchored = store.anchor(record, 0.006)
    assert anchored == replace(record, reference_s=0.006)
    assert store.load(shape, "int4", "CPU")[0] == anchored  # kept in its file
    # a file that holds another measurement by now is left alone
    assert store.anchor(record, 0.009) == replace(record, reference_s=0.009)
    assert store.load(shape, "int4", "CPU")[0] == anchored


def test_an_anchor_that_cannot_be_written_leaves_the_node_its_time(tmp_path: Path) -> None:
    from controlplane.planner.presets import PRESETS

    shape = PRESETS["smollm2-135m"]
    seed_profile(tmp_path, shape, "int4")
    store = ProfileStore(tmp_path)
    record, path = store.load(shape, "int4", "CPU")[0], store.path(shape, "int4", "CPU")
    assert record is not None
    path.unlink()  # removed meanwhile
    assert store.anchor(record, 0.006).reference_s == 0.006 and not path.exists()
    path.write_text("{not json")  # damaged
    assert store.anchor(record, 0.006).reference_s == 0.006
    assert path.read_text() == "{not json"


def test_a_profile_whose_reference_the_profiling_process_timed_is_anchored_again(
        tmp_path: Path) -> None:
    """zctl-node-profile/2 timed the reference in the profiling process, biased: read
    without it, the node's checks give it again, and the file is the current format."""
    import json

    from controlplane.planner.measured import PROFILE_FORMAT
    from controlplane.planner.presets import PRESETS

    shape = PRESETS["smollm2-135m"]
    seed_profile(tmp_path, shape, "int4")
    store = ProfileStore(tmp_path)
    path = store.path(shape, "int4", "CPU")
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "format": "zctl-node-profile/2", "reference_s": 0.004}))
    record, _ = store.load(shape, "int4", "CPU")
    assert record is not None and record.reference_s == 0  # its old time dropped
    speed = ProfileSpeed(store.anchor, _check(Clocks(), timings=[0.006]))
    speed.hold(record)
    assert speed.state == ANCHORING
    store.anchor(record, 0.006)
    assert json.loads(path.read_text())["format"] == PROFILE_FORMAT
    assert store.load(shape, "int4", "CPU")[0] == replace(record, reference_s=0.006)
