"""The coordinator's membership rules as pure functions (enrolment admission, liveness)
and the background stage slot node 0 applies its wiring on."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest

from controlplane import membership as ms
from controlplane.launch import BackgroundStage, StageAssignment
from controlplane.messages import Enrol
from dataplane.runtime.config import RuntimeSpec

OV = "2026.4.1-20000-abc"
KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"


def enrol(**change: object) -> Enrol:
    fields = dict(node_id="node-1", host="10.0.0.2", data_addr="tcp://10.0.0.2:6000",
                  devices=[], ram_total=8 << 30, ram_free=4 << 30, openvino=OV, zctl="0.1.0")
    return Enrol(**{**fields, **change})  # type: ignore[arg-type]


def test_a_matching_node_is_admitted() -> None:
    assert ms.enrol_refusal(enrol(), b"node-1", "coord", OV, curve=False) is None
    assert ms.enrol_refusal(enrol(data_key=KEY), b"node-1", "coord", OV, curve=True) is None


@pytest.mark.parametrize(("msg", "identity", "curve", "code", "words"), [
    (enrol(), b"someone-else", False, "bad-enrol", "routing id must be the node id"),
    (enrol(node_id="coord"), b"coord", False, "duplicate-id", "coordinator's own id"),
    (enrol(openvino="2025.3.0-19000-def"), b"node-1", False, "openvino-version",
     "runs OpenVINO 2025.3.0 but the coordinator runs 2026.4.1"),
    (enrol(), b"node-1", True, "no-data-key", "encrypts its data pipes"),
])
def test_refusals_name_the_reason(msg: Enrol, identity: bytes, curve: bool, code: str,
                                  words: str) -> None:
    refusal = ms.enrol_refusal(msg, identity, "coord", OV, curve)
    assert refusal is not None
    assert refusal[0] == code and words in refusal[1]


def test_an_enrolment_left_on_a_replaced_connection_is_told_apart() -> None:
    """A node that reconnects to a coordinator slow to read takes its routing id over
    (ROUTER_HANDOVER); libzmq renames the old connection, whose queued enrolment then
    arrives under a zero byte and a counter: stale, not a node lying about its name."""
    assert ms.replaced_connection(b"\x00k\x8bEg")
    assert not ms.replaced_connection(b"node-1") and not ms.replaced_connection(b"")
    assert ms.enrol_refusal(enrol(), b"\x00k\x8bEg", "coord", OV, curve=False) is not None


def test_a_local_cluster_admits_the_nodes_started_for_it_only() -> None:
    assert ms.enrol_refusal(enrol(cluster_id="c1"), b"node-1", "coord", OV, False, "c1") is None
    assert ms.enrol_refusal(enrol(cluster_id="c1"), b"node-1", "coord", OV, False) is None
    for theirs, words in (("c0", "started for local cluster c0"), ("", "for no local cluster")):
        refusal = ms.enrol_refusal(enrol(cluster_id=theirs), b"node-1", "coord", OV, False, "c1")
        assert refusal is not None and refusal[0] == "other-cluster"
        assert words in refusal[1] and "serves local cluster c1" in refusal[1]


def test_same_release_other_build_names_the_full_builds() -> None:
    refusal = ms.enrol_refusal(enrol(openvino="2026.4.1-20001-xyz"), b"node-1", "coord", OV,
                               curve=False)
    assert refusal is not None and "2026.4.1-20001-xyz" in refusal[1] and OV in refusal[1]


def member(**change: object) -> ms.Member:
    m = ms.Member("node-1", b"node-1", enrol(), ms.SERVING, last_seen=100.0, last_sent=100.0)
    for name, value in change.items():
        setattr(m, name, value)
    return m


def test_liveness_marks_silent_nodes_dead_and_beats_quiet_ones() -> None:
    # interval 1 s, 3 beats of liveness
    assert ms.silence_verdict(member(), 102.9, 1.0, 3) is None
    assert "missed 3 heartbeats" in (ms.silence_verdict(member(), 103.1, 1.0, 3) or "")
    assert not ms.beat_due(member(), 100.5, 1.0)
    assert ms.beat_due(member(), 101.0, 1.0)
    assert not ms.beat_due(member(last_sent=102.9), 103.0, 1.0)
    # the coordinator's own record, and nodes already down, need nothing
    for quiet in (member(local=True), member(state=ms.DEAD), member(state=ms.LEFT)):
        assert ms.silence_verdict(quiet, 200.0, 1.0, 3) is None
        assert not ms.beat_due(quiet, 200.0, 1.0)


def heard_at(times: list[float], interval: float = 0.5) -> ms.Member:
    """A member whose traffic arrived at ``times`` (the first is its enrolment)."""
    m = member(last_seen=times[0])
    for t in times[1:]:
        m.heard(t, interval)
    return m


def test_a_flapping_link_is_dead_once_its_lapses_and_silence_add_up() -> None:
    # beats every 0.5 s, 5 of liveness (2.5 s); the link fails at 10.0
    healthy = [10.0 - 0.5 * i for i in range(8, -1, -1)]
    # a burst gets through at 12.06 after a 2.06 s lapse: the plain rule would wait to 14.56
    flapping = heard_at([*healthy, 12.06], interval=0.5)
    assert ms.silence_verdict(flapping, 12.06 + 0.6, 0.5, 5) is None  # not yet late
    verdict = ms.silence_verdict(flapping, 12.06 + 0.7, 0.5, 5)
    assert verdict is not None and "lapses of 2.1 s" in verdict
    # a shorter lapse needs a longer silence after it: 1.2 + 1.3 > 2.5
    short = heard_at([*healthy, 11.2], interval=0.5)
    assert ms.silence_verdict(short, 11.2 + 1.25, 0.5, 5) is None
    assert ms.silence_verdict(short, 11.2 + 1.35, 0.5, 5) is not None


def test_a_healthy_node_and_an_old_lapse_are_not_held_against_it() -> None:
    # healthy beats up to 0.625 s apart never lapse, however long it runs
    steady = heard_at([100.0 + 0.625 * i for i in range(200)])
    assert not steady.lapses
    assert ms.silence_verdict(steady, steady.last_seen + 2.4, 0.5, 5) is None
    # one lapse of 2 s, then healthy beats for 5 s: it is forgotten after 2 x 2.5 s
    once = heard_at([100.0, 102.0, *(102.0 + 0.5 * i for i in range(1, 12))])
    assert ms.silence_verdict(once, once.last_seen + 1.0, 0.5, 5) is None
    assert not once.lapses
    # within the window, the same silence after it is fatal
    recent = heard_at([100.0, 102.0, 102.5])
    assert ms.silence_verdict(recent, 102.5 + 1.0, 0.5, 5) is not None


class FakeHandle:
    def __init__(self) -> None:
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True

    def kv_slots(self) -> int:
        return -1  # holds no KV it could count


def test_background_stage_reports_each_epoch_in_order() -> None:
    gate = threading.Event()
    launched: list[FakeHandle] = []

    def launcher(assignment: StageAssignment) -> FakeHandle:
        gate.wait(5)
        if assignment.stage_index == 2:
            raise RuntimeError("cannot compile stage 2")
        launched.append(FakeHandle())
        return launched[-1]

    def assignment(stage: int) -> StageAssignment:
        return StageAssignment(Path("."), stage, 3, "tcp://127.0.0.1:*",
                               f"tcp://127.0.0.1:{7000 + stage}", RuntimeSpec(), stage, "0" * 64)

    stage = BackgroundStage(launcher, "test-stage")
    stage.submit(1, assignment(1))
    stage.submit(2, assignment(2))
    assert stage.finished() == [] and stage.handle is None  # still compiling
    gate.set()
    done: list[tuple[int, BaseException | None]] = []
    for _ in range(500):
        done += stage.finished()
        if len(done) == 2:
            break
        threading.Event().wait(0.01)
    assert [epoch for epoch, _ in done] == [1, 2]
    assert done[0][1] is None and isinstance(done[1][1], RuntimeError)
    # stage 1 ran, then was stopped to make way for stage 2, which failed to start
    assert len(launched) == 1 and launched[0].stopped and stage.handle is None
    stage.stop()
    assert stage.handle is None


def test_a_stage_slot_keeps_rewires_or_relaunches() -> None:
    """Same wiring and epoch: kept; a new epoch or only the next hop moved: a rewirable
    stage is rewired in place, any other stage relaunched; anything else moved: relaunched."""
    from controlplane.launch import StageSlot

    class Rewirable(FakeHandle):
        def __init__(self) -> None:
            super().__init__()
            self.rewired: list[tuple[str, str]] = []

        def rewire(self, send_to: str, peer_key: str = "") -> None:
            self.rewired.append((send_to, peer_key))

    def slot_with(kind: type) -> tuple[StageSlot, list]:
        launched: list = []

        def launch(assignment: StageAssignment):
            launched.append(kind())
            return launched[-1]
        return StageSlot(launch), launched

    first = StageAssignment(Path("/r"), 1, 3, "tcp://a:1", "tcp://b:1", RuntimeSpec(), 1, "h")
    moved = replace(first, epoch=2, send_to="tcp://c:1", peer_key="K")
    for kind, relaunches in ((Rewirable, 1), (FakeHandle, 3)):
        slot, launched = slot_with(kind)
        slot.apply(first)
        slot.apply(replace(first, epoch=1))  # the same assignment again: kept as it is
        assert len(launched) == 1 and not launched[0].stopped
        # same wiring, a new epoch: the next hop may be a new socket at the same address,
        # so the outbound pipe connects afresh (rewired in place, or the stage relaunched)
        slot.apply(replace(first, epoch=5))
        slot.apply(moved)
        assert len(launched) == relaunches
        if kind is Rewirable:
            assert launched[0].rewired == [("tcp://b:1", ""), ("tcp://c:1", "K")]
            assert not launched[0].stopped
        else:
            assert launched[0].stopped and launched[1].stopped and not launched[2].stopped
        slot.apply(replace(moved, epoch=3, bind="tcp://a:2"))  # its own pipe moved: relaunch
        assert len(launched) == relaunches + 1 and launched[-2].stopped


def test_a_member_s_speed_factor_is_its_reference_now_over_its_profile_s() -> None:
    from controlplane.planner.presets import PRESETS
    from controlplane.planner.profile import GRAPH_VERSION
    from controlplane.records import ProfileRecord

    record = ProfileRecord(PRESETS["smollm2-135m"].fingerprint(), "int4", "CPU", "ov",
                           [2e-4] * 4, [1e-3] * 4, 2e4, 1e-4, 2 << 20, 9 << 30,
                           graph=GRAPH_VERSION, engine_decode_s=[1e-4] * 4, reference_s=0.004)
    m = ms.Member("node-1", b"node-1", enrol(), ms.SERVING, last_seen=100.0)
    assert m.speed_factor == 1.0  # no profile
    m.profile = record
    assert m.speed_factor == 1.0  # not timed again yet
    m.reference_s = 0.005
    assert m.speed_factor == pytest.approx(1.25)
    assert m.status(100.0).speed_factor == pytest.approx(1.25)
