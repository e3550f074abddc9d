"""zctl doctor's verdicts (zctl.doctor.verdicts): pure functions from gathered facts to
pass, warn or fail, with the reason."""

from __future__ import annotations

from controlplane.records import RefusalInfo
from tests.helpers.doctor import OV, GiB, cluster, node
from zctl.discovery.interfaces import Interface
from zctl.discovery.records import Announcement
from zctl.doctor import verdicts as dx
from zctl.doctor.verdicts import (
    FAIL,
    PASS,
    WARN,
    Check,
    MemoryNeed,
    MulticastFacts,
    TcpFacts,
    clusters_check,
    endpoint_checks,
    multicast_check,
    node_id_check,
    same_name_check,
)


def test_clock_offset_thresholds_and_the_estimate() -> None:
    ok = dx.clock_check(100.0, 100.101, 100.2)  # midpoint 100.1: coordinator 1 ms ahead
    assert ok.status == PASS and "ahead by 1.0 ms +- 100.0 ms (round trip 200.0 ms)" in ok.detail
    assert dx.clock_check(100.0, 99.0, 100.0).status == WARN  # 1 s behind
    assert "behind by 1000.0 ms" in dx.clock_check(100.0, 99.0, 100.0).detail
    assert dx.clock_check(100.0, 100.4, 100.0).status == PASS
    assert dx.clock_check(100.0, 140.0, 100.0).status == FAIL
    assert dx.clock_check(100.0, 60.0, 100.0).status == FAIL
    assert dx.clock_check(100.0, 101.0, 100.0, warn_s=2.0).status == PASS
    assert dx.clock_check(100.0, 0.0, 100.0).status == WARN  # an older coordinator: no clock


def test_a_node_with_other_versions_fails_and_this_machine_differing_warns() -> None:
    status = cluster([node("coord", 0), node("n1", 1, zctl="0.2.0"), node("n2", None)])
    checks = {c.name: c for c in dx.version_checks(status, OV, "0.1.0", 1)}
    assert checks["versions coordinator"].status == PASS
    assert checks["versions n1"].status == FAIL
    assert "zctl 0.2.0" in checks["versions n1"].detail
    assert "coordinator OpenVINO" in checks["versions n1"].detail
    assert checks["versions nodes"].status == PASS and "1 of 2" in checks["versions nodes"].detail
    here = {c.name: c for c in dx.version_checks(status, "2025.0.0", "0.1.0", 1)}
    assert here["versions coordinator"].status == WARN
    assert "could not join" in here["versions coordinator"].detail


def test_refusals_fail_for_versions_warn_otherwise_and_drop_once_enrolled() -> None:
    refused = [RefusalInfo("old", "10.0.0.9", "runs OpenVINO 2025.0", 4.0, "openvino-version"),
               RefusalInfo("dup", "10.0.0.8", "duplicate id", 3.0, "duplicate-id"),
               RefusalInfo("n1", "10.0.0.2", "runs OpenVINO 2025.0", 9.0, "openvino-version")]
    status = cluster([node("coord", 0), node("n1", 1)], refused=refused)
    checks = {c.name: c for c in dx.refusal_checks(status)}
    assert set(checks) == {"refused old", "refused dup"}  # n1 enrolled since
    assert checks["refused old"].status == FAIL and "openvino-version" in checks["refused old"].detail
    assert checks["refused dup"].status == WARN


def test_memory_fits_is_tight_or_does_not_fit() -> None:
    need = [MemoryNeed("stage 1", 2 * GiB)]
    assert dx.memory_check(8 * GiB, 16 * GiB, need).status == PASS
    assert dx.memory_check(int(2.2 * GiB), 16 * GiB, need).status == WARN
    failed = dx.memory_check(1 * GiB, 16 * GiB, need)
    assert failed.status == FAIL and "does not fit" in failed.detail
    # a stage served here already holds its weights: only the rest must still fit
    held = dx.memory_check(1 * GiB, 16 * GiB, [MemoryNeed("stage 1", 2 * GiB, int(1.8 * GiB))])
    assert held.status == PASS and "still to load" in held.detail
    assert dx.memory_check(1 * GiB, 2 * GiB, []).status == PASS


def test_cpu_features_name_the_int8_kernels() -> None:
    amx = dx.cpu_features_check({"avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"})
    assert amx.status == PASS and "AMX kernels" in amx.detail and "not guaranteed" in amx.detail
    assert "AVX-512-VNNI" in dx.cpu_features_check({"avx2", "avx512f", "avx512_vnni"}).detail
    plain = dx.cpu_features_check({"avx2", "fma"})
    assert plain.status == PASS and "no VNNI" in plain.detail
    assert dx.cpu_features_check({"sse4_2"}).status == WARN
    assert dx.cpu_features_check(None).status == WARN
    assert "bf16" in dx.cpu_features_check({"avx2"}, ("FP32", "BF16")).detail


