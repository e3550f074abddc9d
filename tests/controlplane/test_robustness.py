"""Control plane under damage and attack: corrupted chunks, bad caches, hostile messages, CURVE."""

from __future__ import annotations

import json
import time

import pytest
import zmq

from controlplane import messages as m
from controlplane.client import ClusterUnreachable, query_status
from tests.helpers.control import FAST, Cluster, RawNode, corrupting, enrol_msg, node, wait_for
from zctl.engine.requests import GenerationRequest
from zctl.manifest import sha256_file
from zctl.service.messages import TokenizeRequest


def test_corrupted_chunk_is_rejected_and_retried(cp_cluster: Cluster) -> None:
    source = corrupting(cp_cluster.export, bad={("stage1.bin", 2): 2})
    coord = cp_cluster.coordinator(source=source)
    agent = cp_cluster.agent(coord.endpoint)
    status = coord.wait_serving(20)
    assert agent.counters["chunks_rejected"] == 2
    offer = source.offer_for(1)
    chunks = sum(-(-f.size // offer.chunk_size) for f in offer.files)
    assert status.counters["chunks_served"] == chunks + 2
    cached = cp_cluster.root / "n1" / "shards" / offer.shard_hash
    for spec in offer.files:
        assert sha256_file(cached / spec.name) == spec.sha256


def test_chunk_that_keeps_failing_fails_the_transfer(cp_cluster: Cluster) -> None:
    source = corrupting(cp_cluster.export, bad={("stage1.xml", 0): 100})
    coord = cp_cluster.coordinator(source=source)
    agent = cp_cluster.agent(coord.endpoint, chunk_retries=2)
    wait_for(lambda: coord.status().pipeline == "failed", what="failed transfer")
    me = node(coord.status(), agent.node_id)
    assert me.state == "failed" and "chunk 0 of stage1.xml failed 3 times" in me.error
    assert not (cp_cluster.root / "n1" / "shards" / source.offer_for(1).shard_hash).exists()


def test_file_hash_catches_what_chunk_hashes_cannot(cp_cluster: Cluster) -> None:
    source = corrupting(cp_cluster.export, bad={("stage1.bin", 1): 1}, recompute=True)
    coord = cp_cluster.coordinator(source=source)
    agent = cp_cluster.agent(coord.endpoint)
    wait_for(lambda: coord.status().pipeline == "failed", what="failed transfer")
    error = node(coord.status(), agent.node_id).error
    assert "stage1.bin of shard" in error and "arrived with sha256" in error
    assert agent.cache.hashes() == []


def test_damaged_cache_is_fetched_again(cp_cluster: Cluster) -> None:
    coord = cp_cluster.coordinator()
    agent = cp_cluster.agent(coord.endpoint)
    coord.wait_serving(20)
    agent.stop()
    cached = cp_cluster.root / "n1" / "shards" / coord.hashes[1] / "stage1.bin"
    data = bytearray(cached.read_bytes())
    data[100] ^= 0xFF
    cached.write_bytes(bytes(data))
    served = coord.status().counters["chunks_served"]
    cp_cluster.agent(coord.endpoint)
    status = coord.wait_serving(20)
    assert status.counters["chunks_served"] > served
    assert sha256_file(cached) == coord.manifest.files["stage1.bin"]


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


def test_status_of_nothing_is_a_clear_error() -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.close(0)
    ctx.term()
    with pytest.raises(ClusterUnreachable, match="no answer from a coordinator"):
        query_status(f"tcp://127.0.0.1:{port}", timeout=0.2)


# -- CURVE --------------------------------------------------------------------------------
def settled_frames(worker, quiet_s: float = 0.15, limit_s: float = 10.0) -> int:
    """The worker's frames in, once none has come for ``quiet_s`` (a generation's CLOSE
    follows its last reply)."""
    seen, since, start = worker.stats().frames_in, time.monotonic(), time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() - start < limit_s:
        time.sleep(0.02)
        now = worker.stats().frames_in
        if now != seen:
            seen, since = now, time.monotonic()
    return seen


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_curve_admits_only_authorized_nodes(cp_cluster: Cluster) -> None:
    from controlplane.security import CurveClient, CurveServer, authorize, key_dir

    allowed = cp_cluster.root / "authorized"
    server = CurveServer.from_state_dir(cp_cluster.root / "coord", allowed)
    good = CurveClient.from_state_dir(cp_cluster.root / "good", server.public)
    authorize(allowed, "good", key_dir(cp_cluster.root / "good") / "node.key")
    server.reload()
    bad = CurveClient.from_state_dir(cp_cluster.root / "bad", server.public)
    coord = cp_cluster.coordinator(curve=server)
    intruder = cp_cluster.agent(coord.endpoint, "bad", curve=bad)
    agent = cp_cluster.agent(coord.endpoint, "good", curve=good)
    status = coord.wait_serving(20)
    assert {n.node_id for n in status.nodes} == {coord.node_id, agent.node_id}
    assert intruder.state in ("enrolling", "disconnected")
    own = CurveClient(server.public, server.public, server.secret)
    assert query_status(coord.endpoint, curve=own).pipeline == "serving"
    with pytest.raises(ClusterUnreachable):
        query_status(coord.endpoint, timeout=0.3)  # plain text is not answered


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_curve_encrypts_the_data_pipes_and_admits_only_the_previous_hop(cp_cluster: Cluster
                                                                        ) -> None:
    """With CURVE on the control plane the data pipes use it too: the coordinator tells
    each stage the next hop's key and the one key its inbound pipe admits; generation
    works, and a frame from any other key (or in plain text) never reaches the stage."""
    from controlplane.coordinator import Coordinator, CoordinatorConfig
    from controlplane.launch import default_launcher, head_launcher
    from controlplane.security import CurveClient, CurveServer
    from dataplane.head.local_chain import LocalChain
    from dataplane.wire.frames import HiddenStateFrame, Kind, encode_frame
    from dataplane.wire.transport import PipeCurve, PipeOptions, push_socket, send_parts
    from zctl.engine.scheduler import generate_greedy

    server = CurveServer.from_state_dir(cp_cluster.root / "coord")  # encryption, any node
    node = CurveClient.from_state_dir(cp_cluster.root / "n1", server.public)
    cfg = CoordinatorConfig(endpoint="tcp://127.0.0.1:*", state_dir=cp_cluster.root / "coord",
                            host="127.0.0.1", curve=server, **FAST)  # type: ignore[arg-type]
    coord = Coordinator(cp_cluster.export, cfg, launcher=head_launcher)
    cp_cluster.coordinators.append(coord)
    coord.start()
    agent = cp_cluster.agent(coord.endpoint, launcher=default_launcher, curve=node)
    coord.wait_serving(60)
    assignment = agent.assignment
    assert assignment is not None and assignment.peer_key == server.public.decode()
    assert assignment.admit_keys == (server.public.decode(),)
    pipeline = coord.local_handle.head  # type: ignore[union-attr]
    assert pipeline.options.curve is not None and pipeline.options.curve.peer == node.public
    prompt = [0, 5, 17, 42, 99]
    local = list(generate_greedy(LocalChain.load(str(cp_cluster.export)), prompt, 8))
    worker = agent.slot.handle
    frames_in = settled_frames(worker)
    assert list(generate_greedy(pipeline, prompt, 8)) == local
    per_run = settled_frames(worker) - frames_in  # what one generation sends the stage
    frames_in += per_run
    stranger = zmq.curve_keypair()
    ctx = zmq.Context()
    try:
        frame = encode_frame(HiddenStateFrame(kind=Kind.RESET, stream_id=0, request_id=0,
                                              epoch=1))
        intruder = push_socket(ctx, agent.data_addr, PipeOptions(
            send_timeout_ms=300, curve=PipeCurve(*stranger, peer=node.public)))
        plain = ctx.socket(zmq.PUSH)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(agent.data_addr)
        plain.send_multipart(frame, zmq.NOBLOCK)  # queued, never delivered
        with pytest.raises(Exception, match="timed out"):
            send_parts(intruder, frame)  # the handshake is refused: no live peer
        assert list(generate_greedy(pipeline, prompt, 8)) == local  # still serving
        # the stage has handled a whole generation since: it took exactly its frames,
        # none of the stranger's nor the plain-text one
        assert settled_frames(worker) - frames_in == per_run > 0
    finally:
        ctx.destroy(0)


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_curve_coordinator_refuses_a_node_without_a_data_key(cp_cluster: Cluster) -> None:
    from controlplane.security import CurveClient, CurveServer

    server = CurveServer.from_state_dir(cp_cluster.root / "coord")
    coord = cp_cluster.coordinator(curve=server)
    keys = CurveClient.from_state_dir(cp_cluster.root / "old", server.public)
    raw = RawNode(coord.endpoint, b"old-1", curve=keys)
    try:
        raw.send(m.encode_message(enrol_msg("old-1")))  # an older zctl: no data_key
        refusal = raw.recv_until(m.Refuse)
        assert refusal.code == "no-data-key" and "encrypts its data pipes" in refusal.reason
        raw.send(m.encode_message(enrol_msg("old-1", data_key=keys.public.decode())))
        assert isinstance(raw.recv_until(m.Welcome), m.Welcome)
    finally:
        raw.close()
