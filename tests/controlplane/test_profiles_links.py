"""The coordinator asks each node for its profile of the served model and probes the
pipeline's links once it serves; both show in the status, and neither holds anything up."""

from __future__ import annotations

import time

import pytest
import zmq

from controlplane import messages as m
from controlplane import records as r
from controlplane.host_speed import KEPT, SpeedCheck
from controlplane.links import LinkTable, chain_links, probe_sizes
from controlplane.nodeinfo import openvino_version
from controlplane.planner.export_shape import export_shape
from controlplane.planner.profile import GRAPH_VERSION, LinkProfile
from controlplane.planner.shape import ModelShape
from controlplane.profile_store import NOT_PROFILED, ProfileStore
from controlplane.profile_turn import ProfilingTurn
from tests.helpers.control import Cluster, RawNode, enrol_msg, node, seed_profile, wait_for
from zctl.manifest import load_manifest


def _state(coord, node_id: str) -> str:
    """A node's profile state, "" until it enrolled."""
    found = [n for n in coord.status().nodes if n.node_id == node_id]
    return found[0].profile_state if found else ""


def test_the_coordinator_reads_the_export_s_shape(cp_cluster) -> None:
    coord = cp_cluster.coordinator()
    shape = coord.status().shape
    assert shape is not None and (shape.hidden, shape.intermediate, shape.num_layers) == (64, 128, 4)


def test_a_node_s_kept_profile_shows_in_the_status(cp_cluster) -> None:
    coord = cp_cluster.coordinator()
    shape = coord.shape
    seed_profile(cp_cluster.root / "n1", shape)
    agent = cp_cluster.agent(coord.endpoint)
    wait_for(lambda: _state(coord, agent.node_id) == "kept", what="profile")
    status = node(coord.status(), agent.node_id)
    assert status.profile_state == "kept" and status.profile.shape == shape.fingerprint()
    assert status.profile.decode_s[0] == pytest.approx(3e-4 / 3)
    me = node(coord.status(), coord.node_id)
    assert me.profile is None and me.profile_state == NOT_PROFILED  # told not to measure


def test_a_node_without_a_profile_or_with_a_stale_one_says_so(cp_cluster) -> None:
    coord = cp_cluster.coordinator()
    seed_profile(cp_cluster.root / "n2", coord.shape, openvino="2020.1.0")
    fresh = cp_cluster.agent(coord.endpoint, name="n1")
    stale = cp_cluster.agent(coord.endpoint, name="n2")
    wait_for(lambda: _state(coord, fresh.node_id) and "stale" in _state(coord, stale.node_id),
             what="both nodes' states")
    assert node(coord.status(), fresh.node_id).profile_state == NOT_PROFILED
    state = node(coord.status(), stale.node_id).profile_state
    assert state.startswith(NOT_PROFILED) and "OpenVINO '2020.1.0'" in state


def test_a_profile_for_something_else_is_refused_and_the_node_stays(cp_cluster) -> None:
    coord = cp_cluster.coordinator()
    raw = RawNode(coord.endpoint, b"raw-1")
    try:
        raw.send(*m.to_frames(enrol_msg("raw-1")))
        raw.recv_until(m.ProfileRequest)
        record = m.ProfileReport("measured", _record(coord.shape, "int8"))
        raw.send(*m.to_frames(record))
        wait_for(lambda: _state(coord, "raw-1").startswith("failed"), what="refusal")
        status = node(coord.status(), "raw-1")
        assert status.profile is None and "weights 'int8', not 'fp32'" in status.profile_state
        assert status.state not in ("dead", "left", "failed")
    finally:
        raw.close()


def test_a_node_s_speed_now_against_its_profile_s_shows_in_the_status(cp_cluster) -> None:
    # its heartbeat carries its reference workload's time now; its profile's was 4 ms
    from dataclasses import replace

    coord = cp_cluster.coordinator()
    raw = RawNode(coord.endpoint, b"raw-1")
    try:
        raw.send(*m.to_frames(enrol_msg("raw-1")))
        raw.recv_until(m.ProfileRequest)
        record = replace(_record(coord.shape, "fp32"), reference_s=0.004)
        raw.send(*m.to_frames(m.ProfileReport("measured", record)))
        wait_for(lambda: _state(coord, "raw-1") == "measured", what="profile")
        assert node(coord.status(), "raw-1").speed_factor == 1.0  # not timed again yet
        raw.send(*m.to_frames(m.Heartbeat("enrolled", -1, 0.006)))
        wait_for(lambda: node(coord.status(), "raw-1").reference_s == 0.006, what="heartbeat")
        assert node(coord.status(), "raw-1").speed_factor == pytest.approx(1.5)
    finally:
        raw.close()


