"""ClusterHead with its stage workers in threads: its steps (logits, top-k, rewinds,
interleaved streams, compaction) equal LocalChain's, and failures (timeouts, refused steps,
resets with frames in flight) surface quickly and clearly. (Across stage processes:
tests/e2e/test_stage_processes.py.)"""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from dataplane.head.cluster_head import ClusterHead
from dataplane.head.errors import DataPlaneError, StageFailed, StageTimeout
from dataplane.head.local_chain import LocalChain
from dataplane.runtime.stateful import StageRunner
from dataplane.wire.transport import pull_socket
from zctl.engine.executor import Step
from zctl.engine.payloads import FULL_FP16, LogitsPayload
from zctl.engine.scheduler import generate_greedy, generate_speculative
from zctl.engine.stats import SpeculativeStats

PROMPTS = [[0, 17, 42, 99, 5, 230, 7], [0, 300, 301, 302]]


def greedy(pipe, prompt, n=12, stream_id=0, stats=None):
    return list(generate_greedy(pipe, prompt, n, stream_id=stream_id, prefill_chunk=4,
                                stats=stats))


@pytest.fixture(scope="module")
def local2(dp_export2):
    return LocalChain.load(str(dp_export2))


def test_logits_top_k_and_rewind_match_local_runners(dp_threaded2, local2):
    pipe, _ = dp_threaded2
    pipe.open(0)
    pipe.reset(0)
    local2.open(0)
    local2.reset(0)
    ids, pos = np.array([0, 8, 9, 10, 11]), np.arange(5)
    got = pipe.step(0, ids, pos, np.array([2, 4]), want_logits=True)
    want = local2.step(0, ids, pos, np.array([2, 4]), want_logits=True)
    assert np.array_equal(got.logits, want.logits) and np.array_equal(got.tokens, want.tokens)
    # reject the last two tokens (mask-based rewind) and continue at logical position 3
    got = pipe.step(0, np.array([12]), np.array([3]), mask_tail=2, top_k=5)
    for runner in local2.runners:
        runner.mask_tail(0, 2)
    want = local2.step(0, np.array([12]), np.array([3]), want_logits=True)
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.top["token"][0].tolist() == np.argsort(-want.logits[0])[:5].tolist()


def test_rewind_on_its_own_and_compact_equal_a_carried_rewind(dp_threaded2, dp_export2):
    """Executor.rewind (applied with the next step on the cluster, at once in process) and
    Executor.compact give the tokens a rewind carried in the step gives."""
    pipe, worker = dp_threaded2
    carried, alone = LocalChain.load(str(dp_export2)), LocalChain.load(str(dp_export2))
    ids, pos = np.array([0, 8, 9, 10, 11]), np.arange(5)
    answers = []
    for executor in (carried, alone, pipe):
        executor.open(0)
        executor.reset(0)
        executor.step(0, ids, pos)
        if executor is carried:
            first = executor.step(0, np.array([12]), np.array([3]), mask_tail=2)
        else:
            executor.rewind(0, 2)
            first = executor.step(0, np.array([12]), np.array([3]))
        executor.compact(0)
        second = executor.step(0, np.array([13]), np.array([4]))
        answers.append((first.tokens.tolist(), second.tokens.tolist()))
    assert answers[0] == answers[1] == answers[2]
    assert pipe.stage0.masked_slots(0) == 0 and alone.runners[1].masked_slots(0) == 0
    assert pipe.compactions == alone.compactions == 1
    assert worker.stats().compactions == 1  # the COMPACT frame reached stage 1
    pipe.rewind(0, 1)
    pipe.reset(0)  # a reset forgets a rewind not yet sent (else: a rewind of a fresh stream)
    carried.reset(0)
    assert pipe.step(0, ids, pos).tokens.tolist() == carried.step(0, ids, pos).tokens.tolist()
    with pytest.raises(DataPlaneError, match="not open"):
        pipe.rewind(99, 1)


