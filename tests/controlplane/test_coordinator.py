"""Control plane end to end on loopback: enrolment, placement, liveness, refusals, hostile
input, clusters.

Nodes run as threads (agents) or raw sockets (to misbehave on purpose); the coordinator
is node 0. Stages are started by a recording launcher unless a test runs the real data
plane. (A node process killed: tests/e2e/test_fault_tolerance.py.)
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import zmq

from controlplane import messages as m
from controlplane.client import query_status
from controlplane.coordinator import Coordinator, CoordinatorConfig
from controlplane.launch import StageAssignment, build_runner
from controlplane.nodeinfo import load_or_create_node_id, openvino_version, zctl_version
from tests.helpers.control import (
    FAST,
    QUIET,
    Cluster,
    FakeStage,
    RawNode,
    enrol_msg,
    node,
    wait_for,
)
from zctl.engine.requests import GenerationRequest
from zctl.manifest import sha256_file
from zctl.service.messages import TokenizeRequest


# -- enrolment, transfer, wiring ----------------------------------------------------------
def test_enrolment_transfer_and_wiring(cp_cluster: Cluster) -> None:
    coord = cp_cluster.coordinator()
    agent = cp_cluster.agent(coord.endpoint, host="127.0.0.2")
    status = coord.wait_serving(20)
    assert (cp_cluster.root / "n1" / "node_id").read_text().strip() == agent.node_id
    me, other = node(status, coord.node_id), node(status, agent.node_id)
    assert me.local and me.stage == 0 and me.state == "serving"
    assert other.stage == 1 and other.state == "serving" and other.host == "127.0.0.2"
    assert other.openvino == openvino_version() and other.zctl == zctl_version()
    assert other.devices and other.devices[0].name == "CPU" and other.ram_free > 0
    assert other.data_addr == agent.data_addr and other.data_addr.startswith("tcp://127.0.0.2:")
    assert other.transfer_done == other.transfer_total > 0
    assert [s.node_id for s in status.stages] == [coord.node_id, agent.node_id]
    assert status.pipeline == "serving" and status.epoch == 1
    # the shard is cached by hash, every file verified
    shard_hash = coord.hashes[1]
    cached = cp_cluster.root / "n1" / "shards" / shard_hash
    assert sorted(p.name for p in cached.iterdir()) == ["manifest.json", "stage1.bin", "stage1.xml"]
    for name in ("stage1.bin", "stage1.xml"):
        assert sha256_file(cached / name) == coord.manifest.files[name]
    # the ring: stage 0 (coordinator) -> stage 1 -> back to the coordinator
    by_stage = {a.stage_index: a for a in FakeStage.launched}
    assert by_stage[0].bind == coord.data_addr and by_stage[0].send_to == agent.data_addr
    assert by_stage[1].bind == agent.data_addr and by_stage[1].send_to == coord.data_addr
    assert by_stage[1].runner_dir == cached and by_stage[0].runner_dir == coord.export_dir
    # the same status over the wire (what `zctl cluster status --json` prints)
    remote = query_status(coord.endpoint)
    assert remote.pipeline == "serving" and json.loads(json.dumps(remote.to_dict()))["epoch"] == 1


def test_node_runs_a_real_stage_from_its_cache(cp_cluster: Cluster) -> None:
    runners = []

    class RunnerStage:
        def __init__(self, assignment: StageAssignment) -> None:
            self.runner = build_runner(assignment)
            runners.append(self.runner)

        def stop(self) -> None:
            pass

        def kv_slots(self) -> int:
            return -1

    coord = cp_cluster.coordinator()
    cp_cluster.agent(coord.endpoint, launcher=RunnerStage)
    coord.wait_serving(30)
    (runner,) = runners
    assert runner.spec.index == 1 and runner.spec.last
    assert not (runner.export_dir / "tokenizer.json").exists()  # workers need no tokenizer
    runner.open_stream(0)
    hidden = np.random.default_rng(0).standard_normal((1, 3, 64)).astype(np.float32)
    logits = runner.step(0, hidden, np.arange(3))
    assert logits.shape[-1] == runner.manifest.model.vocab_size


def test_a_relaunch_reuses_a_compiled_stage_without_warming_it_again(
        dp_export3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node re-wired to run its stage and the next one keeps the compiled runner of its
    own, already warmed up (a paged stage's warm-up measures its padding, ~1 s of a
    re-wiring's pause), and compiles and warms up only the new one."""
    from controlplane.launch import COMPILED
    from dataplane.runtime.config import RuntimeSpec
    from dataplane.runtime.paged import PagedStageRunner

    warmed: list[int] = []
    original = PagedStageRunner.warm_up
    monkeypatch.setattr(PagedStageRunner, "warm_up",
                        lambda self, *a: (warmed.append(self.spec.index), original(self, *a)))
    one = StageAssignment(dp_export3, 1, 3, "tcp://127.0.0.9:1", "tcp://127.0.0.1:2",
                          RuntimeSpec(precision="f32", paged_attention=True), 1, "h")
    try:
        first = build_runner(one)
        assert warmed == [1] and first.shapes.limit >= 0
        both = build_runner(replace(one, epoch=2, more_stages=(2,), more_dirs=(dp_export3,)))
        assert both.runners[0] is first and warmed == [1, 2]
    finally:
        COMPILED.forget("tcp://127.0.0.9:1")