def test_a_node_s_first_checks_become_its_new_profile_s_reference_time(cp_cluster,
                                                                      tmp_path) -> None:
    """A profile zctl node profile left (its reference not timed) is taken at the host's
    speed as it is; the node's first checks' median becomes its time, kept with it and
    reported, and later checks move the factor from there."""
    coord = cp_cluster.coordinator()
    seed_profile(cp_cluster.root / "n1", coord.shape)
    agent = cp_cluster.agent(coord.endpoint, speed_check=_fast_check(tmp_path))

    def reference() -> float:
        found = [n.profile for n in coord.status().nodes if n.node_id == agent.node_id]
        return found[0].reference_s if found and found[0] else -1.0

    wait_for(lambda: reference() == 0.005, timeout=10, what="the profile with its time")
    kept, _ = ProfileStore(cp_cluster.root / "n1").load(coord.shape, "fp32", "CPU")
    assert kept is not None and kept.reference_s == 0.005
    assert node(coord.status(), agent.node_id).profile_state == "kept"
    wait_for(lambda: node(coord.status(), agent.node_id).speed_factor == pytest.approx(1.5),
             timeout=10, what="the later checks' factor")


def test_the_coordinator_s_own_profile_is_anchored_on_its_first_checks(cp_cluster,
                                                                      tmp_path) -> None:
    manifest = load_manifest(cp_cluster.export)
    seed_profile(cp_cluster.root / "coord", export_shape(manifest, cp_cluster.export))
    coord = cp_cluster.coordinator(speed_check=_fast_check(tmp_path))

    def mine() -> r.NodeStatus:
        return node(coord.status(), coord.node_id)

    wait_for(lambda: mine().profile is not None and mine().profile.reference_s == 0.005,
             timeout=10, what="its profile with its time")
    kept, _ = ProfileStore(cp_cluster.root / "coord").load(coord.shape, "fp32", "CPU")
    assert kept is not None and kept.reference_s == 0.005
    wait_for(lambda: mine().speed_factor == pytest.approx(1.5), timeout=10,
             what="the later checks' factor")


def _fast_check(tmp_path) -> SpeedCheck:
    """A check of an idle process on a machine whose reference takes 5 ms for the first
    KEPT checks and 7.5 ms after them, taken 20 times as often as the real one."""
    times = iter([0.005] * KEPT)
    return SpeedCheck(timer=lambda: next(times, 0.0075),
                      turn=ProfilingTurn(tmp_path / "profile.lock").try_take,
                      clock=lambda: 20 * time.monotonic(),
                      cpu_clock=lambda: 0.0, machine_clock=lambda: 0.0)


def _record(shape: ModelShape, weights: str):
    from controlplane.records import ProfileRecord

    return ProfileRecord(shape.fingerprint(), weights, "CPU", openvino_version(), [1e-4] * 4,
                         [1e-3] * 4, 1e4, 1e-4, 1 << 20, 1 << 30, graph=GRAPH_VERSION,
                         engine_decode_s=[1e-4] * 4)


def test_the_links_of_a_serving_pipeline_are_probed_both_ways(cp_cluster) -> None:
    coord = cp_cluster.coordinator(expect_nodes=1)
    agent = cp_cluster.agent(coord.endpoint)
    coord.wait_serving(10)
    wait_for(lambda: len([s for s in coord.status().links if s.measured_at]) == 2,
             timeout=20, what="both links measured")
    links = {(s.a, s.b): s for s in coord.status().links}
    assert set(links) == {(coord.node_id, agent.node_id), (agent.node_id, coord.node_id)}
    for link in links.values():
        assert link.error == "" and link.rtt_s > 0 and link.forward_bps > 0
        assert link.frame_bytes == probe_sizes(coord.shape)
    assert coord.status().pipeline == "serving"


def test_a_node_that_never_answers_its_probe_leaves_its_link_with_an_error(cp_cluster) -> None:
    coord = cp_cluster.coordinator(expect_nodes=1)
    coord.links = LinkTable(rounds=1, timeout_s=0.3, grace_s=0.5)
    raw = RawNode(coord.endpoint, b"raw-1")
    try:  # it enrols with a probe endpoint nobody answers at, and ignores every request
        raw.send(*m.to_frames(enrol_msg("raw-1", probe_addr="tcp://127.0.0.1:9")))
        offer = raw.recv_until(m.ShardOffer)
        raw.send(*m.to_frames(m.ShardDone(offer.shard_hash, True, cached=True)))
        assign = raw.recv_until(m.AssignStage)
        raw.send(*m.to_frames(m.StageReady(assign.epoch, assign.stage.index, True)))
        raw.recv_until(m.LinkProbe, timeout=10)

        def failed() -> bool:  # beating, so as to stay alive, but never answering probes
            raw.send(*m.to_frames(m.Heartbeat("serving")))
            links = coord.status().links
            return len(links) == 2 and all(s.error and s.error != "probing" for s in links)

        wait_for(failed, timeout=20, what="both links failed")
        errors = {(s.a, s.b): s.error for s in coord.status().links}
        assert "not answered within 0.3 s" in errors[(coord.node_id, "raw-1")]
        assert "did not report its probe" in errors[("raw-1", coord.node_id)]
        assert coord.status().pipeline == "serving"
    finally:
        raw.close()


