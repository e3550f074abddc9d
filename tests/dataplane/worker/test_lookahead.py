"""A stage worker's lookahead (dataplane.worker.lookahead): the marks it keeps of cancels
seen ahead of their turn, and workers that skip a step a cancel behind it covers (or, on the
last stage, a guess its own answer refutes) instead of computing it."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from dataplane.runtime.stateful import StageRunner
from dataplane.wire.cancels import CancelRange
from dataplane.wire.frames import ReplyMode
from dataplane.wire.transport import push_socket
from dataplane.worker.lookahead import CancelMarks
from dataplane.worker.stage_worker import StageWorker
from tests.helpers.worker import (
    Coordinator,
    cancel,
    fed_step,
    hidden_for,
    queued_worker,
    reference_logits,
    settled,
    step,
)


def test_marks_cover_their_steps_of_their_epoch_until_applied() -> None:
    marks = CancelMarks()
    first, later = CancelRange(4, 6, 30), CancelRange(9, 9, 33)
    marks.note(0, 7, first)
    marks.note(0, 7, later)
    assert [s for s in range(12) if marks.skips(0, 7, s)] == [4, 5, 6, 9]  # not 7, 8
    assert not marks.skips(0, 8, 5) and not marks.skips(1, 7, 5)
    marks.clear(0, 7, first)
    assert not marks.skips(0, 7, 5) and marks.skips(0, 7, 9)
    marks.note(0, 8, CancelRange(1, 1, 2))  # a newer epoch: the old marks go
    assert len(marks) == 1 and not marks.skips(0, 7, 9)
    marks.clear(0, 8, CancelRange(1, 1, 2))
    assert len(marks) == 0


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_step_not_computed_yet_is_skipped(dp_export2, pipelined: bool) -> None:
    """A pipelined stream's step (fed tokens) that a cancel behind it covers is skipped; a
    plain stream's steps are computed in turn (looking ahead would cost every plain step)
    and the cancel rewinds when it comes. Either way the answer after it is the same."""
    def frame(x, positions, fed, **kw):
        return fed_step(x, positions, fed, **kw) if pipelined else step(0, x, positions, **kw)

    coord = Coordinator("")
    worker, push = queued_worker(dp_export2, 1, coord.reply_addr)
    first, ref = StageRunner(dp_export2, 0), StageRunner(dp_export2, 1)
    first.open_stream(0)
    ref.open_stream(0)
    try:
        x0 = hidden_for(first, [1, 2, 3], [0, 1, 2])
        x2 = hidden_for(first, [4], [3])
        for parts in (frame(x0, [0, 1, 2], [1, 2, 3]),
                      frame(hidden_for(first, [9], [3]), [3], [9], step_no=1, request_id=2),
                      cancel(1, 1, 3),
                      frame(x2, [3], [4], step_no=2, request_id=3, reply=ReplyMode.LOGITS)):
            push.send_multipart(parts)
        time.sleep(0.3)  # every frame waits in the worker's pipe before it starts
        worker.start()
        answered = [1, 3] if pipelined else [1, 2, 3]  # a skipped step is never answered
        assert [coord.recv()[0].request_id for _ in answered[:-1]] == answered[:-1]
        header, payload = coord.recv()
        assert header.request_id == 3
        ref.step(0, x0, np.arange(3))
        assert np.allclose(payload, reference_logits(ref, x2, [3]), atol=1e-5)
        stats = settled(worker, len(answered))
        assert (stats.cancels, stats.skipped, stats.steps, stats.errors_sent) == (
            1, int(pipelined), len(answered), 0)
    finally:
        worker.stop()
        push.close(0)
        coord.close()


def test_a_cancel_passed_on_reaches_a_stage_that_has_not_computed_the_step(dp_export3) -> None:
    coord = Coordinator("")
    last, _ = queued_worker(dp_export3, 2, coord.reply_addr)
    middle = StageWorker(StageRunner(dp_export3, 1), "tcp://127.0.0.1:*", last.endpoint).start()
    coord.push = push_socket(zmq.Context.instance(), middle.endpoint)
    first = StageRunner(dp_export3, 0)
    ref1, ref2 = StageRunner(dp_export3, 1), StageRunner(dp_export3, 2)
    for runner in (first, ref1, ref2):
        runner.open_stream(0)
    try:
        x0 = hidden_for(first, [1, 2, 3], [0, 1, 2])
        x2 = hidden_for(first, [4], [3])
        frames = (fed_step(x0, [0, 1, 2], [1, 2, 3]),
                  fed_step(hidden_for(first, [9], [3]), [3], [9], step_no=1, request_id=2),
                  cancel(1, 1, 3),
                  fed_step(x2, [3], [4], step_no=2, request_id=3, reply=ReplyMode.LOGITS))
        for sent, parts in enumerate(frames, 1):
            coord.send_parts(parts)
            settled(middle, sent)  # the middle stage computes (or passes on) each in turn
        assert middle.stats().steps == 3  # it computed the wrong step; the last has not
        last.start()
        assert coord.recv()[0].request_id == 1
        header, payload = coord.recv()
        assert header.request_id == 3
        ref2.step(0, ref1.step(0, x0, np.arange(3)).copy(), np.arange(3))
        want = ref2.step(0, ref1.step(0, x2, np.array([3])).copy(), np.array([3]))[0]
        assert np.allclose(payload, want, atol=1e-5)
        assert (middle.stats().cancels, middle.stats().skipped) == (1, 0)
        assert (last.stats().cancels, last.stats().skipped) == (1, 1)
        assert middle.runner.kept_tokens(0) == last.runner.kept_tokens(0) == 4
    finally:
        middle.stop()
        last.stop()
        coord.close()


def test_the_last_stage_skips_a_guess_its_own_answer_refutes(last_stage) -> None:
    worker, coord, first, ref = last_stage
    x0 = hidden_for(first, [1, 2, 3], [0, 1, 2])
    coord.send_parts(step(0, x0, [0, 1, 2]))
    coord.recv()
    x1 = hidden_for(first, [4], [3])
    coord.send_parts(fed_step(x1, [3], [4], False, 1, 2))
    answer = int(coord.recv()[1]["token"][0, 0])  # what the stage answered after token 4
    x2 = hidden_for(first, [answer], [4])
    coord.send_parts(fed_step(x2, [4], [answer], True, 2, 3))  # the right guess
    assert coord.recv()[0].request_id == 3
    coord.send_parts(fed_step(x2, [5], [answer + 1], True, 3, 4))  # a guess it refutes...
    coord.send_parts(fed_step(x2, [6], [7], True, 4, 5))  # ... and one built on it
    coord.send_parts(cancel(3, 4, 5))
    x5 = hidden_for(first, [9], [5])
    coord.send_parts(fed_step(x5, [5], [9], False, 5, 6))
    header, _ = coord.recv()
    assert header.request_id == 6  # 4 and 5 were never computed, nor answered
    stats = settled(worker, 4)
    assert (stats.skipped, stats.cancels, stats.steps, stats.errors_sent) == (2, 1, 4, 0)
    assert worker.runner.kept_tokens(0) == 6