def test_restarted_node_reclaims_its_id_and_cache(cp_cluster: Cluster) -> None:
    coord = cp_cluster.coordinator()
    first = cp_cluster.agent(coord.endpoint)
    epoch = coord.wait_serving(20).epoch
    served = coord.status().counters["chunks_served"]
    first.stop()
    wait_for(lambda: node(coord.status(), first.node_id).state == "left", what="left")
    assert coord.status().pipeline == "degraded"
    second = cp_cluster.agent(coord.endpoint)
    assert second.node_id == first.node_id
    status = coord.wait_serving(20)
    assert len(status.nodes) == 2 and node(status, second.node_id).stage == 1
    assert status.counters["chunks_served"] == served  # cached: nothing sent again
    assert node(status, second.node_id).transfer_total == 0
    # the same wiring, but a new process with an empty stage: a new epoch, so steps still
    # queued for the old one are dropped as stale
    assert status.epoch == epoch + 1


def test_explicit_placement_and_spares(cp_cluster: Cluster) -> None:
    pinned = load_or_create_node_id(cp_cluster.root / "b")  # b's id, before b first starts
    coord = cp_cluster.coordinator(expect_nodes=2, placement={1: pinned})
    a = cp_cluster.agent(coord.endpoint, "a")
    b = cp_cluster.agent(coord.endpoint, "b")
    assert b.node_id == pinned
    status = coord.wait_serving(20)
    assert node(status, b.node_id).stage == 1 and node(status, b.node_id).state == "serving"
    assert node(status, a.node_id).state == "idle" and node(status, a.node_id).stage is None
    assert a.state == b.state == "enrolled" and a.handle is None


def test_dead_nodes_stage_moves_to_a_spare(cp_cluster: Cluster) -> None:
    coord = cp_cluster.coordinator(expect_nodes=2, reassign_after=0.2)
    a = cp_cluster.agent(coord.endpoint, "a")
    b = cp_cluster.agent(coord.endpoint, "b")
    status = coord.wait_serving(20)
    working, spare = (a, b) if node(status, a.node_id).stage == 1 else (b, a)
    working.stop()
    wait_for(lambda: coord.status().epoch == 2 and coord.status().pipeline == "serving",
             what="rewired onto the spare")
    status = coord.status()
    assert node(status, spare.node_id).stage == 1 and node(status, working.node_id).stage is None
    head = [x for x in FakeStage.launched if x.stage_index == 0][-1]
    assert head.send_to == spare.data_addr and head.epoch == 2
    # the old node comes back as a spare
    back = cp_cluster.agent(coord.endpoint, "a" if working is a else "b")
    wait_for(lambda: node(coord.status(), back.node_id).state == "idle", what="spare again")
    assert coord.status().pipeline == "serving"