def test_a_probe_of_a_peer_that_never_answers_does_not_hold_the_node_s_stop(tmp_path) -> None:
    """The node is told to probe a peer that takes the probe's frames and never answers;
    stopping it while the probe waits out its timeout returns well within that timeout."""
    timeout_s = 4.0
    ctx = zmq.Context()
    coordinator, silent = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    cluster = Cluster(tmp_path, tmp_path / "no-export")
    try:
        endpoint = f"tcp://127.0.0.1:{coordinator.bind_to_random_port('tcp://127.0.0.1')}"
        peer = f"tcp://127.0.0.1:{silent.bind_to_random_port('tcp://127.0.0.1')}"
        agent = cluster.agent(endpoint)
        assert coordinator.poll(5000), "the node did not enrol"
        identity = coordinator.recv_multipart()[0]
        coordinator.send_multipart([identity, *m.to_frames(
            m.LinkProbe(1, "peer", peer, [1000], rounds=1, timeout_s=timeout_s))])
        assert silent.poll(5000), "the node did not probe"  # its first round trip: unanswered
        silent.recv_multipart()
        started = time.monotonic()
        agent.stop()
        took = time.monotonic() - started
        assert agent.state == "stopped"  # its thread ended, not just the wait for it
        assert took / timeout_s < 0.5, f"stop() took {took:.2f} s of a {timeout_s} s probe"
    finally:
        cluster.close()
        coordinator.close(0)
        silent.close(0)
        ctx.term()


def test_a_link_table_probes_each_wiring_once_and_keeps_late_reports_out() -> None:
    table = LinkTable(rounds=1, timeout_s=1.0, grace_s=0.0)
    addrs = {"c": "tcp://c:1", "a": "tcp://a:1", "b": ""}
    probes = table.due(1, ["c", "a", "b"], addrs, [100], now=0.0)
    assert chain_links(["c", "a", "b"]) == [("c", "a"), ("a", "b"), ("b", "c")]
    assert [(p.a, p.b) for p in probes] == [("c", "a"), ("b", "c")]
    assert table.links[("a", "b")].error == "node b has no probe endpoint"
    assert table.due(1, ["c", "a", "b"], addrs, [100], now=0.0) == []  # once per epoch
    assert not table.result(probes[0].probe_id, "a", None, "x")  # not a's probe
    assert table.result(probes[0].probe_id, "c", LinkProfile(1e-3, 1e8, 2e8))
    assert not table.result(probes[0].probe_id, "c", LinkProfile(1e-3, 1e8, 2e8))  # late
    table.expire(now=100.0)
    assert table.links[("c", "a")].forward_bps == 1e8
    assert "did not report" in table.links[("b", "c")].error
    assert table.due(2, ["c"], addrs, [100], now=0.0) == []  # one node: no links
    refused = table.due(3, ["c", "a"], addrs, [100], 0.0, refused="curve")
    assert refused == [] and table.links[("c", "a")].error == "curve"
    assert table.links[("c", "a")].rtt_s == 1e-3  # the figures it had stay


def test_the_coordinator_probes_its_link_to_a_spare_once() -> None:
    table = LinkTable(rounds=1, timeout_s=1.0)
    addrs = {"c": "tcp://c:1", "a": "tcp://a:1", "s": "tcp://s:1"}
    probes = table.due(1, ["c", "a"], addrs, [100], 0.0, spares=["s"])
    assert [(p.a, p.b) for p in probes] == [("c", "a"), ("a", "c"), ("c", "s")]
    assert table.due(1, ["c", "a"], addrs, [100], 0.0, spares=["s"]) == []


def test_the_coordinator_plans_for_its_configured_objective(cp_cluster) -> None:
    """cluster up --objective throughput: the coordinator's planner judges placements at
    the cluster's --max-streams streams (zctl.launcher.processes passes them)."""
    coord = cp_cluster.coordinator(objective="throughput", plan_streams=16)
    planner = coord.plan.planner
    assert planner is not None and (planner.objective, planner.streams) == ("throughput", 16)
    default = cp_cluster.coordinator().plan.planner
    assert default is not None and (default.objective, default.streams) == ("latency", 4)
