"""A link's probe: the echo answers with the size asked for (and nothing else), the probe
times each size both ways, an emulated link is probed as its data frames go, a peer
that does not answer is a clear error, and a probe stops when told to."""

from __future__ import annotations

import random
import threading
import time

import pytest
import zmq

import controlplane.link_probe as link_probe
from controlplane.link_probe import (
    HEADER,
    MAX_PROBE_BYTES,
    SMALL,
    ProbeEcho,
    ProbeError,
    ProbeStopped,
    affordable,
    emulated_s,
    ladder,
    probe,
)
from controlplane.planner.measured import LinkSample, link_from_samples
from dataplane.wire.link import link_options


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.term()


def test_a_probe_times_each_size_both_ways(ctx: zmq.Context) -> None:
    echo = ProbeEcho(ctx, "127.0.0.1")
    try:
        # Budgets past any stall a loaded host makes: this test is of what is sent, and the
        # budgets' own tests are below.
        samples = probe(ctx, echo.endpoint, [1000, 100_000], rounds=2, timeout_s=5.0,
                        budget_s=60.0, time_budget_s=60.0)
    finally:
        echo.close()
    kinds = {(s.out, s.back) for s in samples}
    sizes = ladder([1000, 100_000])  # 1000, 4000, 16000, 64000, 100000
    assert kinds == {(SMALL, SMALL)} | {(n, SMALL) for n in sizes} | {(SMALL, n) for n in sizes}
    assert len(samples) == 2 * (2 * link_probe.PINGS + 10) and all(s.seconds > 0 for s in samples)
    link = link_from_samples(samples)
    assert link.rtt_s > 0 and link.forward_bps > 0 and link.backward_bps > 0


def test_an_emulated_link_is_probed_as_its_frames_go(ctx: zmq.Context) -> None:
    shaped = link_options(delay_ms=10.0)
    echo = ProbeEcho(ctx, "127.0.0.1", shaped)
    try:
        link = link_from_samples(probe(ctx, echo.endpoint, [2000], 2, 5.0, shaped))
    finally:
        echo.close()
    assert link.rtt_s >= 0.020  # 10 ms each way
    rate = link_options(rate_mbit=8.0, relays=1)  # 1 MB/s, one store-and-forward relay
    assert emulated_s(rate, 1000, random.Random()) == pytest.approx(2 * 1000 / 1e6)
    assert emulated_s(None, 10**6, random.Random()) == 0.0


def test_the_echo_ignores_what_is_not_a_probe_and_the_oversized(ctx: zmq.Context) -> None:
    echo = ProbeEcho(ctx, "127.0.0.1")
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(echo.endpoint)
    try:
        sock.send(b"xy")  # too short to say a size
        sock.send(HEADER.pack(MAX_PROBE_BYTES + 1))
        assert not sock.poll(300)
        sock.send(HEADER.pack(16))
        assert sock.poll(3000) and len(sock.recv()) == 16
        deadline = time.monotonic() + 3  # the echo counts its answer after sending it
        while echo.answered < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert echo.answered == 1
    finally:
        sock.close(0)
        echo.close()


def test_a_peer_that_does_not_answer_is_a_clear_error(ctx: zmq.Context) -> None:
    silent = ctx.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        start = time.monotonic()
        with pytest.raises(ProbeError, match="not answered within 0.2 s"):
            probe(ctx, f"tcp://127.0.0.1:{port}", [1000], rounds=3, timeout_s=0.2)
        assert time.monotonic() - start < 2.0
        with pytest.raises(ProbeError, match="no frame size"):
            probe(ctx, f"tcp://127.0.0.1:{port}", [MAX_PROBE_BYTES + 1], 1, 0.2)
    finally:
        silent.close(0)


def test_a_probe_waiting_on_a_silent_peer_ends_soon_after_it_is_stopped(ctx: zmq.Context
                                                                        ) -> None:
    silent = ctx.socket(zmq.ROUTER)
    peer = f"tcp://127.0.0.1:{silent.bind_to_random_port('tcp://127.0.0.1')}"
    stop, timeout_s = threading.Event(), 4.0
    try:
        stopped = threading.Event()
        stopped.set()
        with pytest.raises(ProbeStopped):  # stopped before it began: not a single wait
            probe(ctx, peer, [1000], 1, timeout_s, stop=stopped)
        assert not silent.poll(100)  # nothing was sent
        threading.Thread(target=lambda: silent.poll(5000) and stop.set(), daemon=True).start()
        started = time.monotonic()
        with pytest.raises(ProbeStopped, match="stopped"):
            probe(ctx, peer, [1000], rounds=1, timeout_s=timeout_s, stop=stop)
        assert (time.monotonic() - started) / timeout_s < 0.5
    finally:
        silent.close(0)