def test_a_lost_nodes_stage_heals_onto_the_survivor(cp_cluster: Cluster) -> None:
    """No spare: the coordinator takes the lost node's stage and runs both; the node that
    comes back takes its stage back once it has stayed a while."""
    coord = cp_cluster.coordinator(heal_after=0.0)
    agent = cp_cluster.agent(coord.endpoint)
    coord.wait_serving(20)
    agent.stop()
    wait_for(lambda: coord.status().epoch == 2 and coord.status().pipeline == "serving",
             what="healed onto the coordinator")
    status = coord.status()
    assert [s.node_id for s in status.stages] == [coord.node_id, coord.node_id]
    head = [x for x in FakeStage.launched if x.epoch == 2]
    assert [(x.stage_index, x.more_stages) for x in head] == [(0, (1,))]
    assert head[0].more_dirs == (coord.export_dir,)
    back = cp_cluster.agent(coord.endpoint)
    wait_for(lambda: coord.status().epoch == 3 and coord.status().pipeline == "serving",
             what="stage 1 given back")
    status = coord.status()
    assert [s.node_id for s in status.stages] == [coord.node_id, back.node_id]
    assert node(status, back.node_id).stage == 1
    head = [x for x in FakeStage.launched if x.epoch == 3 and x.stage_index == 0]
    assert head and head[-1].more_stages == () and head[-1].send_to == back.data_addr


def test_survivors_without_room_say_what_is_missing(cp_cluster: Cluster) -> None:
    """A lost node whose stage fits no survivor: the pipeline stays down, its problem (what
    paused generations are told) names the stage and what the survivors have; the node
    coming back serves again."""
    from controlplane.placement import NodeCapacity

    coord = cp_cluster.coordinator(heal_after=0.0)
    agent = cp_cluster.agent(coord.endpoint)
    coord.wait_serving(20)
    coord.plan.capacity = lambda member: NodeCapacity(member.node_id, 1)  # type: ignore
    agent.stop()
    wait_for(lambda: "cannot hold" in (coord.pipeline_problem() or ""), what="heal refused")
    problem = coord.pipeline_problem() or ""
    assert problem.startswith("stage 1 (layers ") and "left the cluster" in problem
    assert f"the survivors cannot hold stage(s) 1 of lost node {agent.node_id}" in problem
    assert f"node {coord.node_id} has 0 B to spare" in problem
    assert coord.status().pipeline == "degraded"
    cp_cluster.agent(coord.endpoint)
    assert coord.wait_serving(20).stages[1].node_id == agent.node_id


def test_placement_error_is_reported(cp_cluster: Cluster) -> None:
    coord = cp_cluster.coordinator(placement={1: "nobody"})
    cp_cluster.agent(coord.endpoint)
    wait_for(lambda: coord.status().plan_error, what="plan error")
    status = coord.status()
    assert status.pipeline == "waiting" and "pinned to nobody, which is not enrolled" in \
        status.plan_error
    with pytest.raises(TimeoutError, match="pipeline is waiting.*nobody"):
        coord.wait_serving(0.1)


# -- liveness -----------------------------------------------------------------------------
def test_a_re_plans_fetch_that_fails_on_a_serving_node_leaves_it_serving(
        cp_cluster: Cluster) -> None:
    """A node that runs a stage fetches a pending re-plan's shards quietly: when that fails,
    the re-plan is abandoned, and the node (and the pipeline) serve on as placed."""
    coord = cp_cluster.coordinator()
    agent = cp_cluster.agent(coord.endpoint)
    coord.wait_serving(20)
    with coord._lock:  # the loop waits: nothing switches or offers meanwhile
        member = coord.members[agent.node_id]
        coord.plan.pending = {0: coord.node_id, 1: agent.node_id}
        member.offered = "f" * 64
        coord._on_shard_done(member, m.ShardDone("f" * 64, False, error="disk full"))
        assert member.state == "serving" and coord.plan.pending is None
        assert coord.plan.replan_note == (
            f"re-plan abandoned: node {agent.node_id} could not fetch shard ffffffffffff: "
            "disk full; serving on the current placement")
    status = coord.status()
    assert status.pipeline == "serving" and "re-plan abandoned" in status.placement
    assert (status.replan.kind, status.replan.count) == ("abandoned", 1)
    assert status.replan.note == coord.plan.replan_note and status.replan.time_s > 0


