"""ReplyInbox: the steps a head has in flight and their answers, without a chain behind it:
cancels and resets forget steps, abandoned and expired ones fail and break their streams,
a reply of another epoch is stale, and a closed inbox refuses to wait."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from dataplane.head.errors import DataPlaneError, StageTimeout
from dataplane.head.inbox import ClusterStats, Pending, ReplyInbox
from dataplane.head.metrics import StepMetrics
from dataplane.wire.frames import TOPK_DTYPE, HiddenStateFrame, Kind, ReplyMode, encode_frame
from dataplane.wire.reply_records import top1_record
from dataplane.wire.timing import TimingWindow
from dataplane.wire.transport import pull_socket, push_socket


@pytest.fixture
def inbox():
    broken: list[tuple[int, int, str]] = []
    prefetched: list[int] = []
    box = ReplyInbox(pull_socket(zmq.Context.instance(), "tcp://127.0.0.1:*"), 3, 0.3,
                     ClusterStats(), TimingWindow(8), StepMetrics(3, hops=True),
                     next_hop=lambda: "tcp://stage1:9", prefetch=prefetched.append,
                     broken=lambda sid, epoch, why: broken.append((sid, epoch, why)))
    yield box, broken, prefetched
    box.close()


def pending(stream_id: int, step: int, epoch: int = 5, timeout_s: float = 30.0) -> Pending:
    return Pending(stream_id, epoch, step, ReplyMode.TOP1, 1, 0, time.time_ns(),
                   time.monotonic() + timeout_s)


def test_cancels_and_new_epochs_forget_steps_and_abandon_fails_the_rest(inbox) -> None:
    box, broken, _ = inbox
    for rid, (sid, step) in enumerate([(1, 0), (1, 1), (2, 0), (1, 2)], 1):
        box.expect(rid, pending(sid, step))
    assert box.in_flight == [1, 2, 3, 4] and box.streams_in_flight() == {1, 2}
    assert box.cancel(1, [2, 3, 4]) == ([1, 2], 0)  # request 3 is stream 2's: kept
    box.forget_stream(2)
    assert box.in_flight == [1]
    box.abandon("the pipeline was rewired")
    assert box.in_flight == [] and broken == [(1, 5, "the pipeline was rewired")]
    with pytest.raises(DataPlaneError, match="request 1 of stream 1 abandoned: the pipeline"):
        box.collect_any(0)
    with pytest.raises(DataPlaneError, match="unknown, already collected"):
        box.collect(1)


def test_a_step_not_answered_in_time_expires_naming_the_stages(inbox) -> None:
    box, broken, prefetched = inbox
    box.expect(7, pending(4, 0, timeout_s=0.2))
    with pytest.raises(StageTimeout, match="one of stages 1-2 \\(first hop tcp://stage1:9\\)") as info:
        box.collect(7)
    assert info.value.stages == (1, 2) and box.stats.timeouts == 1
    assert broken and broken[0][:2] == (4, 5) and prefetched and set(prefetched) == {4}


def test_replies_are_filed_by_request_and_stale_ones_dropped(inbox) -> None:
    box, _, _ = inbox
    push = push_socket(zmq.Context.instance(), box.reply_endpoint)
    try:
        box.expect(1, pending(3, 0))
        box.expect(2, pending(3, 1))
        logits = np.zeros((1, 1, 8), np.float32)
        logits[0, 0, 6] = 1.0
        for rid, epoch in ((2, 4), (2, 5), (1, 5)):  # the first is of an older epoch
            header = HiddenStateFrame(Kind.REPLY, 3, rid, epoch, rid - 1, reply=ReplyMode.TOP1)
            record = np.frombuffer(top1_record(logits), TOPK_DTYPE).reshape(1, 1)
            push.send_multipart(encode_frame(header, record))
        first = box.collect(1, timeout_s=5)
        assert first.request_id == 1 and first.tokens.tolist() == [6]
        assert box.collect_any(5).request_id == 2  # kept while request 1 was awaited
        assert box.stats.replies == 2 and box.stats.stale_replies == 1
    finally:
        push.close(0)


def test_a_closed_inbox_refuses_to_wait(inbox) -> None:
    box, _, _ = inbox
    box.expect(1, pending(0, 0))
    box.close()
    with pytest.raises(DataPlaneError, match="replaced"):
        box.collect_any(1)