def test_streams_interleave_with_submit_and_collect(dp_threaded2, local2):
    pipe, _ = dp_threaded2
    expect = {s: greedy(local2, p, n=6) for s, p in enumerate(PROMPTS)}
    tokens: dict[int, list[int]] = {}
    position = {}
    for s, prompt in enumerate(PROMPTS):
        pipe.open(s)
        pipe.reset(s)
        position[s] = len(prompt)
    requests = {pipe.submit(Step(s, np.array(p), np.arange(len(p)))): s
                for s, p in enumerate(PROMPTS)}
    assert len(pipe.in_flight) == 2
    while requests:
        reply = pipe.collect_any()
        s = requests.pop(reply.request_id)
        assert reply.stream_id == s
        tokens.setdefault(s, []).append(int(reply.tokens[-1]))
        if len(tokens[s]) < 6:
            rid = pipe.submit(Step(s, np.array([tokens[s][-1]]), np.array([position[s]])))
            position[s] += 1
            requests[rid] = s
    assert tokens == expect
    assert pipe.collect_any(timeout_s=0.05) is None


def test_replies_of_an_old_epoch_are_discarded(dp_threaded2, local2):
    pipe, _ = dp_threaded2
    prompt = PROMPTS[0]
    pipe.open(0)
    pipe.reset(0)
    old = pipe.submit(Step(0, np.array(prompt), np.arange(len(prompt))))
    pipe.reset(0)  # the old request's answer is now stale wherever it is
    assert greedy(pipe, prompt, n=5) == greedy(local2, prompt, n=5)
    assert pipe.stats.stale_replies == 1
    with pytest.raises(DataPlaneError, match="unknown|abandoned"):
        pipe.collect(old)


def test_a_refused_step_fails_fast_with_the_stage_message(dp_threaded2):
    pipe, worker = dp_threaded2
    worker.runner.hidden_size = 32  # the stage now refuses stage 0's 64-wide hidden states
    pipe.open(0)
    pipe.reset(0)
    start = time.monotonic()
    with pytest.raises(StageFailed, match="failed at stage 1: .*hidden states") as info:
        pipe.step(0, np.array([1, 2]), np.arange(2))
    # fast: told by the stage's ERROR frame, not found out by the step timeout
    assert time.monotonic() - start < pipe.timeout_s / 2 and info.value.stage == 1
    assert pipe.stats.timeouts == 0 and worker.stats().errors_sent == 1
    with pytest.raises(DataPlaneError, match="must be reset"):
        pipe.step(0, np.array([3]), np.array([2]))
    worker.runner.hidden_size = 64
    pipe.reset(0)
    assert pipe.step(0, np.array([1, 2]), np.arange(2)).tokens.shape == (1,)


def test_hidden_states_other_than_predicted_are_encoded_as_they_are(dp_threaded2):
    """Stage 0's header is packed before it computes, for float32 [1, T, H]; any other
    output is encoded after the fact, so it still reaches stage 1 (which refuses it)."""
    pipe, _ = dp_threaded2
    step = pipe.stage0.step
    pipe.stage0.step = lambda *args, **kwargs: step(*args, **kwargs).astype(np.float16)
    pipe.open(0)
    pipe.reset(0)
    with pytest.raises(StageFailed, match="failed at stage 1: .*got float16"):
        pipe.step(0, np.array([1, 2]), np.arange(2))
    pipe.stage0.step = step
    pipe.reset(0)
    assert pipe.step(0, np.array([1, 2]), np.arange(2)).tokens.shape == (1,)


def test_a_silent_stage_times_out_naming_it(dp_export2):
    hole = pull_socket(zmq.Context.instance(), "tcp://127.0.0.1:*")  # takes frames, never answers
    from dataplane.wire.transport import bound_endpoint

    pipe = ClusterHead(StageRunner(dp_export2, 0), bound_endpoint(hole),
                           "tcp://127.0.0.1:*", timeout_s=0.3)
    try:
        pipe.open(0)
        pipe.reset(0)
        with pytest.raises(StageTimeout, match="stage 1 \\(tcp://127.0.0.1:.*did not answer") \
                as info:
            pipe.step(0, np.array([1, 2]), np.arange(2))
        assert info.value.stages == (1,) and pipe.stats.timeouts == 1
        with pytest.raises(DataPlaneError, match="must be reset"):
            pipe.submit(Step(0, np.array([3]), np.array([2])))
    finally:
        pipe.close()
        hole.close(0)


def test_constructor_checks(dp_export2):
    with pytest.raises(ValueError, match="runs stage 0"):
        ClusterHead(StageRunner(dp_export2, 1), "tcp://127.0.0.1:1", "tcp://127.0.0.1:*")