def test_heartbeat_loss_marks_node_dead_and_status_shows_it(cp_cluster: Cluster) -> None:
    coord = cp_cluster.coordinator(heartbeat_interval=0.05, liveness=3)
    raw = RawNode(coord.endpoint, b"silent-1")
    try:
        raw.send(m.encode_message(enrol_msg("silent-1")))
        welcome = raw.recv_until(m.Welcome)
        assert welcome.heartbeat_interval == 0.05 and welcome.liveness == 3
        assert isinstance(raw.recv_until(m.ShardOffer), m.ShardOffer)  # planned for stage 1
        # it answers nothing from now on
        wait_for(lambda: node(query_status(coord.endpoint), "silent-1").state == "dead",
                 timeout=5, what="dead")
        status = query_status(coord.endpoint)
        assert status.pipeline == "degraded" and status.counters["marked_dead"] == 1
        assert node(status, "silent-1").last_seen_s >= 0.15
        # what generations in flight are told (GenerationService's health check)
        problem = coord.pipeline_problem()
        assert problem is not None and problem.startswith("stage 1 (layers ")
        assert "node silent-1 at " in problem and "missed its heartbeats" in problem
        # a dead node that speaks again is told to enrol again
        raw.send(m.encode_message(m.Heartbeat()))
        err = raw.recv_until(m.Error)
        assert err.code == "not-enrolled"
    finally:
        raw.close()


def test_agent_reconnects_when_the_coordinator_goes_away(cp_cluster: Cluster) -> None:
    # the coordinator tells its nodes a liveness of 10 minutes: a node reconnecting within
    # the wait below can only have acted on the goodbye, not on the coordinator's silence
    coord = cp_cluster.coordinator(liveness=6000)
    agent = cp_cluster.agent(coord.endpoint)
    coord.wait_serving(20)
    assert agent._interval * agent._liveness >= 600  # the Welcome's figures are in force
    endpoint = coord.endpoint
    coord.stop()  # says goodbye; the agent keeps its stage and retries
    # the goodbye is acted on at once, not after the liveness timeout
    wait_for(lambda: agent.counters["reconnects"] >= 1, timeout=60, what="reconnect on goodbye")
    wait_for(lambda: agent.counters["reconnects"] >= 3, what="reconnect attempts")
    assert agent._backoff > agent.config.reconnect_min  # backing off: 0.05 s doubling to 0.4 s
    assert agent.handle is not None and not agent.handle.stopped
    coord2 = cp_cluster.coordinator(endpoint=endpoint)
    status = coord2.wait_serving(20)
    assert node(status, agent.node_id).state == "serving"
    assert agent.coordinator_id == coord2.node_id and agent.counters["enrolments"] >= 2
    assert len([a for a in FakeStage.launched if a.stage_index == 1]) == 1  # stage kept


def test_agent_follows_a_coordinator_that_moved(cp_cluster: Cluster) -> None:
    # a node that found its cluster by discovery asks where it is before each reconnection
    coord = cp_cluster.coordinator()
    where = [coord.endpoint]
    asked: list[str] = []
    closed: list[bool] = []

    class Locator:
        def locate(self) -> str | None:
            asked.append(where[0])
            return where[0] if where[0] else None

        def close(self) -> None:
            closed.append(True)

    agent = cp_cluster.agent(coord.endpoint, locator=Locator())
    coord.wait_serving(20)
    old = coord.endpoint
    coord.stop()
    where[0] = ""  # not visible while it restarts: the agent keeps trying the old address
    wait_for(lambda: len(asked) >= 2, what="the agent asking where the coordinator is")
    assert agent.coordinator == old
    coord2 = cp_cluster.coordinator()  # the same state dir, another port
    assert coord2.endpoint != old
    where[0] = coord2.endpoint
    status = coord2.wait_serving(20)
    assert node(status, agent.node_id).state == "serving"
    assert agent.coordinator == coord2.endpoint and agent.status()["coordinator"] == coord2.endpoint
    agent.stop()
    assert closed == [True]  # the agent closes its locator when it stops


