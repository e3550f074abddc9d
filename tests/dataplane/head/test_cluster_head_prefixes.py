"""Prefix entries across a chain: the cluster head (stage 0 here, stage 1 a worker in a
thread) saves and loads them in order with the steps, and a worker that cannot apply a
PREFIX frame says so on the stream's next step instead of computing on KV it lacks."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from dataplane.head.cluster_head import ClusterHead
from dataplane.head.errors import DataPlaneError, StageFailed
from dataplane.head.local_chain import LocalChain
from dataplane.runtime.base import StageError
from dataplane.runtime.stateful import StageRunner
from dataplane.wire.frames import HiddenStateFrame, Kind, decode_frame, encode_frame, stamp
from dataplane.wire.prefix_ops import PrefixOp, prefix_payload
from dataplane.wire.transport import PipeOptions, bound_endpoint, pull_socket, push_socket
from dataplane.worker.stage_worker import StageWorker
from tests.helpers.prefixes import EXACT, MORE, P, Q, assert_same_continuation, logits, run_on, scratch
from zctl.engine.executor import Step

EPOCH = 1000


def _chain(export: Path, options: PipeOptions = PipeOptions()):  # noqa: ANN202, B008
    pipe = ClusterHead(StageRunner(export, 0, EXACT), "tcp://127.0.0.1:1", "tcp://127.0.0.1:*",
                       timeout_s=10, options=options)
    worker = StageWorker(StageRunner(export, 1, EXACT), "tcp://127.0.0.1:*", pipe.reply_endpoint)
    pipe.rewire(worker.endpoint)
    worker.start()
    return pipe, worker


@pytest.fixture
def exact2(dp_export2: Path):
    """dp_threaded2 with f32 KV, so copied KV is bit for bit the stream's."""
    pipe, worker = _chain(dp_export2, PipeOptions(send_timeout_ms=200))
    yield pipe, worker
    worker.stop()
    pipe.close()


def settled(worker: StageWorker, **counts: int):  # noqa: ANN202
    """The worker's stats once its counters reach ``counts`` (frames without an answer)."""
    deadline = time.monotonic() + 5
    while any(getattr(worker.stats(), k) < v for k, v in counts.items()) \
            and time.monotonic() < deadline:
        time.sleep(0.005)
    return worker.stats()


@pytest.mark.parametrize("save_take, load_take, length", [
    (False, False, len(P)), (False, True, 6), (True, False, 6), (True, True, len(P))])
def test_a_loaded_prefix_continues_like_a_full_prefill(exact2, save_take: bool, load_take: bool,
                                                       length: int) -> None:
    pipe, worker = exact2
    want = scratch(pipe, 9, P + MORE, len(P) - length + len(MORE))
    pipe.open(1)
    pipe.reset(1)
    logits(pipe, 1, P, 0)
    logits(pipe, 1, [5, 6], len(P))
    pipe.save_prefix(1, 7, len(P), take=save_take)
    if save_take:  # closed on every stage
        with pytest.raises(DataPlaneError, match="not open"):
            pipe.submit(Step(1, np.array([1]), np.array([len(P) + 2])))
    pipe.open(2)
    pipe.reset(2)
    pipe.load_prefix(2, 7, length, take=load_take)
    got = run_on(pipe, 2, P[length:] + MORE, length)
    assert_same_continuation(got, want)
    assert (1 in worker.runner.streams) != save_take
    stats = worker.stats()
    assert (stats.prefix_saves, stats.prefix_loads, stats.prefix_failures) == (1, 1, 0)
    held = (pipe.prefix_bytes()[0], worker.prefix_bytes())
    assert (held == (0, 0)) if load_take else all(held)
    local = LocalChain.load(str(pipe.stage0.export_dir), EXACT)  # the same as in process
    assert_same_continuation(got, scratch(local, 0, P + MORE, len(P) - length + len(MORE)))