def test_long_prompts_and_full_logits_take_the_zero_copy_path(dp_threaded2, local2):
    rng = np.random.default_rng(3)
    prompt = [0, *(int(t) for t in rng.integers(4, 384, 299))]  # 300 x 64 x 4 B = 77 kB
    got = list(generate_greedy(dp_threaded2[0], prompt, 4, prefill_chunk=300))
    assert got == list(generate_greedy(local2, prompt, 4, prefill_chunk=300))
    pipe = dp_threaded2[0]
    pipe.reset(0)
    local2.reset(0)
    idx = np.arange(200)  # 200 x 384 x 4 B = 307 kB of logits back
    a = pipe.step(0, np.array(prompt[:200]), np.arange(200), idx, want_logits=True)
    b = local2.step(0, np.array(prompt[:200]), np.arange(200), idx, want_logits=True)
    assert np.array_equal(a.logits, b.logits)


def test_garbage_on_the_reply_pipe_is_dropped(dp_threaded2, local2):
    pipe, _ = dp_threaded2
    junk = zmq.Context.instance().socket(zmq.PUSH)
    junk.connect(pipe.reply_endpoint)
    try:
        junk.send_multipart([b"not", b"a", b"frame"])
        junk.send(b"\x00" * 100)
        assert greedy(pipe, PROMPTS[0], n=4) == greedy(local2, PROMPTS[0], n=4)
        assert pipe.stats.malformed == 2
    finally:
        junk.close(0)


def test_close_stream_frees_it_on_every_stage(dp_threaded2):
    pipe, worker = dp_threaded2
    pipe.open(5)
    pipe.reset(5)
    pipe.step(5, np.array([1, 2]), np.arange(2))
    pipe.close_stream(5)
    deadline = time.monotonic() + 5
    while 5 in worker.runner.streams and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 5 not in worker.runner.streams and 5 not in pipe.stage0.streams
    with pytest.raises(DataPlaneError, match="not open"):
        pipe.step(5, np.array([3]), np.array([2]))


def test_rewire_requires_a_reset(dp_threaded2, local2):
    pipe, worker = dp_threaded2
    pipe.open(0)
    pipe.reset(0)
    pipe.step(0, np.array([1, 2]), np.arange(2))
    pipe.rewire(worker.endpoint)
    with pytest.raises(DataPlaneError, match="must be reset: the pipeline was rewired"):
        pipe.step(0, np.array([3]), np.array([2]))
    assert greedy(pipe, PROMPTS[1], n=4) == greedy(local2, PROMPTS[1], n=4)


def test_abandon_all_forgets_steps_in_flight_and_needs_resets(dp_threaded2, local2):
    pipe, _ = dp_threaded2
    for sid in (0, 1):
        pipe.open(sid)
        pipe.reset(sid)
    pipe.submit(Step(0, np.array(PROMPTS[0]), np.arange(len(PROMPTS[0]))))
    pipe.submit(Step(1, np.array(PROMPTS[1]), np.arange(len(PROMPTS[1]))))
    pipe.abandon_all("stage 1 went away")
    assert pipe.in_flight == [] and pipe.collect_any(0.5) is None
    with pytest.raises(DataPlaneError, match="must be reset: stage 1 went away"):
        pipe.submit(Step(0, np.array([3]), np.array([len(PROMPTS[0])])))
    assert greedy(pipe, PROMPTS[1], n=4, stream_id=1) == greedy(local2, PROMPTS[1], n=4)
    assert pipe.stats.stale_replies == 2  # the forgotten steps' late answers


class SpoilingDrafter:
    """Drafts the true continuation with one token spoiled, at index 0..k in turn, so
    every rewind length occurs."""

    def __init__(self, text: list[int]) -> None:
        self.text, self.calls = text, 0

    def propose(self, history, k):
        draft = self.text[len(history):len(history) + k]
        bad, self.calls = self.calls % (k + 1), self.calls + 1
        if bad < len(draft):
            draft[bad] = (draft[bad] + 1) % 384
        return draft

    def accept(self, n: int) -> None:
        pass