def test_agent_survives_a_silent_and_garbled_coordinator(cp_cluster: Cluster) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        agent = cp_cluster.agent(f"tcp://127.0.0.1:{port}", heartbeat_interval=0.05, liveness=3)
        assert router.poll(3000)
        identity, first = router.recv_multipart()
        assert identity == agent.node_id.encode()
        assert isinstance(m.decode_message(first), m.Enrol)
        for junk in ([b"\x00garbage"], [b"{}"], [m.encode_message(m.Heartbeat()), b"x"],
                     [json.dumps({"protocol": m.PROTOCOL_VERSION, "type": "warp", "body": {}}).encode()]):
            router.send_multipart([identity, *junk])
        router.send_multipart([identity, m.encode_message(
            m.Welcome(agent.node_id, "fake", "s", 0.05, 3))])
        wait_for(lambda: agent.state == "enrolled", what="enrolled")
        wait_for(lambda: agent.counters["malformed"] >= 4, what="malformed counted")
        # now the fake coordinator goes silent: the agent reconnects and enrols again
        wait_for(lambda: agent.counters["reconnects"] >= 1, what="reconnect")
        deadline = time.monotonic() + 5
        enrols = 0
        while time.monotonic() < deadline and enrols < 2:
            if router.poll(100):
                _, data, *_ = router.recv_multipart()
                try:
                    enrols += isinstance(m.decode_message(data), m.Enrol)
                except m.MessageError:
                    pass
        assert enrols >= 1 and agent.state in ("enrolling", "disconnected")
    finally:
        router.close(0)
        ctx.term()


# -- refusals -----------------------------------------------------------------------------
def test_openvino_version_mismatch_is_refused_on_both_sides(cp_cluster: Cluster) -> None:
    coord = cp_cluster.coordinator()
    agent = cp_cluster.agent(coord.endpoint, openvino="2026.3.0-1-abcdef")
    wait_for(lambda: agent.state == "refused", what="refusal")
    ours = openvino_version().split("-")[0]
    assert f"runs OpenVINO 2026.3.0 but the coordinator runs {ours}" in agent.refusal
    assert agent.node_id in agent.refusal
    status = coord.status()
    assert [r.node_id for r in status.refused] == [agent.node_id]
    assert status.refused[0].reason == agent.refusal
    assert agent.node_id not in {n.node_id for n in status.nodes}
    wait_for(lambda: agent._thread is None or not agent._thread.is_alive(), what="agent exit")
    assert agent.counters["reconnects"] == 0  # refusal is final, not retried


def test_same_release_other_build_names_full_versions(cp_cluster: Cluster) -> None:
    coord = cp_cluster.coordinator()
    release = openvino_version().split("-")[0]
    agent = cp_cluster.agent(coord.endpoint, openvino=f"{release}-1-custom")
    wait_for(lambda: agent.state == "refused", what="refusal")
    assert f"runs OpenVINO {release}-1-custom but the coordinator runs {openvino_version()}" \
        in agent.refusal


def test_a_local_clusters_coordinator_admits_its_own_nodes_only(cp_cluster: Cluster) -> None:
    """A node started for another local cluster (an earlier one on this machine), or for
    none, is refused; the cluster's own node enrols and serves."""
    coord = cp_cluster.coordinator(cluster_id="c-new")
    earlier = cp_cluster.agent(coord.endpoint, name="earlier", cluster_id="c-old")
    stranger = cp_cluster.agent(coord.endpoint, name="stranger")
    wait_for(lambda: earlier.state == stranger.state == "refused", what="refusals")
    assert "started for local cluster c-old, but this coordinator serves local cluster c-new" \
        in earlier.refusal
    assert "started for no local cluster" in stranger.refusal
    own = cp_cluster.agent(coord.endpoint, name="own", cluster_id="c-new")
    coord.wait_serving(20)
    status = coord.status()
    assert [n.node_id for n in status.nodes if n.node_id != coord.node_id] == [own.node_id]
    assert {r.node_id for r in status.refused} == {earlier.node_id, stranger.node_id}


def test_protocol_mismatch_is_refused_on_both_sides(cp_cluster: Cluster) -> None:
    coord = cp_cluster.coordinator()
    agent = cp_cluster.agent(coord.endpoint, protocol=m.PROTOCOL_VERSION + 1)
    wait_for(lambda: agent.state == "refused", what="refusal")
    assert f"speaks control protocol {m.PROTOCOL_VERSION + 1} but the coordinator speaks " \
           f"{m.PROTOCOL_VERSION}" in agent.refusal
    status = coord.status()
    assert status.counters["protocol_mismatch"] == 1 and status.refused[0].node_id == agent.node_id


