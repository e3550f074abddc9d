"""A link's probe: an echo every node keeps, and the round trips one node times to another.

Every node (and the coordinator) binds a small ROUTER, its probe endpoint, beside its
data pipe, and answers each request ``[reply size (u32), payload]`` with that many bytes.
To measure the link from ``a`` to ``b``, ``a`` times round trips to ``b``'s echo: the
smallest messages both ways (the round trip), frames of each probed size sent with a small
answer (``a`` to ``b``), and small requests answered with each size (``b`` to ``a``), in
turns, ``rounds`` times over, ``PINGS`` of the smallest round trips a round each after an
idle gap of ``IDLE_GAP_S``: a pipeline's receiver has waited idle for the step before it and must be
woken when its frame comes (on a VM, an idle vCPU's wake-up; its sockets' I/O threads
too), which round trips back to back, both ends awake, never see. The gap is as long as a
real model's stage step, not just past the vCPU's halt polling: the wake-up keeps growing
with the idle time up to some 10 ms (an AMD EPYC (Zen 4) VM, 2 vCPUs, loopback, the echo
on the other vCPU, 2026-12-07: half round trips' lower quartile 0.08-0.10 ms after 2 ms
idle, 0.13 after 5 ms, 0.19-0.21 after 10 ms and 0.20-0.21 after 20 ms). Each idle
round trip is followed at once by an awake one (both ends just woken): of an idle round
trip only the way out meets an idle receiver, the answer comes back to a prober that has
just sent, so half of it is no pipeline hop's time; a hop's is the idle round trip less
half an awake one (controlplane/planner/measured.py). The sized
round trips follow one another without a gap: their bandwidth is the slope of time over
size, which a wake-up in each would only make noisy. controlplane/planner/measured.py
makes the figures. The
sizes are the frames the model sends between stages (hidden states of 1 and 8 rows, a
prompt's chunk). An echo refuses to answer with more than ``MAX_PROBE_BYTES``.

A probe must not take the link from the traffic it shares it with (the data frames, and
the heartbeats that keep a node alive): a size whose round trip would hold the link more
than ``MESSAGE_BUDGET_S`` beyond the smallest one, by the slowest rate seen that way so
far, is not sent (nor any larger one that way). Sizes go smallest first, each at most
``LADDER_STEP`` times the one before (sizes are put in between where the model's frames
are further apart), so no size is sent on a rate guessed from a far smaller one: a slow
link is measured with the frames it can carry quickly and a fast one with all of them.
Rounds after the first start only while the probe has taken less than
``PROBE_TIME_BUDGET_S``: a fast link gets every round in milliseconds, a slow one (where
each round holds it longest) as few as one.

A process whose data frames go over an emulated link (``--link-delay-ms`` and the like,
dataplane/wire/link.py) holds its probe messages as long as that link would hold a lone
frame of their size before it sends them, so that a probe sees the link the data sees.
"""

from __future__ import annotations

import logging
import random
import struct
import threading
import time
from collections.abc import Iterator, Sequence

import zmq

from controlplane.planner.measured import LinkSample
from controlplane.sockets import dealer_socket, router_socket
from dataplane.wire.link import path_free
from dataplane.wire.transport import PipeOptions

log = logging.getLogger("zctl.controlplane")
HEADER = struct.Struct("<I")  # the reply's size in bytes
SMALL = HEADER.size  # the smallest message: a header alone, or a reply of as many bytes
MAX_PROBE_BYTES = 8 << 20
MESSAGE_BUDGET_S = 0.25  # the longest one probe message may hold the link
LADDER_STEP = 4  # a probed size is at most this many times the one before it
PROBE_TIME_BUDGET_S = 1.0  # a round after the first starts only before this much time
POLL_MS = 100
IDLE_GAP_S = 0.010  # the pause before an idle round trip: as long as a stage's step
PINGS = 3  # idle round trips a round, each followed by an awake one (their medians count)


class ProbeError(RuntimeError):
    """A probe could not time its round trips (the peer did not answer in time)."""


