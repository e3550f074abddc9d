"""StageWorker in a thread, driven frame by frame by the test playing the coordinator."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from dataplane.runtime.stateful import StageRunner
from dataplane.wire.frames import (
    TOPK_DTYPE,
    HiddenStateFrame,
    Kind,
    ReplyMode,
    encode_frame,
    stamp,
    timing_records,
)
from dataplane.wire.reply_records import reply_payload
from dataplane.wire.transport import (
    BufferGuard,
    PipeOptions,
    TransportError,
    bound_endpoint,
    pull_socket,
    push_socket,
    recv_parts,
    send_parts,
)
from dataplane.worker.stage_worker import CONTROL_PREFIX, StageWorker, admit
from tests.helpers.worker import EPOCH, Coordinator, cancel, hidden_for, reference_logits, settled, step


def test_pure_helpers():
    assert admit(None, 5) == "new" and admit(4, 5) == "new"
    assert admit(5, 5) == "current" and admit(6, 5) == "stale"
    logits = np.random.default_rng(0).standard_normal((1, 2, 30)).astype(np.float32)
    assert reply_payload(logits, ReplyMode.TOP1, 1)["token"][:, 0].tolist() == \
        logits[0].argmax(-1).tolist()
    assert reply_payload(logits, ReplyMode.TOPK, 3).shape == (2, 3)
    assert np.shares_memory(reply_payload(logits, ReplyMode.LOGITS, 1), logits)


def test_last_stage_answers_like_a_local_runner(last_stage):
    worker, coord, first, ref = last_stage
    x = hidden_for(first, [1, 2, 3], [0, 1, 2])
    coord.send_parts(step(0, x, [0, 1, 2]))
    header, payload = coord.recv()
    expect = ref.step(0, x, np.arange(3))[0, -1]
    assert header.kind == Kind.REPLY and header.source_stage == 1
    assert payload["token"][0, 0] == expect.argmax()
    assert payload["logit"][0, 0] == pytest.approx(expect.max())
    records = timing_records(header.timings)
    assert records["stage"].tolist() == [0, 1] and records["compute_ns"][1] > 0
    assert records["send_ns"][1] >= records["recv_ns"][1]
    # idle, the worker binds the likely next step's inputs (one token at position 3)
    deadline = time.monotonic() + 5
    while worker.runner.streams[0].prefetched is None and time.monotonic() < deadline:
        time.sleep(0.01)
    guess = worker.runner.streams[0].prefetched
    assert guess is not None and guess.positions.tolist() == [[3]]
    # next decode step, full logits: it runs on the prefetched inputs
    x = hidden_for(first, [4], [3])
    coord.send_parts(step(0, x, [3], step_no=1, reply=ReplyMode.LOGITS))
    header, payload = coord.recv()
    assert np.array_equal(payload, ref.step(0, x, np.array([3]))[0])
    assert worker.runner.streams[0].last is guess
    stats = settled(worker, frames_out=2)
    assert stats.steps == 2 and stats.frames_out == 2 and len(stats.compute_ms) == 2


def test_top_k_and_several_answer_positions(last_stage):
    _, coord, first, ref = last_stage
    x = hidden_for(first, [5, 6, 7, 8], np.arange(4))
    coord.send_parts(step(0, x, np.arange(4), reply=ReplyMode.TOPK, top_k=3, logits_idx=[1, 3]))
    _, payload = coord.recv()
    expect = ref.step(0, x, np.arange(4), np.array([1, 3]))[0]
    assert payload.shape == (2, 3)
    assert payload["token"].tolist() == np.argsort(-expect, axis=-1)[:, :3].tolist()


def test_stale_epochs_are_dropped(last_stage):
    worker, coord, first, _ = last_stage
    x = hidden_for(first, [1, 2], [0, 1])
    coord.send(HiddenStateFrame(Kind.RESET, 0, 0, EPOCH + 1))
    coord.send_parts(step(0, x, [0, 1], epoch=EPOCH, request_id=1))  # from before the reset
    coord.send_parts(step(0, x, [0, 1], epoch=EPOCH + 1, request_id=2))
    header, _ = coord.recv()  # frames are handled in order: the first answer is the later
    # step's, so the stale one was dropped, not answered late
    assert header.epoch == EPOCH + 1 and header.request_id == 2
    assert worker.stats().stale == 1
    coord.send(HiddenStateFrame(Kind.RESET, 0, 0, EPOCH))  # an old reset changes nothing
    coord.send_parts(step(0, hidden_for(first, [3], [2]), [2], step_no=1, epoch=EPOCH + 1))
    assert coord.recv() is not None
    stats = worker.stats()
    assert stats.stale == 2 and stats.resets == 1 and stats.implicit_resets == 0


def test_a_newer_epoch_without_its_reset_resets_implicitly(last_stage):
    worker, coord, first, ref = last_stage
    x = hidden_for(first, [9, 8, 7], [0, 1, 2])
    coord.send_parts(step(0, x, [0, 1, 2], epoch=EPOCH))
    coord.recv()
    coord.send_parts(step(0, x, [0, 1, 2], epoch=EPOCH + 5))  # same prompt again, fresh KV
    _, payload = coord.recv()
    assert payload["token"][0, 0] == ref.step(0, x, np.arange(3))[0, -1].argmax()
    assert worker.stats().implicit_resets == 2


def test_mask_tail_rewinds_before_the_step(last_stage):
    _, coord, first, ref = last_stage
    x = hidden_for(first, [1, 2, 3, 4], np.arange(4))
    coord.send_parts(step(0, x, np.arange(4)))
    coord.recv()
    ref.step(0, x, np.arange(4))
    y = hidden_for(first, [5], [2])
    coord.send_parts(step(0, y, [2], step_no=1, mask_tail=2, reply=ReplyMode.LOGITS))
    _, payload = coord.recv()
    ref.mask_tail(0, 2)
    assert np.array_equal(payload, ref.step(0, y, np.array([2]))[0])


def compact(stream: int = 0, epoch: int = EPOCH) -> HiddenStateFrame:
    return HiddenStateFrame(Kind.COMPACT, stream, 0, epoch)


def test_compact_drops_masked_slots_and_keeps_the_answers(last_stage):
    worker, coord, first, ref = last_stage
    x = hidden_for(first, [1, 2, 3, 4], np.arange(4))
    coord.send_parts(step(0, x, np.arange(4)))
    coord.recv()
    ref.step(0, x, np.arange(4))
    y = hidden_for(first, [5], [2])
    coord.send_parts(step(0, y, [2], step_no=1, mask_tail=2))
    coord.recv()
    ref.mask_tail(0, 2)
    ref.step(0, y, np.array([2]))
    coord.send(compact(epoch=EPOCH - 1))  # of an older epoch: dropped
    coord.send(compact(stream=7))  # a stream this stage never saw: logged, counted
    coord.send(compact())  # applied before the next step: PUSH/PULL keeps the order
    z = hidden_for(first, [6, 7], [3, 4])
    coord.send_parts(step(0, z, [3, 4], step_no=2, reply=ReplyMode.LOGITS, logits_idx=[0, 1]))
    _, payload = coord.recv()
    slots = worker.runner.streams[0]
    expect = ref.step(0, z, np.array([3, 4]), np.array([0, 1]))[0]
    assert slots.physical == slots.logical == 5 and ref.streams[0].physical == 7
    np.testing.assert_allclose(payload, expect, rtol=1e-5, atol=1e-5)
    assert payload.argmax(-1).tolist() == expect.argmax(-1).tolist()
    stats = settled(worker, frames_out=3)
    assert (stats.compactions, stats.compact_failures, stats.stale) == (1, 1, 1)
    assert "never saw" in stats.last_problem and stats.frames_out == 3  # the last stage
    # does not pass control frames on


def test_a_failed_compaction_refuses_the_epochs_next_step(last_stage, monkeypatch):
    worker, coord, first, _ = last_stage
    x = hidden_for(first, [1, 2], [0, 1])
    coord.send_parts(step(0, x, [0, 1]))
    coord.recv()

    def broken(stream_id: int) -> int:
        raise RuntimeError("state tensors went away")

    monkeypatch.setattr(worker.runner, "compact", broken)
    coord.send(compact())
    coord.send_parts(step(0, hidden_for(first, [3], [2]), [2], step_no=1, request_id=6))
    header, _ = coord.recv()
    assert header.kind == Kind.ERROR and header.request_id == 6
    assert "compaction of stream 0 failed: state tensors went away" in header.error
    assert worker.alive and worker.stats().compact_failures == 1
    coord.send(HiddenStateFrame(Kind.RESET, 0, 0, EPOCH + 1))  # a reset heals the stream
    coord.send_parts(step(0, x, [0, 1], epoch=EPOCH + 1))
    assert coord.recv()[0].kind == Kind.REPLY


def test_garbage_leaves_the_worker_serving(last_stage):
    worker, coord, first, _ = last_stage
    x = hidden_for(first, [1, 2], [0, 1])
    good = step(0, x, [0, 1])
    for junk in ([b"hello"], [b"a", b"b", b"c"], [b"\0" * 80, b""], [bytes(good[0]), b"xyz"],
                 [bytes(good[0])[:-5], bytes(good[1])]):
        coord.send_parts(junk)
    coord.send(HiddenStateFrame(Kind.REPLY, 0, 0, EPOCH, reply=ReplyMode.TOP1,
                                positions=np.array([0])), np.zeros((1, 1), TOPK_DTYPE))
    # the valid header with a bad payload is answered with an error, the rest dropped
    header, payload = coord.recv()
    assert header.kind == Kind.ERROR and "malformed frame: payload is 3 bytes" in header.error
    coord.send_parts(good)
    header, payload = coord.recv()
    assert header.kind == Kind.REPLY and payload.shape == (1, 1)
    stats = worker.stats()
    assert stats.malformed == 5 and stats.unexpected == 1 and stats.steps == 1
    assert "malformed" in stats.last_problem or "REPLY" in stats.last_problem


def test_a_step_the_stage_refuses_becomes_an_error_frame(last_stage):
    worker, coord, _, _ = last_stage
    wrong = np.zeros((1, 2, 32), dtype=np.float32)  # hidden size is 64
    coord.send_parts(step(0, wrong, [0, 1], request_id=9))
    header, payload = coord.recv()
    assert header.kind == Kind.ERROR and header.request_id == 9 and payload is None
    assert header.error.startswith("stage 1: ") and "hidden states" in header.error
    assert worker.stats().errors_sent == 1


def test_a_lost_frame_is_reported_not_papered_over(last_stage):
    _, coord, first, _ = last_stage
    x = hidden_for(first, [1, 2], [0, 1])
    coord.send_parts(step(0, x, [0, 1]))
    coord.recv()
    coord.send_parts(step(0, hidden_for(first, [3], [3]), [3], step_no=2))  # step 1 never came
    header, _ = coord.recv()
    assert header.kind == Kind.ERROR and "expected step 1 of stream 0, got step 2" in header.error


def test_middle_stage_forwards_steps_errors_and_resets(dp_export3):
    coord = Coordinator("")
    last = StageWorker(StageRunner(dp_export3, 2), "tcp://127.0.0.1:*", coord.reply_addr).start()
    middle = StageWorker(StageRunner(dp_export3, 1), "tcp://127.0.0.1:*", last.endpoint).start()
    coord.push = push_socket(zmq.Context.instance(), middle.endpoint)
    try:
        first = StageRunner(dp_export3, 0)
        first.open_stream(0)
        x = hidden_for(first, [1, 2, 3], [0, 1, 2])
        coord.send(HiddenStateFrame(Kind.RESET, 0, 0, EPOCH))
        coord.send_parts(step(0, x, [0, 1, 2]))
        header, _ = coord.recv()
        assert header.kind == Kind.REPLY
        assert timing_records(header.timings)["stage"].tolist() == [0, 1, 2]
        coord.send_parts(step(0, np.zeros((1, 1, 7), np.float32), [3], step_no=1, request_id=4))
        header, _ = coord.recv()
        assert header.kind == Kind.ERROR and header.error.startswith("stage 1: ")
        assert last.stats().errors_forwarded == 1
        assert middle.stats().resets == 1 and last.stats().resets == 1
        coord.send(HiddenStateFrame(Kind.COMPACT, 0, 0, EPOCH))  # passed on like a reset
        deadline = time.monotonic() + 5
        while last.stats().compactions == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert middle.stats().compactions == 1 and last.stats().compactions == 1
        coord.send(HiddenStateFrame(Kind.CLOSE, 0, 0, EPOCH + 1))
        deadline = time.monotonic() + 5
        while last.stats().closes == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert middle.stats().closes == 1 and last.stats().closes == 1
        assert 0 not in middle.runner.streams and 0 not in last.runner.streams
        coord.send_parts(step(0, x, [0, 1, 2], epoch=EPOCH + 1, request_id=5))  # a closed
        # epoch stays closed; a newer one opens the stream again, and its step is the first
        # thing answered: the step of the closed epoch was dropped, not answered
        coord.send(HiddenStateFrame(Kind.RESET, 0, 0, EPOCH + 2))
        coord.send_parts(step(0, x, [0, 1, 2], epoch=EPOCH + 2, request_id=6))
        header, _ = coord.recv()
        assert (header.kind, header.epoch, header.request_id) == (Kind.REPLY, EPOCH + 2, 6)
        assert middle.stats().stale == 1 and last.stats().stale == 0
    finally:
        middle.stop()
        last.stop()
        coord.close()


def test_rewire_moves_the_outbound_pipe(last_stage):
    worker, coord, first, _ = last_stage
    other = Coordinator("")
    try:
        worker.rewire(other.reply_addr)
        deadline = time.monotonic() + 5
        while worker.send_to != other.reply_addr and time.monotonic() < deadline:
            time.sleep(0.01)
        coord.send_parts(step(0, hidden_for(first, [1], [0]), [0], request_id=1))
        assert other.recv()[0].request_id == 1
        # back to the first end: what it gets first is the next step's answer, and the
        # worker sent exactly two frames, so nothing of the first step went there too
        worker.rewire(coord.reply_addr)
        deadline = time.monotonic() + 5
        while worker.send_to != coord.reply_addr and time.monotonic() < deadline:
            time.sleep(0.01)
        coord.send_parts(step(0, hidden_for(first, [2], [1]), [1], step_no=1, request_id=2))
        assert coord.recv()[0].request_id == 2
        assert settled(worker, frames_out=2).frames_out == 2
    finally:
        other.close()


def test_stop_is_prompt_and_idempotent(dp_export2):
    worker = StageWorker(StageRunner(dp_export2, 1), "tcp://127.0.0.1:*", "tcp://127.0.0.1:9")
    worker.start()
    join_s = 30.0
    start = time.monotonic()
    worker.stop(timeout_s=join_s)
    # the stop command woke the loop blocked in recv: it ended long before the join timeout
    # (a loop that only noticed at some poll interval, or never, would use it up)
    assert not worker._thread.is_alive() and time.monotonic() - start < join_s / 10
    worker.stop()
    never_ran = StageWorker(StageRunner(dp_export2, 1), "tcp://127.0.0.1:*", "tcp://127.0.0.1:9")
    never_ran.stop()


def test_forged_commands_from_the_network_are_just_malformed(last_stage):
    worker, coord, first, _ = last_stage
    coord.send_parts([CONTROL_PREFIX + b"\0" * 16, b"stop"])
    coord.send_parts(step(0, hidden_for(first, [1], [0]), [0]))
    assert coord.recv() is not None and worker.alive
    assert worker.stats().malformed == 1


def test_large_payloads_go_zero_copy_and_wait_before_reuse():
    ctx = zmq.Context.instance()
    pull = pull_socket(ctx, "tcp://127.0.0.1:*")
    push = push_socket(ctx, bound_endpoint(pull))
    try:
        big = np.arange(40_000, dtype=np.float32)  # 160 kB: above the copy threshold
        tracker = send_parts(push, [b"head", big])
        assert tracker is not None
        guard = BufferGuard(timeout_s=5)
        guard.hold(7, tracker)
        parts = recv_parts(pull)
        assert isinstance(parts[0], bytes) and len(parts) == 2
        assert np.array_equal(np.frombuffer(parts[1].buffer, np.float32), big)
        guard.release(7)
        assert tracker.done
        small = send_parts(push, [b"head", np.zeros(4, np.float32)])
        assert small is None or small.done  # copied: nothing to wait for
        recv_parts(pull)
    finally:
        push.close(0)
        pull.close(0)


def test_unreachable_next_hop_fails_the_send_in_bounded_time():
    """The send gives up after send_timeout_ms: not sooner, and later only by as much as a
    longer timeout makes it wait (measured with two timeouts in one run)."""
    import threading

    ctx = zmq.Context.instance()

    def failing_send(timeout_ms: int) -> float:
        push = push_socket(ctx, "tcp://127.0.0.1:9", PipeOptions(send_timeout_ms=timeout_ms))
        outcome: list = []

        def send() -> None:
            start = time.monotonic()
            try:
                send_parts(push, [b"head", b"body"])
            except TransportError as exc:
                outcome.append((str(exc), time.monotonic() - start))

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        sender.join(60)  # a send without a timeout would block forever: fail, do not hang
        assert not sender.is_alive(), "the send to an unreachable hop never gave up"
        push.close(0)
        assert outcome and "timed out" in outcome[0][0], outcome
        return outcome[0][1]

    short, long = failing_send(50), failing_send(1000)
    assert short >= 0.05 and long >= 1.0  # the timeout is waited out, not cut short
    assert short < long / 2  # and it is what ends the wait: 50 ms gives up much sooner


def test_row_groups_answer_each_row_and_refuse_bad_groups(last_stage):
    worker, coord, first, ref = last_stage
    gid = 1 << 30
    for sid, ids in ((0, [1, 2, 3]), (1, [7, 8])):  # two streams prefill alone
        first.open_stream(sid)
        ref.open_stream(sid)
        x = first.step(sid, np.array([ids]), np.arange(len(ids))).copy()
        coord.send_parts(step(sid, x, np.arange(len(ids)), request_id=10 + sid))
        assert coord.recv()[0].kind == Kind.REPLY
        ref.step(sid, x, np.arange(len(ids)))
    members = np.array([1, 0], dtype=np.int64)
    first.regroup(gid, [1, 0])
    ref.regroup(gid, [1, 0])
    coord.send(HiddenStateFrame(Kind.GROUP, gid, 0, EPOCH), members)
    pos = np.array([[2], [3]])
    x = first.step_rows(gid, np.array([[9], [4]]), pos).copy()
    header = HiddenStateFrame(kind=Kind.STEP, stream_id=gid, request_id=20, epoch=EPOCH,
                              positions=pos.reshape(-1), rows=2,
                              timings=stamp(b"", 0, 1, 1, 2, 0, 5, 0))
    coord.send(header, x)
    reply, payload = coord.recv()
    expect = ref.step_rows(gid, x, pos)[:, -1]
    assert reply.kind == Kind.REPLY and reply.rows == 2
    assert payload["token"][:, 0].tolist() == expect.argmax(-1).tolist()
    assert worker.stats().regroups == 1 and 0 not in worker.runner.streams
    # a group naming a stream this stage does not hold: nothing changes, its steps fail
    coord.send(HiddenStateFrame(Kind.GROUP, gid, 0, EPOCH), np.array([1, 42], np.int64))
    header.step, header.request_id = 1, 21
    coord.send(header, x)
    failed, _ = coord.recv()
    assert failed.kind == Kind.ERROR and "could not take streams [1, 42]" in failed.error
    assert worker.runner.groups[gid].members == [1, 0] and worker.stats().group_failures == 1
    # a GROUP with a payload of the wrong type is malformed: dropped and counted
    coord.send(HiddenStateFrame(Kind.GROUP, gid + 1, 0, EPOCH), np.zeros(2, np.float32))
    coord.send(HiddenStateFrame(Kind.GROUP, gid, 0, EPOCH + 1))  # disband (newer epoch)
    deadline = time.monotonic() + 5
    while worker.runner.groups and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not worker.runner.groups and worker.stats().malformed == 1 and worker.alive


def test_a_bad_next_hop_fails_clearly_and_closes_the_inbound_pipe(monkeypatch) -> None:
    from dataplane.wire import pipes

    opened: list[zmq.Socket] = []

    def recording_pull(*args, **kwargs) -> zmq.Socket:
        opened.append(pull_socket(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(pipes, "pull_socket", recording_pull)
    with pytest.raises(TransportError, match="cannot connect"):
        pipes.open_pipes(zmq.Context.instance(), "tcp://127.0.0.1:*", "tcp://no such host")
    assert len(opened) == 1 and opened[0].closed


def test_a_computed_step_is_rewound_by_its_cancel(last_stage) -> None:
    worker, coord, first, ref = last_stage
    x0 = hidden_for(first, [1, 2, 3], [0, 1, 2])
    coord.send_parts(step(0, x0, [0, 1, 2]))
    assert coord.recv() is not None
    ref.step(0, x0, np.arange(3))
    coord.send_parts(step(0, hidden_for(first, [9], [3]), [3], step_no=1, request_id=2))
    assert coord.recv()[0].request_id == 2  # computed on a wrong guess
    coord.send_parts(cancel(1, 1, 3))
    x2 = hidden_for(first, [4], [3])
    coord.send_parts(step(0, x2, [3], step_no=2, request_id=3, reply=ReplyMode.LOGITS))
    header, payload = coord.recv()
    assert header.request_id == 3 and header.kind == Kind.REPLY
    assert np.allclose(payload, reference_logits(ref, x2, [3]), atol=1e-5)
    stats = worker.stats()
    assert (stats.cancels, stats.skipped, stats.errors_sent) == (1, 0, 0)
    assert worker.runner.kept_tokens(0) == 4


def test_bad_cancels_leave_the_worker_serving(last_stage) -> None:
    worker, coord, first, _ = last_stage
    x0 = hidden_for(first, [1, 2, 3], [0, 1, 2])
    coord.send_parts(step(0, x0, [0, 1, 2]))
    coord.recv()
    bad = encode_frame(HiddenStateFrame(Kind.CANCEL, 0, 0, EPOCH), np.array([3, 1, 2], np.int64))
    coord.send_parts(bad)  # an inconsistent range: dropped, counted
    coord.send_parts(cancel(1, 0, 9))  # keeps more than the stream holds: its steps refused
    coord.send_parts(step(0, hidden_for(first, [4], [3]), [3], step_no=1, request_id=2))
    header, _ = coord.recv()
    assert header.kind == Kind.ERROR and "cancel" in header.error
    stats = worker.stats()
    assert stats.malformed == 1 and stats.cancels == 0
    coord.send(HiddenStateFrame(Kind.RESET, 0, 0, EPOCH + 1))  # a reset starts it afresh
    coord.send_parts(step(0, x0, [0, 1, 2], epoch=EPOCH + 1, request_id=3))
    assert coord.recv()[0].kind == Kind.REPLY
