"""CURVE (controlplane.security): the coordinator admits only authorized nodes, the data
pipes are encrypted and each stage admits only its previous hop, and a node without a data
key is refused."""

from __future__ import annotations

import time

import pytest
import zmq

from controlplane import messages as m
from controlplane.client import ClusterUnreachable, query_status
from tests.helpers.control import FAST, QUIET, Cluster, RawNode, enrol_msg


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
                            host="127.0.0.1", curve=server, **FAST,
                            **QUIET)  # type: ignore[arg-type]
    coord = Coordinator(cp_cluster.export, cfg, launcher=head_launcher)
    cp_cluster.coordinators.append(coord)
    coord.start()
    agent = cp_cluster.agent(coord.endpoint, launcher=default_launcher, curve=node)
    coord.wait_serving(60)
    assignment = agent.assignment
    assert assignment is not None and assignment.peer_key == server.public.decode()
    assert assignment.admit_keys == (server.public.decode(),)
    head = coord.local_handle.head  # type: ignore[union-attr]
    assert head.options.curve is not None and head.options.curve.peer == node.public
    prompt = [0, 5, 17, 42, 99]
    local = list(generate_greedy(LocalChain.load(str(cp_cluster.export)), prompt, 8))
    worker = agent.slot.handle
    frames_in = settled_frames(worker)
    assert list(generate_greedy(head, prompt, 8)) == local
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
        assert list(generate_greedy(head, prompt, 8)) == local  # still serving
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
