"""The stages after stage 0 as the coordinator's thread meets them: real ZeroMQ sockets.

A ``LoopbackStages`` is a PUSH/PULL pair each way over the loopback interface, made as the
data plane makes its pipes (dataplane/wire/transport.py), and a thread that plays the later
stages: it reads each step's frame, waits as long as it is told (the later stages' step;
the caller's thread sleeps in the kernel meanwhile, as the cluster head does) and sends a
top-1 reply of each answered row. The calling thread's side is the head's: the step's frame
sent zero-copy with a tracker (the buffer guard released before the next send), the reply
waited for in the kernel (``wait_readable``) and read. What that costs the calling thread
(the sends and receives, its wake-ups after a wait) is what an in-process encode and decode
leaves out. One thread uses ``step``; ``close`` ends the responder.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import zmq

from dataplane.wire.frames import TOPK_DTYPE, HiddenStateFrame, Kind, decode_frame, encode_frame
from dataplane.wire.transport import (
    BufferGuard,
    TransportError,
    bound_endpoint,
    pull_socket,
    push_socket,
    recv_parts,
    send_parts,
    wait_readable,
)

LOOPBACK = "tcp://127.0.0.1:*"
SLICE_S = 0.05  # the responder's poll slice (it checks for ``close`` between slices)
REPLY_TIMEOUT_S = 10.0  # a step unanswered this long: the responder is gone


class LoopbackStages:
    """The later stages over real loopback sockets (module docstring)."""

    def __init__(self, vocab: int) -> None:
        if vocab < 2:
            raise ValueError(f"the stages answer tokens of a vocabulary of >= 2, got {vocab}")
        self.vocab = vocab
        self._ctx = zmq.Context()
        # each step's (wait, rows answered), in the order of the frames
        self._asks: queue.SimpleQueue[tuple[float, int]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._guard = BufferGuard()
        try:
            self._inbound = pull_socket(self._ctx, LOOPBACK)  # stage 1's
            self._replies = pull_socket(self._ctx, LOOPBACK)  # the head's reply pipe
            self._outbound = push_socket(self._ctx, bound_endpoint(self._inbound))
            self._answer = push_socket(self._ctx, bound_endpoint(self._replies))
        except TransportError:
            self._ctx.destroy(0)
            raise
        self._thread = threading.Thread(target=self._respond, name="zctl-loopback-stages",
                                        daemon=True)
        self._thread.start()

    def step(self, header: HiddenStateFrame, hidden: np.ndarray, answered: int,
             wait_s: float) -> np.ndarray:
        """Send the step's frame (``header``, ``hidden`` of [rows, tokens, channels], each
        row's token ids in channel 0), have the later stages answer ``answered`` positions
        after ``wait_s`` seconds (``reply``) and return the reply's top-1 tokens."""
        self._guard.release(header.stream_id)
        self._asks.put((max(0.0, wait_s), answered))
        parts = encode_frame(header, hidden)
        self._guard.hold(header.stream_id, send_parts(self._outbound, parts))
        if not wait_readable(self._replies, REPLY_TIMEOUT_S):
            raise TransportError(f"no reply over the loopback within {REPLY_TIMEOUT_S:g} s")
        back, payload = decode_frame(recv_parts(self._replies, zmq.NOBLOCK))
        if payload is None or back.kind != Kind.REPLY or len(payload) != answered:
            raise TransportError(f"the loopback stages answered {back.kind.name} of "
                                 f"{0 if payload is None else len(payload)} rows, not "
                                 f"{answered}")
        return payload["token"][:, 0].astype(np.int64)

    def _respond(self) -> None:
        try:
            while not self._stop.is_set():
                if not wait_readable(self._inbound, SLICE_S):
                    continue
                header, payload = decode_frame(recv_parts(self._inbound, zmq.NOBLOCK))
                assert payload is not None
                wait_s, answered = self._asks.get()
                time.sleep(wait_s)
                send_parts(self._answer, encode_frame(*reply(header, payload, answered,
                                                             self.vocab)))
        finally:
            self._inbound.close(0)
            self._answer.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._outbound.close(0)
        self._replies.close(0)
        self._ctx.term()

    def __enter__(self) -> LoopbackStages:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reply(header: HiddenStateFrame, hidden: np.ndarray, answered: int,
          vocab: int) -> tuple[HiddenStateFrame, np.ndarray]:
    """The later stages' top-1 reply to a step whose hidden states carry each row's fed
    token ids in their first channel: ``answered`` records (the rows' in turn, each
    repeated for its answered positions), each row's last token plus one modulo ``vocab``."""
    rows = hidden.shape[0]
    last = hidden[:, -1, 0].astype(np.int64)
    records = np.zeros((answered, 1), TOPK_DTYPE)
    records["token"][:, 0] = (np.repeat(last, answered // rows) + 1) % vocab
    back = HiddenStateFrame(Kind.REPLY, header.stream_id, header.request_id, header.epoch,
                            positions=header.positions, rows=rows)
    return back, records