def test_rows_of_a_group_and_rewound_streams_as_sources(exact2) -> None:
    pipe, worker = exact2
    gid = 1 << 30
    for sid, prompt in ((1, P), (2, Q)):
        pipe.open(sid)
        pipe.reset(sid)
        logits(pipe, sid, prompt, 0)
    pipe.regroup(gid, [1, 2])
    reply = pipe.step(gid, np.array([5, 6]), np.array([len(P), len(Q)]))
    source = [*Q, 6, int(reply.tokens[1])]
    pipe.step(gid, np.array([int(reply.tokens[0]), source[-1]]), np.array([len(P) + 1, len(Q) + 1]))
    pipe.save_prefix(2, 3, len(source))  # a row: the frame carries the group's epoch
    with pytest.raises(StageError, match="row of row group"):
        pipe.save_prefix(2, 4, 3, take=True)
    with pytest.raises(DataPlaneError, match="row of row group"):
        pipe.load_prefix(1, 3, 3)
    # a stream with a rejected draft masked in the middle of its KV
    pipe.open(4)
    pipe.reset(4)
    logits(pipe, 4, P[:5], 0)
    logits(pipe, 4, [300, 301, 302], 5)
    pipe.step(4, np.array(P[5:]), np.arange(5, len(P)), mask_tail=3)
    assert worker.runner.masked_slots(4) == 3  # (its answer came: the worker applied it)
    pipe.save_prefix(4, 5, len(P))
    for sid, entry, length, tol in ((5, 3, len(source), {"atol": 1e-4}), (6, 5, len(P), None)):
        tokens = source if entry == 3 else P
        want = scratch(pipe, 9, tokens + MORE, len(MORE))
        pipe.open(sid)
        pipe.reset(sid)
        pipe.load_prefix(sid, entry, length)
        # the row's KV was computed batched, the reference's alone: equal up to rounding
        assert_same_continuation(run_on(pipe, sid, MORE, length), want, tol)
    assert worker.stats().prefix_saves == 2 and worker.stats().prefix_failures == 0


def test_bad_loads_fail_at_the_stage_that_cannot_apply_them(exact2) -> None:
    pipe, worker = exact2
    pipe.open(1)
    pipe.reset(1)
    logits(pipe, 1, P, 0)
    pipe.save_prefix(1, 1, len(P))
    pipe.open(2)
    pipe.reset(2)
    with pytest.raises(StageError, match="prefix entry 9 does not exist on stage 0"):
        pipe.load_prefix(2, 9, 3)
    with pytest.raises(StageError, match="holds 10 tokens on stage 0: cannot load 11"):
        pipe.load_prefix(2, 1, len(P) + 1)
    with pytest.raises(DataPlaneError, match="stream 8 is not open"):
        pipe.load_prefix(8, 1, 3)
    with pytest.raises(StageError, match="stream 1 holds 10 tokens on stage 0: cannot save"):
        pipe.save_prefix(1, 1, len(P) + 1)  # and the entry of that id is gone everywhere
    stats = settled(worker, prefix_drops=1)
    assert stats.prefix_loads == 0 and not worker.runner.prefixes.entries
    pipe.save_prefix(1, 1, len(P))
    logits(pipe, 1, [4], len(P))  # (a step behind it: the worker has the entry now)
    worker.runner.drop_prefix(1)  # stage 1 loses it (as a restarted node would)
    pipe.load_prefix(2, 1, 6)  # stage 0 has it
    start = time.monotonic()
    with pytest.raises(StageFailed, match="failed at stage 1: loading prefix entry 1 \\(6 tokens\\) "
                       "into stream 2 failed: prefix entry 1 does not exist on stage 1"):
        pipe.step(2, np.array(P[6:]), np.arange(6, len(P)))
    assert time.monotonic() - start < pipe.timeout_s / 2
    assert worker.alive and worker.stats().prefix_failures == 1
    # every other stream steps on, correctly; the failed one after a reset
    local = LocalChain.load(str(pipe.stage0.export_dir), EXACT)  # the same steps in process
    local.open(0)
    for ids, start in ((P, 0), ([4], len(P))):
        logits(local, 0, ids, start)
    np.testing.assert_array_equal(logits(pipe, 1, [7], len(P) + 1),
                                  logits(local, 0, [7], len(P) + 1))
    pipe.reset(2)
    assert logits(pipe, 2, P, 0).shape == (len(P), 384)