class ProbeStopped(ProbeError):
    """A probe was stopped before it finished (its process is stopping)."""


def emulated_s(link: PipeOptions | None, nbytes: int, rng: random.Random) -> float:
    """How long an emulated link holds a lone frame of ``nbytes`` before it arrives: its
    serialisation over each leg (relays store and forward), the relays' own delays, the
    one-way delay and the jitter (0 without a link)."""
    if link is None:
        return 0.0
    serialise = 8 * nbytes / (link.rate_mbit * 1e6) if link.rate_mbit else 0.0
    legs = path_free((0.0,) * (1 + link.relays), 0.0, serialise, link.relay_delay_ms / 1e3)
    return legs[-1] + link.delay_ms / 1e3 + rng.uniform(0.0, link.jitter_ms / 1e3)


class ProbeEcho:
    """The echo a node's links are probed against, on a thread of its own."""

    def __init__(self, ctx: zmq.Context, host: str, link: PipeOptions | None = None) -> None:
        self.link = link
        self._rng = random.Random()
        self._sock = router_socket(ctx, MAX_PROBE_BYTES + HEADER.size)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.answered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zctl-probe-echo", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        zeros = bytes(MAX_PROBE_BYTES)
        try:
            while not self._stop.is_set():
                if not poller.poll(POLL_MS):
                    continue
                frames = self._sock.recv_multipart(copy=False)
                if len(frames) != 2 or len(frames[1].buffer) < HEADER.size:
                    continue  # not a probe: ignored
                (size,) = HEADER.unpack_from(frames[1].buffer)
                if size > MAX_PROBE_BYTES:
                    continue
                hold = emulated_s(self.link, size, self._rng)
                if hold:
                    time.sleep(hold)
                try:
                    self._sock.send_multipart([frames[0], memoryview(zeros)[:size]], zmq.NOBLOCK)
                    self.answered += 1
                except zmq.ZMQError:  # the prober went away
                    pass
        finally:
            self._sock.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def ladder(sizes: Sequence[int], step: int = LADDER_STEP) -> list[int]:
    """``sizes`` in order, with sizes put in between so that each is at most ``step``
    times the one before (the smallest is kept as it is)."""
    out: list[int] = []
    for size in sorted(set(sizes)):
        while out and size > out[-1] * step:
            out.append(out[-1] * step)
        out.append(size)
    return out


def affordable(samples: Sequence[LinkSample], out: int, back: int,
               budget_s: float = MESSAGE_BUDGET_S) -> bool:
    """Whether a round trip of ``out`` bytes out and ``back`` bytes back is expected to hold
    the link at most ``budget_s`` beyond the smallest round trip: by the slowest rate seen
    so far on the way that carries the bytes (a way with no figure yet is tried)."""
    pings = [s.seconds for s in samples if s.out == SMALL and s.back == SMALL]
    if not pings or (out == SMALL and back == SMALL):
        return True
    rtt = min(pings)
    if out > SMALL:  # bytes out: the rates of the round trips that carried bytes out
        size, rates = out, [s.out / max(s.seconds - rtt, 1e-9) for s in samples
                            if s.out > SMALL and s.back == SMALL]
    else:
        size, rates = back, [s.back / max(s.seconds - rtt, 1e-9) for s in samples
                             if s.back > SMALL and s.out == SMALL]
    return not rates or size / min(rates) <= budget_s


def _round_trips(plan: list[tuple[int, int, bool]], rounds: int, begun: float,
                 time_budget_s: float) -> Iterator[tuple[int, int, bool]]:
    """The connection's round trip, then ``rounds`` times the plan (each round trip's bytes
    out, bytes back, and whether it follows an idle gap), a round after the first starting
    only within ``time_budget_s`` of ``begun``."""
    yield SMALL, SMALL, True
    for done in range(max(1, rounds)):
        if done and time.monotonic() - begun >= time_budget_s:
            return
        yield from plan