def test_api_verdicts() -> None:
    url = "http://127.0.0.1:8000"
    assert dx.api_check(url, dx.HttpFacts(200, '{"ok": true}'), False).status == PASS
    assert dx.api_check(url, dx.HttpFacts(503, "stage 1 down"), False).status == WARN
    assert dx.api_check(url, dx.HttpFacts(500, "boom"), False).status == FAIL
    nothing = dx.HttpFacts(error="Connection refused", refused=True)
    assert dx.api_check(url, nothing, False) == Check(
        "api", WARN, "no API server at http://127.0.0.1:8000 (zctl serve starts one)")
    assert dx.api_check(url, nothing, True).status == FAIL


def test_pipeline_heartbeats_and_data_pipes_from_the_coordinators_record() -> None:
    status = cluster([node("coord", 0, host="10.0.0.1", data_addr="tcp://10.0.0.1:5000"),
                      node("n1", 1, state="dead", last_seen_s=4.0)], pipeline="degraded")
    assert dx.pipeline_check(status).status == FAIL
    assert "stage 1 (layers 17-29) on n1 is dead" in dx.pipeline_check(status).detail
    (beat,) = dx.heartbeat_checks(status)
    assert beat.status == FAIL and "last heard 4.0 s ago" in beat.detail
    assert "last sent 0.2 s ago" in beat.detail
    connects = {"tcp://10.0.0.1:5000": TcpFacts(True, 0.3),
                "tcp://10.0.0.2:5001": TcpFacts(False, error="Connection refused")}
    pipes = dx.data_pipe_checks(status, connects, on_coordinator=True)
    assert [c.status for c in pipes] == [PASS, FAIL]
    assert "stage 1 -> 0 at tcp://10.0.0.1:5000" in pipes[0].detail
    alive = cluster([node("coord", 0, data_addr="tcp://10.0.0.1:5000"), node("n1", 1)])
    assert dx.pipeline_check(alive).status == PASS
    assert [c.status for c in dx.heartbeat_checks(alive)] == [PASS]
    late = cluster([node("coord", 0), node("n1", 1, last_seen_s=2.5)])
    assert [c.status for c in dx.heartbeat_checks(late)] == [WARN]
    # serving, but nothing accepts a connection: fails on the coordinator, warns elsewhere
    assert [c.status for c in dx.data_pipe_checks(alive, connects, True)] == [PASS, FAIL]
    assert [c.status for c in dx.data_pipe_checks(alive, connects, False)] == [PASS, WARN]
    waiting = cluster([node("coord", 0), node("n1", 1, state="transferring")], "transferring")
    assert dx.pipeline_check(waiting).status == WARN
    assert dx.pipeline_check(cluster([node("coord", 0), node("n1", None, state="idle")], "waiting",
                                     plan_error="stage 1 needs 9 GiB")).status == FAIL


# -- LAN discovery ----------------------------------------------------------------------
ETH = Interface("eth0", "10.0.0.5", 24)
LAB = Announcement("lab", "tcp://10.0.0.1:5550", 9, "2026.4.1", "pc1-aa")
TWIN = Announcement("lab", "tcp://10.0.0.2:5550", 9, "2026.4.1", "pc2-bb")


def test_multicast_that_does_not_loop_back_fails_naming_the_fallback():
    assert multicast_check([MulticastFacts(ETH, True)]).status == PASS
    bad = multicast_check([MulticastFacts(ETH, False, "its own query did not come back")])
    assert bad.status == FAIL and "eth0 10.0.0.5: its own query did not come back" in bad.detail
    assert "zctl node join tcp://HOST:PORT" in bad.detail
    busy = multicast_check([MulticastFacts(ETH, False, "Address already in use", tested=False)])
    assert busy.status == WARN and "could not test multicast DNS (eth0" in busy.detail
    none = multicast_check([])
    assert none.status == WARN and "no LAN interface" in none.detail


def test_clusters_names_endpoints():
    assert clusters_check([LAB], {}).status == PASS
    empty = clusters_check([], {"x._zctl._tcp.local.": "forged"})
    assert empty.status == WARN and "refused 1: x: forged" in empty.detail
    assert "zctl node join tcp://HOST:PORT" in empty.detail
    assert same_name_check([LAB]).status == PASS
    twins = same_name_check([LAB, TWIN])
    assert twins.status == FAIL and "lab at tcp://10.0.0.1:5550, tcp://10.0.0.2:5550" in twins.detail
    ok, down = endpoint_checks([LAB, TWIN], {LAB.control: "", TWIN.control: "connection refused"})
    assert ok.status == PASS and down.status == FAIL and "connection refused" in down.detail


def test_a_node_id_used_by_another_machine_fails():
    assert node_id_check([], ["10.0.0.5"], [LAB]).status == PASS
    assert node_id_check(["pc1-aa"], ["10.0.0.1"], [LAB]).status == PASS  # that is us
    clash = node_id_check(["pc1-aa"], ["10.0.0.5"], [LAB])
    assert clash.status == FAIL and "pc1-aa (the coordinator of lab at 10.0.0.1)" in clash.detail
    member = node_id_check(["n3"], ["10.0.0.5"], [], [("n3", "10.0.0.7"), ("n4", "10.0.0.8")])
    assert member.status == FAIL and "n3 (a node at 10.0.0.7)" in member.detail