def test_drops_free_every_stage_and_survive_a_broken_chain(exact2) -> None:
    pipe, worker = exact2
    pipe.open(1)
    pipe.reset(1)
    logits(pipe, 1, P, 0)
    for entry in (1, 2, 3):
        pipe.save_prefix(1, entry, 3 + entry)
    logits(pipe, 1, [4], len(P))
    per_token = pipe.stage0.kv_bytes_per_token
    assert pipe.prefix_bytes() == {0: 15 * per_token}
    assert worker.prefix_bytes() == 15 * worker.runner.kv_bytes_per_token
    pipe.drop_prefix(2)
    pipe.drop_prefix(99)
    assert pipe.prefix_bytes() == {0: 10 * per_token}  # 4 + 6 tokens left
    settled(worker, prefix_drops=2)
    assert sorted(worker.runner.prefixes.entries) == [1, 3]
    pipe.rewire("tcp://127.0.0.1:1")  # nobody there: the chain is broken
    pipe.drop_all_prefixes()  # does not raise: the drop waits for the chain
    assert pipe.prefix_bytes() == {0: 0} and sorted(worker.runner.prefixes.entries) == [1, 3]
    pipe.rewire(worker.endpoint)
    pipe.reset(1)
    logits(pipe, 1, P, 0)
    pipe.save_prefix(1, 4, 5)  # sent after the DROP_ALL it waited for
    logits(pipe, 1, [4], len(P))
    assert sorted(worker.runner.prefixes.entries) == [4]
    pipe.rewire(worker.endpoint)
    with pytest.raises(DataPlaneError, match="must be reset: the pipeline was rewired"):
        pipe.save_prefix(1, 5, 5)  # a stream whose KV may differ across stages


class Coordinator:
    """A hand-driven stage 0: PUSH frames to a worker, PULL what comes back."""

    def __init__(self) -> None:
        ctx = zmq.Context.instance()
        self.pull = pull_socket(ctx, "tcp://127.0.0.1:*")
        self.reply_addr = bound_endpoint(self.pull)
        self.push: zmq.Socket | None = None

    def send(self, header: HiddenStateFrame, payload: np.ndarray | None = None) -> None:
        assert self.push is not None
        self.push.send_multipart(encode_frame(header, payload))

    def prefix(self, stream: int, op: PrefixOp, entry: int, length: int = 0,
               epoch: int = EPOCH, payload_stream: int | None = None) -> None:
        self.send(HiddenStateFrame(Kind.PREFIX, stream, 0, epoch), prefix_payload(
            op, entry, length, False, stream if payload_stream is None else payload_stream))

    def recv(self) -> tuple[HiddenStateFrame, np.ndarray | None]:
        assert self.pull.poll(5000), "no answer"
        return decode_frame(self.pull.recv_multipart(copy=False))

    def close(self) -> None:
        self.pull.close(0)
        if self.push is not None:
            self.push.close(0)