def _answered(sock: zmq.Socket, timeout_s: float, stop: threading.Event) -> bool:
    """Whether ``sock`` has an answer within ``timeout_s``, waiting in slices of at most
    ``POLL_MS`` so that ``stop`` ends the wait within one (ProbeStopped)."""
    until = time.monotonic() + timeout_s
    while not stop.is_set():
        left = until - time.monotonic()
        if sock.poll(max(0, min(POLL_MS, int(left * 1000)))):
            return True
        if left <= 0:
            return False
    raise ProbeStopped("the probe was stopped")


def probe(ctx: zmq.Context, endpoint: str, sizes: Sequence[int], rounds: int,
          timeout_s: float, link: PipeOptions | None = None,
          budget_s: float = MESSAGE_BUDGET_S,
          time_budget_s: float = PROBE_TIME_BUDGET_S,
          idle_gap_s: float = IDLE_GAP_S,
          stop: threading.Event | None = None) -> list[LinkSample]:
    """Time round trips to the echo at ``endpoint`` (module docstring; ``link``: this
    process's emulated link; ``budget_s``: the longest one message may hold the link; a
    round after the first starts only within ``time_budget_s`` of the start);
    ProbeError when a round trip is not answered within ``timeout_s`` seconds, or the whole
    probe takes longer than ``rounds`` times that (``idle_gap_s``: the pause before each
    idle round trip, not timed; an awake one follows it at once). ``stop``, once set, ends
    the probe within ``POLL_MS`` with ProbeStopped, however long it would still wait for an
    answer or hold a frame."""
    stop = stop or threading.Event()
    rng = random.Random()
    sizes = ladder([s for s in sizes if SMALL < s <= MAX_PROBE_BYTES])
    if not sizes:
        raise ProbeError(f"no frame size to probe between {SMALL} and {MAX_PROBE_BYTES} bytes")
    sock = dealer_socket(ctx, MAX_PROBE_BYTES + HEADER.size)
    sock.connect(endpoint)
    payloads = {size: bytes(size) for size in sizes}
    plan = ([(SMALL, SMALL, True), (SMALL, SMALL, False)] * PINGS
            + [(s, SMALL, False) for s in sizes] + [(SMALL, s, False) for s in sizes])
    samples: list[LinkSample] = []
    skipped: set[tuple[int, int]] = set()
    begun = time.monotonic()
    deadline = begun + timeout_s * max(1, rounds)
    try:
        for out, back, idle in _round_trips(plan, rounds, begun, time_budget_s):
            if stop.is_set():
                raise ProbeStopped(f"the probe of {endpoint} was stopped")
            if (out, back) in skipped:
                continue
            if not affordable(samples[1:], out, back, budget_s):
                forward = out > SMALL
                skipped.update((s, SMALL) if forward else (SMALL, s) for s in sizes
                               if s >= (out if forward else back))
                log.debug("probe of %s: frames of %d bytes and more %s not sent (the link "
                          "is too slow for them)", endpoint, max(out, back),
                          "out" if forward else "back")
                continue
            body = HEADER.pack(back) + (payloads[out][HEADER.size:] if out > SMALL else b"")
            if idle:
                time.sleep(idle_gap_s)  # the echo goes idle, as a pipeline's receiver does
            start = time.perf_counter()
            hold = emulated_s(link, len(body), rng)
            if hold and stop.wait(hold):
                raise ProbeStopped(f"the probe of {endpoint} was stopped")
            sock.send(body)
            if not _answered(sock, timeout_s, stop) or time.monotonic() > deadline:
                raise ProbeError(f"the probe of {endpoint} was not answered within "
                                 f"{timeout_s:g} s")
            reply = sock.recv(copy=False)
            seconds = time.perf_counter() - start
            if len(reply.buffer) != back:
                raise ProbeError(f"{endpoint} answered {len(reply.buffer)} bytes, not {back}")
            samples.append(LinkSample(len(body), back, seconds, idle))
    finally:
        sock.close(0)
    return samples[1:]