# -- hostile input ------------------------------------------------------------------------
def test_malformed_and_unknown_messages_leave_the_cluster_serving(cp_cluster: Cluster) -> None:
    coord = cp_cluster.coordinator(max_message_bytes=1 << 16)
    agent = cp_cluster.agent(coord.endpoint)
    coord.wait_serving(20)
    raw = RawNode(coord.endpoint, b"intruder")
    try:
        expectations = [
            ([b"\xff\xfe\xfd"], "malformed"),
            ([b"[" * 50000], "malformed"),
            ([b'{"protocol": %d, "type": "heartbeat"}' % m.PROTOCOL_VERSION, b"extra"], "malformed"),
            ([json.dumps({"protocol": m.PROTOCOL_VERSION, "type": "enrol", "body": {"node_id": 5}}).encode()],
             "malformed"),
            ([json.dumps({"protocol": m.PROTOCOL_VERSION, "type": "self_destruct", "body": {}}).encode()],
             "unknown-type"),
            ([json.dumps({"protocol": 99, "type": "heartbeat", "body": {}}).encode()],
             "protocol-version"),
            ([m.encode_message(m.Heartbeat())], "not-enrolled"),
            ([m.encode_message(m.ShardRequest(coord.hashes[1], "stage1.bin", 0, 0, 10))],
             "not-enrolled"),
            # the generation service's messages, which the same envelope carries, are
            # answered on the control socket like any other a stranger sends
            ([m.encode_message(GenerationRequest("r", "hi", 1))], "not-enrolled"),
            ([m.encode_message(TokenizeRequest(GenerationRequest("t", "hi", 1)))],
             "not-enrolled"),
            ([b""], "malformed"),
        ]
        for frames, code in expectations:
            raw.send(*frames)
            reply = raw.recv()
            assert isinstance(reply, m.Error) and reply.code == code, (frames[0][:40], reply)
        raw.send(b"x" * (1 << 17))  # over MAXMSGSIZE: libzmq drops the connection
        raw.send(m.encode_message(enrol_msg("someone-else")))
        # the coordinator has handled all it got from this peer once it answers a later
        # status request on the same (re-established) connection; ask until it does
        deadline, answered = time.monotonic() + 20, None
        while answered is None and time.monotonic() < deadline:
            raw.send(m.encode_message(m.StatusRequest()))
            try:
                answered = raw.recv_until(m.StatusReply, timeout=0.5)
            except AssertionError:  # sent before the connection was back: lost with it
                pass
        assert answered is not None, "the coordinator stopped answering this peer"
    finally:
        raw.close()
    # an enrolled node sending nonsense is answered, not dropped from the cluster
    status = query_status(coord.endpoint)
    assert status.pipeline == "serving" and node(status, agent.node_id).state == "serving"
    c = status.counters
    assert c["malformed"] == 5 and c["unknown_type"] == 1 and c["protocol_mismatch"] == 1
    assert c["not_enrolled"] == 4 and c["handler_errors"] == 0
    # and it stays so: a few more heartbeats go both ways without a reconnect or a death
    seen = agent.counters["received"]
    wait_for(lambda: agent.counters["received"] >= seen + 3, what="3 more heartbeats")
    status = query_status(coord.endpoint)
    assert status.pipeline == "serving" and node(status, agent.node_id).state == "serving"
    assert agent.state == "enrolled" and agent.counters["reconnects"] == 0


def test_enrolment_under_a_foreign_routing_id_is_refused(cp_cluster: Cluster) -> None:
    coord = cp_cluster.coordinator()
    raw = RawNode(coord.endpoint, b"alias")
    try:
        raw.send(m.encode_message(enrol_msg("real-name")))
        refuse = raw.recv_until(m.Refuse)
        assert refuse.code == "bad-enrol" and "routing id must be the node id" in refuse.reason
        raw2 = RawNode(coord.endpoint, coord.node_id.encode())
        raw2.send(m.encode_message(enrol_msg(coord.node_id)))
        assert raw2.recv_until(m.Refuse).code == "duplicate-id"
        raw2.close()
    finally:
        raw.close()