def test_a_worker_refuses_what_it_cannot_apply_and_serves_on(dp_export2: Path) -> None:
    coord = Coordinator()
    worker = StageWorker(StageRunner(dp_export2, 1, EXACT), "tcp://127.0.0.1:*", coord.reply_addr)
    coord.push = push_socket(zmq.Context.instance(), worker.endpoint)
    worker.start()
    first, ref = StageRunner(dp_export2, 0, EXACT), StageRunner(dp_export2, 1, EXACT)
    steps: dict[int, int] = {}

    def step(sid: int, ids: list[int], start: int) -> tuple[HiddenStateFrame, np.ndarray | None]:
        first.open_stream(sid)
        pos = np.arange(start, start + len(ids))
        x = first.step(sid, np.array([ids]), pos).copy()
        header = HiddenStateFrame(Kind.STEP, sid, 10 + sid, EPOCH, steps.get(sid, 0), pos,
                                  timings=stamp(b"", 0, 1, 1, 2, 0, 5, 0))
        steps[sid] = steps.get(sid, 0) + 1
        coord.send(header, x)
        return coord.recv()

    try:
        coord.send(HiddenStateFrame(Kind.RESET, 1, 0, EPOCH))
        assert step(1, P, 0)[0].kind == Kind.REPLY
        coord.prefix(1, PrefixOp.SAVE, 1, len(P))
        coord.prefix(1, PrefixOp.SAVE, 2, len(P) + 5)  # more than the stream holds: no entry 2
        coord.prefix(1, PrefixOp.SAVE, 3, 2, epoch=EPOCH - 1)  # of an older epoch: stale
        for sid, entry, length in ((2, 1, len(P) + 1), (3, 2, 4)):
            coord.send(HiddenStateFrame(Kind.RESET, sid, 0, EPOCH))
            coord.prefix(sid, PrefixOp.LOAD, entry, length)
        # a LOAD whose RESET never came resets the stream and loads (stage 0 does the same)
        coord.prefix(4, PrefixOp.LOAD, 1, 6)
        first.save_prefix(1, 1, len(P))
        first.open_stream(4)
        first.load_prefix(4, 1, 6)
        failed = {sid: step(sid, [5], length)[0] for sid, length in ((2, len(P) + 1), (3, 4))}
        assert failed[2].kind == failed[3].kind == Kind.ERROR
        assert failed[2].error == ("stage 1: loading prefix entry 1 (11 tokens) into stream 2 "
                                   "failed: prefix entry 1 holds 10 tokens on stage 1: cannot "
                                   "load 11")
        assert "prefix entry 2 does not exist on stage 1" in failed[3].error
        reply, payload = step(4, P[6:], 6)
        first.open_stream(99)
        ref.open_stream(4)
        want = ref.step(4, first.step(99, np.array([P]), np.arange(len(P))).copy(),
                        np.arange(len(P)))[0, -1]
        assert reply.kind == Kind.REPLY and int(payload["token"][0, 0]) == int(want.argmax())
        assert abs(float(payload["logit"][0, 0]) - float(want.max())) < 1e-5
        stats = worker.stats()
        assert (stats.prefix_saves, stats.prefix_loads, stats.prefix_failures) == (1, 1, 3)
        assert stats.stale == 1 and stats.implicit_resets == 1
        assert sorted(worker.runner.prefixes.entries) == [1]
        # malformed PREFIX frames: dropped and counted; one naming stream 1 refuses its steps
        coord.send(HiddenStateFrame(Kind.PREFIX, 1, 0, EPOCH), np.zeros(5, np.float32))
        coord.send(HiddenStateFrame(Kind.PREFIX, 0, 0, 0), np.zeros(4, np.int64))
        coord.send(HiddenStateFrame(Kind.PREFIX, 0, 0, 0), np.array([9, 0, 0, 0, -1], np.int64))
        refused, _ = step(1, [7], len(P))
        assert refused.kind == Kind.ERROR and "a PREFIX frame for it was malformed" in refused.error
        assert worker.stats().malformed == 3 and not worker.runner.prefixes.entries
        coord.send(HiddenStateFrame(Kind.RESET, 5, 0, EPOCH))
        assert step(5, Q, 0)[0].kind == Kind.REPLY and worker.alive  # others step on
    finally:
        worker.stop()
        coord.close()
