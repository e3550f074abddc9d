"""Emulated WAN links (dataplane.wire.link): frames arrive at least the injected latency late, in
order, without holding up the sender; zero delay keeps the plain socket; bad shapes are
refused clearly; a delayed cluster still generates exactly the greedy tokens, and the
injected time shows up as the hops' network time."""

from __future__ import annotations

import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from dataplane.head.cluster_head import ClusterHead
from dataplane.head.local_chain import LocalChain
from dataplane.runtime.stateful import StageRunner
from dataplane.wire.link import DelayedSender, link_options
from dataplane.wire.pipes import open_push
from dataplane.wire.transport import (
    PipeOptions,
    TransportError,
    bound_endpoint,
    pull_socket,
    recv_parts,
    send_parts,
)
from dataplane.worker.stage_worker import StageWorker
from zctl.engine.drafting import LookupDrafter
from zctl.engine.executor import Step
from zctl.engine.scheduler import generate_greedy, generate_speculative

STAMP = struct.Struct("<Id")  # sequence number, send time (monotonic s)
PROMPT = [0, 17, 42, 99, 5, 230, 7]


@pytest.fixture
def pull():
    ctx = zmq.Context.instance()
    sock = pull_socket(ctx, "tcp://127.0.0.1:*")
    yield ctx, sock
    sock.close(0)


def receive(sock: zmq.Socket, n: int, timeout_s: float = 5.0) -> list[tuple[int, float, float]]:
    """(sequence, send time, arrival time) of n frames."""
    out = []
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    for _ in range(n):
        parts = recv_parts(sock)
        seq, sent = STAMP.unpack(parts[0])
        out.append((seq, sent, time.monotonic()))
    return out


def test_frames_arrive_delayed_in_order_without_blocking_the_sender(pull):
    ctx, sock = pull
    delay = 40.0
    link = open_push(ctx, bound_endpoint(sock), link_options(delay, jitter_ms=15.0))
    assert isinstance(link, DelayedSender)
    try:
        payload = np.arange(600, dtype=np.float32)
        for seq in range(50):  # a burst: jitter must not reorder it
            assert send_parts(link, [STAMP.pack(seq, time.monotonic()), payload]) is None
            payload[:] = -1  # the caller may reuse its buffer at once: the link copied it
        got = receive(sock, 50)
    finally:
        link.close()
    # queued, not slept on: on a link with a long delay, the sends return at once (far
    # within the delay) with every frame still on the link
    long_ms = 2_000.0
    slow = open_push(ctx, bound_endpoint(sock), link_options(long_ms))
    try:
        t0 = time.monotonic()
        for seq in range(2):
            slow.send_parts([STAMP.pack(seq, time.monotonic()), payload])
            assert slow.backlog == seq + 1 and slow.stats.sent == 0
        assert time.monotonic() - t0 < long_ms / 2 / 1e3
    finally:
        slow.close()  # linger 0: the frames still on it are dropped
    assert slow.stats.dropped == 2
    assert [g[0] for g in got] == list(range(50))
    assert min(arrived - sent for _, sent, arrived in got) >= delay * 0.9 / 1e3
    assert link.stats.sent == 50 and link.stats.dropped == 0


def test_rate_cap_adds_serialisation_delay(pull):
    ctx, sock = pull
    link = DelayedSender(ctx, bound_endpoint(sock), link_options(5.0, rate_mbit=8.0))
    try:
        body = b"\0" * 20_000  # 20 ms each at 8 Mbit/s
        t0 = time.monotonic()
        for seq in range(5):
            link.send_parts([STAMP.pack(seq, time.monotonic()), body])
        got = receive(sock, 5)
    finally:
        link.close()
    assert [g[0] for g in got] == list(range(5))
    assert got[-1][2] - t0 >= 0.9 * (5 * 0.020 + 0.005)
    assert got[0][2] - t0 >= 0.9 * 0.025


def test_zero_delay_keeps_the_direct_path(pull):
    ctx, sock = pull
    threads = threading.active_count()
    push = open_push(ctx, bound_endpoint(sock), PipeOptions())
    try:
        assert type(push) is zmq.Socket and threading.active_count() == threads
        assert not PipeOptions().shaped and PipeOptions(delay_ms=1).shaped
        send_parts(push, [STAMP.pack(1, time.monotonic()), b"x" * 10])
        assert receive(sock, 1)[0][0] == 1
    finally:
        push.close(0)


@pytest.mark.parametrize("kwargs", [
    {"delay_ms": -1}, {"delay_ms": float("nan")}, {"delay_ms": float("inf")},
    {"delay_ms": "5"}, {"delay_ms": True}, {"jitter_ms": -0.5}, {"rate_mbit": -8},
    {"delay_ms": 120_000}, {"hwm": 0},
])
def test_bad_link_shapes_are_refused(kwargs):
    with pytest.raises(ValueError, match="PipeOptions"):
        PipeOptions(**kwargs)


def test_bad_shapes_fail_clearly_on_the_command_line_and_cluster_start():
    from typer.testing import CliRunner

    from dataplane.runtime.config import RuntimeSpec
    from zctl.cli.app import app
    from zctl.launcher.local import start_local_cluster
    from zctl.launcher.processes import LinkShape, link_shape
    from zctl.launcher.record import ClusterError

    refused = CliRunner().invoke(app, ["node", "join", "tcp://127.0.0.1:9", "--link-delay-ms", "-5"])
    assert refused.exit_code == 1 and "delay_ms" in refused.output
    with pytest.raises(ClusterError, match="delay_ms"):
        start_local_cluster(Path("/nonexistent"), 2, RuntimeSpec(), link_delay_ms=-1)
    assert link_shape(25) == LinkShape(25.0) and not link_shape().shaped
    assert link_shape(10, 2, 100) == LinkShape(10.0, 2.0, 100.0)