def test_a_slow_link_is_probed_only_with_the_frames_it_carries_quickly(ctx: zmq.Context
                                                                        ) -> None:
    """200 kbit/s (25 kB/s): 64 kB would hold the link 2.6 s, starving what shares it (the
    heartbeats among it); the probe measures it with the sizes within the budget."""
    slow = link_options(rate_mbit=0.2)
    echo = ProbeEcho(ctx, "127.0.0.1", slow)
    start = time.monotonic()
    try:
        samples = probe(ctx, echo.endpoint, [400, 2000, 64_000, 512_000], 2, 5.0, slow)
    finally:
        echo.close()
    assert time.monotonic() - start < 2.0
    assert {max(s.out, s.back) for s in samples} == {SMALL, 400, 1600, 2000}
    link = link_from_samples(samples)
    assert 15_000 < link.forward_bps < 30_000 and 15_000 < link.backward_bps < 30_000


def test_a_size_is_affordable_by_the_slowest_rate_seen_its_way() -> None:
    pings = [LinkSample(SMALL, SMALL, 0.001)]
    out = [LinkSample(1001, SMALL, 0.011)]  # 100 kB/s out
    assert affordable(pings, 1_000_000, SMALL)  # nothing seen that way yet: tried
    assert affordable(pings + out, 25_000, SMALL) and not affordable(pings + out, 26_000, SMALL)
    assert affordable(pings + out, SMALL, 1_000_000)  # the other way: no figure yet
    assert affordable([], 10**9, SMALL) and affordable(out, SMALL, SMALL)


def test_no_size_is_probed_on_a_rate_guessed_from_a_far_smaller_one() -> None:
    assert ladder([2304, 18432, 294912]) == [2304, 9216, 18432, 73728, 294912]
    assert ladder([100, 100, 300]) == [100, 300] and ladder([]) == []


def test_rounds_after_the_first_start_only_within_the_probe_s_time_budget(
        ctx: zmq.Context, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link_probe, "PINGS", 1)
    slow = link_options(delay_ms=50.0)  # 100 ms a round trip: the connection's and a
    # round's four end at >= 500 ms, a second round's at >= 900 ms
    echo = ProbeEcho(ctx, "127.0.0.1", slow)
    try:
        one = probe(ctx, echo.endpoint, [400], 5, 5.0, slow, time_budget_s=0.0)
        two = probe(ctx, echo.endpoint, [400], 5, 5.0, slow, time_budget_s=0.6)
        fast = probe(ctx, echo.endpoint, [400], 3, 5.0, None, time_budget_s=5.0)
    finally:
        echo.close()
    assert (len(one), len(two), len(fast)) == (4, 8, 12)


def test_each_smallest_round_trip_follows_an_idle_gap(ctx: zmq.Context,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # the echo goes idle before each idle ping, as a pipeline's receiver waits for a step: its
    # wake-up is in the round trip; the sized ones follow one another (their slope counts)
    gaps: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        gaps.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(link_probe.time, "sleep", sleep)
    echo = ProbeEcho(ctx, "127.0.0.1")
    try:
        samples = probe(ctx, echo.endpoint, [400], 2, 5.0, idle_gap_s=0.003)
    finally:
        echo.close()
    # each idle ping is followed by an awake one, the sized ones follow without a gap
    pings = link_probe.PINGS
    assert [s.idle for s in samples] == ([True, False] * pings + [False, False]) * 2
    assert gaps == [0.003] * (1 + 2 * pings)  # the connection's ping too


def test_by_default_the_echo_idles_as_long_as_a_stages_step(ctx: zmq.Context,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    # a receiver idle 2 ms wakes about twice as fast as one idle for a step of a real
    # model's stage (5-20 ms): the gap must not be the shorter

    gaps: list[float] = []
    monkeypatch.setattr(link_probe.time, "sleep", gaps.append)
    echo = ProbeEcho(ctx, "127.0.0.1")
    try:
        probe(ctx, echo.endpoint, [400], 1, 5.0)
    finally:
        echo.close()
    assert gaps == [link_probe.IDLE_GAP_S] * (1 + link_probe.PINGS)
    assert link_probe.IDLE_GAP_S >= 0.010