# -- whole clusters -------------------------------------------------------------------------
def test_a_node_reports_its_shard_transfer_to_the_end(cp_cluster: Cluster) -> None:
    """What ``zctl node join``'s progress bar shows: the transfer reaches 100%, the cluster
    serves, and its status renders as one row per node."""
    from zctl.cli.view import status_table

    FakeStage.launched = []
    progress: list[tuple[str, int, int]] = []
    coord = cp_cluster.coordinator()
    cp_cluster.agent(coord.bind(), on_progress=lambda *a: progress.append(a))
    status = coord.wait_serving(20)
    assert status.pipeline == "serving" and len(status.nodes) == 2
    assert progress and progress[-1][1] == progress[-1][2]  # the bar reached 100%
    assert status_table(status).row_count == 2


def test_generation_through_a_wired_cluster_matches_one_process(cp_cluster: Cluster) -> None:
    """The real data plane: ClusterHead on the coordinator, StageWorker on the node."""
    from controlplane.launch import default_launcher, head_launcher
    from dataplane.head.local_chain import LocalChain
    from zctl.engine.scheduler import generate_greedy

    cfg = CoordinatorConfig(endpoint="tcp://127.0.0.1:*", state_dir=cp_cluster.root / "coord",
                            host="127.0.0.1", **FAST, **QUIET)  # type: ignore[arg-type]
    coord = Coordinator(cp_cluster.export, cfg, launcher=head_launcher)
    cp_cluster.coordinators.append(coord)
    coord.start()
    cp_cluster.agent(coord.endpoint, launcher=default_launcher)
    coord.wait_serving(60)
    pipeline = coord.local_handle.head  # type: ignore[union-attr]
    prompt = [0, 5, 17, 42, 99]
    remote = list(generate_greedy(pipeline, prompt, 8))
    local = list(generate_greedy(LocalChain.load(str(cp_cluster.export)), prompt, 8))
    assert remote == local and len(remote) == 8


def test_a_cluster_heals_node_by_node_until_the_coordinator_runs_every_stage(
        tmp_path: Path, dp_export3: Path) -> None:
    """The real data plane, 3 stages and no spare: the node of stage 2 leaves and the node
    of stage 1 runs both (its worker a StageChain, the shard fetched now); then that node
    leaves too and the coordinator runs all three, answering steps itself. The tokens
    are one process's every time."""
    from controlplane.launch import default_launcher, head_launcher
    from dataplane.head.local_chain import LocalChain
    from zctl.engine.scheduler import generate_greedy

    cluster = Cluster(tmp_path, dp_export3)
    try:
        cfg = CoordinatorConfig(endpoint="tcp://127.0.0.1:*", state_dir=tmp_path / "coord",
                                host="127.0.0.1", expect_nodes=2, **FAST,
                                **QUIET)  # type: ignore[arg-type]
        coord = Coordinator(dp_export3, cfg, launcher=head_launcher)
        cluster.coordinators.append(coord)
        coord.start()
        a = cluster.agent(coord.endpoint, "a", launcher=default_launcher)
        b = cluster.agent(coord.endpoint, "b", launcher=default_launcher)
        status = coord.wait_serving(60)
        last, middle = (a, b) if node(status, a.node_id).stage == 2 else (b, a)
        prompt = [0, 5, 17, 42, 99, 7, 7]
        want = list(generate_greedy(LocalChain.load(str(dp_export3)), prompt, 8))
        compiled = middle.slot.handle.runner  # type: ignore[union-attr]
        for gone, hosts_left in ((last, [coord.node_id, middle.node_id, middle.node_id]),
                                 (middle, [coord.node_id] * 3)):
            epoch = coord.status().epoch
            gone.stop()
            wait_for(lambda e=epoch: coord.status().epoch > e and coord.status().pipeline ==
                     "serving", timeout=60, what="healed")
            status = coord.status()
            assert [s.node_id for s in status.stages] == hosts_left
            pipeline = coord.local_handle.head  # type: ignore[union-attr]
            assert list(generate_greedy(pipeline, prompt, 8)) == want
            if gone is last:  # the middle node kept its compiled stage 1 and added stage 2
                chain = middle.slot.handle.runner  # type: ignore[union-attr]
                assert chain.runners[0] is compiled and chain.spec.last
        assert pipeline.answers_here
        assert len(middle.cache.hashes()) == 2  # it fetched stage 2's shard when it took it
        # both come back: the fleet spreads out again, a stage per node, the same tokens
        back = [cluster.agent(coord.endpoint, name, launcher=default_launcher)
                for name in ("a", "b")]
        wait_for(lambda: len({s.node_id for s in coord.status().stages}) == 3 and
                 coord.status().pipeline == "serving", timeout=60, what="spread out again")
        assert {s.node_id for s in coord.status().stages[1:]} == {n.node_id for n in back}
        pipeline = coord.local_handle.head  # type: ignore[union-attr]
        assert list(generate_greedy(pipeline, prompt, 8)) == want
    finally:
        cluster.close()