def test_a_bad_address_fails_at_construction_and_close_stops_the_thread(pull):
    ctx, sock = pull
    with pytest.raises(TransportError, match="cannot connect"):
        DelayedSender(ctx, "tcp://no such host", link_options(5))
    link = DelayedSender(ctx, bound_endpoint(sock), link_options(500))
    link.send_parts([b"late", b""])
    link.close()  # linger 0: the frame still on the link is dropped
    assert not link._thread.is_alive() and link.stats.dropped == 1
    with pytest.raises(TransportError, match="closed"):
        link.send_parts([b"after", b""])
    link = DelayedSender(ctx, bound_endpoint(sock), link_options(20))
    link.send_parts([STAMP.pack(7, time.monotonic()), b""])
    link.close(linger=1000)  # due within the linger: delivered
    assert receive(sock, 1)[0][0] == 7


def test_closing_a_link_to_a_peer_that_is_gone_gives_up_its_frames_at_once():
    """No peer takes the frames (its node died): the link thread waits out the send
    timeout for each frame only while the link is open; closed, it drops them at once, so
    a re-wired stage is not held back a send timeout per frame queued."""
    ctx = zmq.Context.instance()
    port_holder = pull_socket(ctx, "tcp://127.0.0.1:*")
    address = bound_endpoint(port_holder)
    port_holder.close(0)  # nothing listens there now
    link = DelayedSender(ctx, address, PipeOptions(delay_ms=1.0, send_timeout_ms=2000))
    for i in range(3):
        link.send_parts([STAMP.pack(i, time.monotonic()), b""])
    time.sleep(0.2)  # the first frame is due, its send waits for a peer
    start = time.monotonic()
    link.close(linger=1000)  # all due within the linger, and no peer to take them
    assert time.monotonic() - start < 1.0
    assert not link._thread.is_alive() and link.stats.dropped == 3 and link.stats.sent == 0


def delayed_cluster(export, delay_ms: float) -> tuple[ClusterHead, StageWorker]:
    """A 2-stage cluster (stage 1 in a thread) with ``delay_ms`` on both hops."""
    options = link_options(delay_ms)
    pipe = ClusterHead(StageRunner(export, 0), "tcp://127.0.0.1:1", "tcp://127.0.0.1:*",
                           timeout_s=10, options=options)
    worker = StageWorker(StageRunner(export, 1), "tcp://127.0.0.1:*", pipe.reply_endpoint,
                         options=options)
    pipe.rewire(worker.endpoint)
    worker.start()
    return pipe, worker


@pytest.fixture
def delayed2(dp_export2):
    """A 2-stage cluster (stage 1 in a thread) with DELAY ms on both hops."""
    pipe, worker = delayed_cluster(dp_export2, DELAY)
    yield pipe, worker
    worker.stop()
    pipe.close()


def wait_until(pred, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


DELAY = 25.0
SLOW = 250.0  # a delay far above any scheduling hiccup, where a test looks at what is queued


def test_delayed_cluster_generates_greedy_and_shows_the_delay_as_network(delayed2, dp_export2):
    pipe, worker = delayed2
    assert isinstance(pipe._push, DelayedSender) and isinstance(worker._push, DelayedSender)
    want = list(generate_greedy(LocalChain.load(str(dp_export2)), PROMPT, 8, prefill_chunk=4))
    t0 = time.monotonic()
    assert list(generate_greedy(pipe, PROMPT, 8, prefill_chunk=4)) == want
    steps = 2 + 7  # two prefill chunks, then one step per further token
    assert time.monotonic() - t0 >= steps * 2 * DELAY * 0.9 / 1e3
    got = list(generate_speculative(pipe, PROMPT, 8, drafter=LookupDrafter(), k=3,
                                    prefill_chunk=4))
    assert got == want
    summary = pipe.timings.summary()
    for hop in ("hop0-1", "hop1-2"):
        assert summary[f"{hop}.network"]["p50"] >= DELAY * 0.9
    assert summary["network"]["p50"] >= 2 * DELAY * 0.9


def test_polling_in_short_waits_still_counts_the_delay_as_network(dp_export2):
    """The generation service polls in 20 ms slices: a reply's wait spans several polls."""
    pipe, worker = delayed_cluster(dp_export2, SLOW)
    try:
        pipe.open(0)
        pipe.reset(0)
        # the RESET has passed: stage 1 is idle when the step lands
        wait_until(lambda: worker.stats().resets == 1, "stage 1 to apply the reset")
        t0 = time.monotonic()
        pipe.submit(Step(0, np.array(PROMPT), np.arange(len(PROMPT))))
        submit_ms = (time.monotonic() - t0) * 1e3
        assert pipe._push.backlog == 1  # stage 0 computed, the frame queued: submit did not
        # wait for the link (nor for the reply)
        reply = None
        while reply is None:
            reply = pipe.collect_any(timeout_s=0.003)
    finally:
        worker.stop()
        pipe.close()
    assert submit_ms < reply.timing.compute_ms[0] + SLOW / 2  # stage 0's work, not the link's
    hops = reply.timing.hops
    assert [SLOW * 0.9 <= h.network_ms < SLOW * 1.5 for h in hops] == [True, True], hops
    # the wait is network, not queueing: polls that restarted the coordinator's "ready"
    # stamp would turn nearly all of the last hop's delay into queue time
    assert all(h.queue_ms < SLOW / 2 for h in hops), hops