def test_speculative_decoding_compacts_every_stage(dp_threaded3):
    pipe, middle, last = dp_threaded3
    prompt, k, n = PROMPTS[0], 4, 24
    want = greedy(pipe, prompt, n=n)
    stats, worst, got = SpeculativeStats(), 0, []
    for token in generate_speculative(pipe, prompt, n, drafter=SpoilingDrafter(prompt + want),
                                      k=k, stats=stats, prefill_chunk=4):
        got.append(token)  # the step is answered: every stage is idle, safe to look
        for runner in (pipe.stage0, middle.runner, last.runner):
            slots = runner.streams.get(0)  # closed on every stage once the last token is in
            if slots is not None:
                worst = max(worst, slots.physical - slots.logical)
    assert got == want
    assert stats.proposed - stats.accepted > 3 * (2 + k)  # without compaction: unbounded
    assert worst <= 2 + k  # the threshold, plus the rewind carried by the step after a COMPACT
    assert pipe.compactions > 1
    assert middle.stats().compactions == last.stats().compactions == pipe.compactions
    assert middle.stats().compact_failures == last.stats().compact_failures == 0
    assert pipe.stats.errors == pipe.stats.stale_replies == 0


@pytest.mark.parametrize("want", [LogitsPayload(top=5), FULL_FP16, True],
                         ids=["top5", "fp16", "fp32"])
def test_each_logits_payload_reads_as_the_local_chain_answers_it(want, dp_threaded2, local2):
    pipe, _ = dp_threaded2
    for chain in (pipe, local2):
        chain.open(0)
        chain.reset(0)
    ids, pos, idx = np.array([0, 8, 9, 10, 11]), np.arange(5), np.array([1, 2, 4])
    received = pipe.metrics.received_bytes
    got = pipe.step(0, ids, pos, idx, want_logits=want)
    local = local2.step(0, ids, pos, idx, want_logits=want)
    payload_bytes = {True: 4, FULL_FP16: 2}.get(want, 0) * 3 * local.logits.shape[-1]
    reply_bytes = pipe.metrics.received_bytes - received
    assert payload_bytes <= reply_bytes < payload_bytes + 1024  # what was asked: no more
    assert got.logits is not None and local.logits is not None
    assert got.logits.dtype == np.float32 and got.logits.shape == local.logits.shape
    assert np.allclose(got.logits, local.logits, atol=1e-6, equal_nan=False)
    assert np.array_equal(np.isneginf(got.logits), np.isneginf(local.logits))
    assert got.tokens.tolist() == local.tokens.tolist()
    assert got.logprob_rows == local.logprob_rows == (want is not True and bool(want.top))


def test_a_head_closed_from_another_thread_while_it_waits_fails_its_waiter_cleanly(
        dp_threaded2) -> None:
    """A re-wiring closes the old head from the control plane's thread while the
    generating thread may be waiting on its reply pipe (ZeroMQ sockets are one thread's: a
    close in the middle of a poll aborted the process): the close waits for the wait in
    hand, and the waiter gets a DataPlaneError it can pause on."""
    import threading
    import time

    from dataplane.head.errors import DataPlaneError

    pipe, worker = dp_threaded2
    pipe.open(0)
    pipe.reset(0)
    worker.handle = lambda *args: time.sleep(2)  # a stage that answers nothing for a while
    rid = pipe.submit(Step(0, np.array([1, 2, 3]), np.arange(3)))
    caught: list[BaseException] = []

    def wait() -> None:
        try:
            pipe.collect(rid, timeout_s=20)
        except BaseException as exc:  # noqa: BLE001 - what the waiter gets is the point
            caught.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    start = time.monotonic()
    pipe.close()
    assert time.monotonic() - start < 1.0
    waiter.join(5)
    assert not waiter.is_alive()
    assert len(caught) == 1 and isinstance(caught[0], DataPlaneError)
    assert "replaced" in str(caught[0])


def test_a_long_rope_sequence_is_refused_on_a_model_with_one_set(dp_threaded2, local2):
    """LongRoPE's long set on a model without it: the head refuses the reset before any
    frame goes (as the local chain's runners do), and the stream serves as before."""
    pipe, _ = dp_threaded2
    want = greedy(local2, PROMPTS[0], stream_id=6)
    for executor in (pipe, local2):
        assert executor.rope_short_context == 0
        executor.open(6)
        with pytest.raises(ValueError, match="one set of frequencies"):
            executor.reset(6, long_rope=True)
        assert greedy(executor, PROMPTS[0], stream_id=6) == want