# -- a fleet of one ---------------------------------------------------------------------
def _serving_on(coord: Coordinator) -> list[str]:
    status = coord.status()
    return [s.node_id or "" for s in status.stages] if status.pipeline == "serving" else []


@pytest.mark.parametrize("layers", [[(0, 4)], [(0, 2), (2, 4)]], ids=["1-stage", "2-stage"])
def test_a_coordinator_alone_serves_every_stage_then_spreads_to_a_node_that_joins(
        tmp_path: Path, tiny_exports, layers) -> None:
    """No node to wait for: the coordinator places every stage on itself and serves,
    answering steps itself; a node that joins later takes the tail of its run over (a
    1-stage export has none to give), without a restart, and the tokens stay one
    process's."""
    from controlplane.launch import default_launcher, head_launcher
    from dataplane.head.local_chain import LocalChain
    from zctl.engine.scheduler import generate_greedy

    export = tiny_exports.get(layers)
    cluster = Cluster(tmp_path, export)
    try:
        cfg = CoordinatorConfig(endpoint="tcp://127.0.0.1:*", state_dir=tmp_path / "coord",
                                host="127.0.0.1", expect_nodes=0, **FAST,
                                **QUIET)  # type: ignore[arg-type]
        coord = Coordinator(export, cfg, launcher=head_launcher)
        cluster.coordinators.append(coord)
        coord.start()
        status = coord.wait_serving(60)
        assert [s.node_id for s in status.stages] == [coord.node_id] * len(layers)
        head = coord.local_handle.head  # type: ignore[union-attr]
        assert head.answers_here
        prompt = [0, 5, 17, 42, 99]
        want = list(generate_greedy(LocalChain.load(str(export)), prompt, 8))
        assert list(generate_greedy(head, prompt, 8)) == want
        timing = head.timings.summary()  # what the dashboard shows: the stages' compute here
        assert timing["stage0.compute"]["p50"] > 0 and timing["total"]["p50"] >= \
            timing["stage0.compute"]["p50"] and timing["network"]["p50"] == 0
        agent = cluster.agent(coord.endpoint, "a", launcher=default_launcher)
        if len(layers) == 1:
            wait_for(lambda: any(n.node_id == agent.node_id and n.state == "idle"
                                 for n in coord.status().nodes), what="a spare")
            time.sleep(1.0)  # settled: still nothing to hand over
            assert _serving_on(coord) == [coord.node_id]
            return
        wait_for(lambda: _serving_on(coord) == [coord.node_id, agent.node_id], timeout=60,
                 what="stage 1 on the node that joined")
        head = coord.local_handle.head  # type: ignore[union-attr]
        assert not head.answers_here
        assert list(generate_greedy(head, prompt, 8)) == want
    finally:
        cluster.close()


def test_stages_that_fit_no_machine_are_a_clear_plan_error(cp_cluster: Cluster) -> None:
    coord = cp_cluster.coordinator(expect_nodes=0, memory_limit=1 << 20)
    wait_for(lambda: coord.status().plan_error, what="plan error")
    status = coord.status()
    assert status.pipeline == "waiting"
    assert "needs about" in status.plan_error and "KiB usable" in status.plan_error
    assert node(status, coord.node_id).ram_free <= 1 << 20
