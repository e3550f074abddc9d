"""Helpers for driving a StageWorker frame by frame: a hand-driven coordinator end, STEP
and CANCEL frames as stage 0 would send them, and a worker whose frames wait in its pipe
(the ``last_stage`` fixture is in conftest)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import zmq

from dataplane.head.cluster_head import ClusterHead
from dataplane.runtime.base import StageRuntime
from dataplane.runtime.stateful import StageRunner
from dataplane.wire.cancels import cancel_payload
from dataplane.wire.frames import HiddenStateFrame, Kind, ReplyMode, decode_frame, encode_frame, stamp
from dataplane.wire.transport import bound_endpoint, pull_socket, push_socket
from dataplane.worker.stage_worker import StageWorker

EPOCH = 1000


@contextmanager
def head_and_worker(stage0: StageRuntime, rest: StageRuntime
                    ) -> Iterator[tuple[ClusterHead, StageWorker]]:
    """A cluster head running ``stage0`` and a worker running ``rest`` (the later stages)
    in a thread, wired to each other; both stopped afterwards."""
    head = ClusterHead(stage0, "tcp://127.0.0.1:1", "tcp://127.0.0.1:*", timeout_s=10)
    worker = StageWorker(rest, "tcp://127.0.0.1:*", head.reply_endpoint)
    head.rewire(worker.endpoint)
    worker.start()
    try:
        yield head, worker
    finally:
        worker.stop()
        head.close()


class Coordinator:
    """A hand-driven coordinator end: PUSH frames to a worker, PULL what comes back."""

    def __init__(self, target: str) -> None:
        ctx = zmq.Context.instance()
        self.pull = pull_socket(ctx, "tcp://127.0.0.1:*")
        self.reply_addr = bound_endpoint(self.pull)
        self.push = push_socket(ctx, target) if target else None

    def send_parts(self, parts: list) -> None:
        assert self.push is not None
        self.push.send_multipart(parts)

    def send(self, header: HiddenStateFrame, payload: np.ndarray | None = None) -> None:
        self.send_parts(encode_frame(header, payload))

    def recv(self, timeout_s: float = 5.0):
        if not self.pull.poll(int(timeout_s * 1000)):
            return None
        return decode_frame(self.pull.recv_multipart(copy=False))

    def close(self) -> None:
        self.pull.close(0)
        if self.push is not None:
            self.push.close(0)


def settled(worker: StageWorker, frames_out: int, timeout_s: float = 5.0):
    """The worker's stats once it has counted ``frames_out`` frames sent and the compute time
    of each step: its loop counts them just after the send, so an answer can come first."""
    deadline = time.monotonic() + timeout_s
    stats = worker.stats()
    while (stats.frames_out < frames_out or len(stats.compute_ms) < stats.steps) \
            and time.monotonic() < deadline:
        time.sleep(0.005)
        stats = worker.stats()
    return stats


def step(stream: int, x: np.ndarray, positions, *, step_no: int = 0, epoch: int = EPOCH,
         reply: ReplyMode = ReplyMode.TOP1, top_k: int = 1, mask_tail: int = 0,
         request_id: int = 1, logits_idx=()) -> list:
    """The encoded parts of a STEP frame as stage 0 would send it."""
    header = HiddenStateFrame(kind=Kind.STEP, stream_id=stream, request_id=request_id,
                              epoch=epoch, step=step_no, positions=np.asarray(positions),
                              logits_idx=np.asarray(logits_idx, dtype=np.int64), reply=reply,
                              top_k=top_k, mask_tail=mask_tail,
                              timings=stamp(b"", 0, 1, 1, 2, 0, 5, 0))
    return encode_frame(header, x)


def hidden_for(first: StageRunner, ids: list[int], positions) -> np.ndarray:
    return first.step(0, np.array([ids]), np.asarray(positions)).copy()


def cancel(first: int, last: int, keep: int, stream: int = 0, epoch: int = EPOCH) -> list:
    return encode_frame(HiddenStateFrame(Kind.CANCEL, stream, 0, epoch),
                        cancel_payload(first, last, keep))


def fed_step(x: np.ndarray, positions, fed: list[int], guessed: bool = False, step_no: int = 0,
             request_id: int = 1, reply: ReplyMode = ReplyMode.TOP1) -> list:
    """A pipelined run's STEP frame: it carries its fed tokens (which also makes the stages
    look ahead for cancels before computing the stream's steps)."""
    parts = step(0, x, positions, step_no=step_no, request_id=request_id, reply=reply)
    header, payload = decode_frame(parts)
    header.fed, header.guessed = np.asarray(fed, np.int64), guessed
    return encode_frame(header, np.array(payload))


def queued_worker(export, stage: int, send_to: str) -> tuple[StageWorker, object]:
    """A worker not started yet, and a PUSH to it: frames sent now wait in its pipe."""
    worker = StageWorker(StageRunner(export, stage), "tcp://127.0.0.1:*", send_to)
    return worker, push_socket(zmq.Context.instance(), worker.endpoint)


def reference_logits(ref: StageRunner, x: np.ndarray, positions) -> np.ndarray:
    return ref.step(0, x, np.asarray(positions))[0]
