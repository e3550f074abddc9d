"""Pipelined speculation through a ClusterHead and stage workers in threads: the output is
greedy's, wrong guesses are cancelled on every stage (skipped where not computed yet),
masked slots stay bounded, and the stream's KV is freed on every stage at the end."""

from __future__ import annotations

import time

import pytest

from dataplane.head.cluster_head import ClusterHead
from dataplane.runtime.kv.slots import held_slots
from dataplane.worker.stage_worker import StageWorker
from zctl.engine.scheduler import generate_greedy, generate_pipelined
from zctl.engine.stats import SpeculativeStats

PROMPT = [0, 17, 42, 99, 5, 230, 7, 17, 42]


class SpoilingGuesser:
    """Guesses the true continuation, spoiled wherever the history's length is a multiple
    of ``every``: a function of the history alone (replayable), as pipelining needs."""

    replayable = True

    def __init__(self, text: list[int], every: int = 6) -> None:
        self.text, self.every = text, every

    def propose(self, history, k):
        draft = self.text[len(history):len(history) + k]
        return [(t + 1) % 384 if (len(history) + i) % self.every == 0 else t
                for i, t in enumerate(draft)]

    def accept(self, n: int) -> None:
        pass


@pytest.fixture
def chain3(dp_threaded3):
    pipe, middle, last = dp_threaded3
    return pipe, [middle, last]


@pytest.fixture
def chain2(dp_threaded2):
    pipe, worker = dp_threaded2
    return pipe, [worker]


def freed(pipe: ClusterHead, workers: list[StageWorker], timeout_s: float = 5.0) -> bool:
    """Whether every stage holds no KV slot (the close travels behind the last reply)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if held_slots(pipe.stage0) == 0 and all(w.kv_slots() == 0 for w in workers):
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("chain,depth,width", [("chain2", 2, 0), ("chain2", None, 0),
                                               ("chain3", 3, 0), ("chain3", 3, 2)])
def test_pipelined_equals_greedy_and_cancels_on_every_stage(chain, depth, width, request):
    pipe, workers = request.getfixturevalue(chain)
    n = 40
    want = list(generate_greedy(pipe, PROMPT, n, prefill_chunk=4))
    assert freed(pipe, workers)
    stats = SpeculativeStats()
    got = list(generate_pipelined(pipe, PROMPT, n, drafter=SpoilingGuesser(PROMPT + want),
                                  width=width, depth=depth, stats=stats, prefill_chunk=4))
    assert got == want
    assert pipe.stats.cancelled > 0 and stats.accepted > 0
    assert pipe.stats.errors == 0 and pipe.stats.timeouts == 0
    assert freed(pipe, workers)  # no slot left behind on any stage
    for worker in workers:
        s = worker.stats()
        assert s.errors_sent == 0 and s.malformed == 0 and s.cancels > 0
    if chain == "chain3":
        assert pipe.compactions > 0  # the cancels' masked slots were compacted away
        assert [w.stats().compactions for w in workers] == [pipe.compactions] * 2


def test_the_stream_serves_again_after_a_pipelined_generation(chain2):
    pipe, workers = chain2
    want = list(generate_greedy(pipe, PROMPT, 24, prefill_chunk=4))
    guesser = SpoilingGuesser(PROMPT + want, every=3)
    for _ in range(2):
        assert list(generate_pipelined(pipe, PROMPT, 24, drafter=guesser, depth=3,
                                       prefill_chunk=4)) == want
    assert list(generate_greedy(pipe, PROMPT, 24, prefill_chunk=4)) == want
    assert freed(pipe, workers)


def test_a_pipelined_stream_beside_a_row_grouped_one(chain2):
    """Another stream arrives: the pipelined one keeps its own steps (or joins the row
    group when idle); both outputs are greedy's and every stage is freed."""
    from zctl.engine.pipelined import PipelinedSession
    from zctl.engine.scheduler import StreamScheduler
    from zctl.engine.sessions import DecodeSession

    pipe, workers = chain2
    other = [0, 300, 301, 302, 11, 12]
    want = list(generate_greedy(pipe, PROMPT, 30, prefill_chunk=4))
    want_other = list(generate_greedy(pipe, other, 30, prefill_chunk=4))
    scheduler = StreamScheduler(pipe, row_groups=1)
    pipelined = PipelinedSession(1, PROMPT, 30, drafter=SpoilingGuesser(PROMPT + want),
                                 depth=3, prefill_chunk=4)
    plain = DecodeSession(2, other, 30, prefill_chunk=4)
    scheduler.add(pipelined)
    while len(pipelined.emitted) < 8:
        scheduler.poll()
    scheduler.add(plain)
    while scheduler.active:
        scheduler.poll()
    assert pipelined.error is None and plain.error is None
    assert pipelined.emitted == want and plain.emitted == want_other
    assert pipe.stats.cancelled > 0 and freed(pipe, workers)


def test_no_guessing_once_the_head_runs_every_stage(dp_threaded2, dp_export2):
    """After a heal onto the coordinator alone (its StageChain runs every stage) steps no
    longer overlap: a guess would cost a whole model's step, so none is made; wide steps
    (pipelined or speculative) are answered at every position they ask for."""
    from dataplane.runtime.stage_chain import StageChain
    from dataplane.runtime.stateful import StageRunner

    pipe, worker = dp_threaded2
    want = list(generate_greedy(pipe, PROMPT, 20, prefill_chunk=4))
    assert pipe.overlaps_steps
    pipe.rewire(worker.endpoint, stage0=StageChain(
        [StageRunner(dp_export2, 0), StageRunner(dp_export2, 1)]))
    assert pipe.answers_here and not pipe.overlaps_steps
    got = list(generate_pipelined(pipe, PROMPT, 20, drafter=SpoilingGuesser(PROMPT + want),
                                  depth=3, prefill_chunk=4))
    assert got == want and pipe.stats.cancelled == 0
    # a verify step run here to the last stage answers every position it asks for
    from zctl.engine.scheduler import generate_speculative
    assert list(generate_speculative(pipe, PROMPT, 20, drafter=SpoilingGuesser(PROMPT + want),
                                     k=4, prefill_chunk=4)) == want
