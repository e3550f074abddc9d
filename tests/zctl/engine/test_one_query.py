"""Speculation under the default numerics (int8 activations, a u8 KV cache): verification
steps run as one-query steps where the stages compute them, so speculative decoding gives
plain decoding's tokens and logprobs bit for bit, alone, pipelined, in row groups beside
prompts, and after a replay, which feeds its emitted tokens in one-query steps too.

Logprobs are compared, not only tokens: they are the last stage's logits, so a single bit
of difference shows (a random model seldom sits near enough a tie for a token to flip)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from tests.zctl.engine.test_scheduler import CountingModel, fake_greedy
from tests.zctl.engine.test_sessions import drive_with_kv_losses
from zctl.engine.executor import Step
from zctl.engine.prefill_pieces import CANONICAL, PieceRule
from zctl.engine.row_plans import ragged_rows
from zctl.engine.scheduler import StreamScheduler
from zctl.engine.sessions import DecodeSession

N = 32
TIE = 0.05  # logprobs this close are a tie to the default numerics (int8 activations)
PROMPTS = [[0, *[5 + (i % 9) for i in range(40)]], [0, *range(30, 70), *range(30, 50)],
           [0, 11, 12, 13, 11, 12, 13, 11, 12], [0, *range(100, 140)]]


class Oracle:
    """Drafts what greedy decoding emits after the prompt (``want``), but every third
    draft run ends in a wrong token: drafts are accepted, rejected and rewound. A function
    of the history alone (replayable, so pipelined speculation may draft ahead with it)."""

    replayable = True

    def __init__(self, prompt: Sequence[int], want: Sequence[int]) -> None:
        self.text, self.start = [*prompt, *want], len(prompt)

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        at = len(history)
        if list(history) != self.text[:at] or at < self.start:
            return []
        draft = self.text[at:at + k]
        if draft and at % 3 == 0:
            draft[-1] ^= 1
        return draft

    def accept(self, n: int) -> None:
        pass


@pytest.fixture(scope="module")
def chain(tiny_exports) -> LocalChain:
    """The tiny model in INT8, two paged stages, the default numerics."""
    export = tiny_exports.get([(0, 2), (2, 4)], weights="int8")
    return LocalChain.load(str(export), RuntimeSpec(paged_attention=True))


def session(i: int, k: int = 0, want: list[list[int]] | None = None, cls=DecodeSession,
            **options) -> DecodeSession:
    drafter = Oracle(PROMPTS[i], want[i]) if want is not None else None
    if k:
        options["k"] = k
    return cls(i, PROMPTS[i], N, drafter=drafter, top_logprobs=2, **options)


def run(chain, sessions: list[DecodeSession], row_groups: int = 0, one_query: bool = True,
        late: DecodeSession | None = None) -> list[DecodeSession]:
    """Run the sessions on one scheduler (``late`` joins after a few polls)."""
    scheduler = StreamScheduler(chain, row_groups, pieces=CANONICAL, one_query=one_query)
    for s in sessions:
        scheduler.add(s)
    polls = 0
    while scheduler.active:
        polls += 1
        if late is not None and polls == 8:
            scheduler.add(late)
        for update in scheduler.poll():
            assert update.session.error is None, update.session.error
    return sessions if late is None else [*sessions, late]


def outputs(sessions: list[DecodeSession]) -> list[tuple[list[int], list]]:
    return [(s.emitted, s.logprobs) for s in sessions]


@pytest.fixture(scope="module")
def greedy(chain) -> list[tuple[list[int], list]]:
    return outputs([run(chain, [session(i)])[0] for i in range(len(PROMPTS))])


@pytest.fixture(scope="module")
def want(greedy) -> list[list[int]]:
    return [tokens for tokens, _ in greedy]


@pytest.mark.parametrize("k", [1, 3, 7])
def test_speculation_gives_greedys_tokens_and_logits(chain, greedy, want, k) -> None:
    sessions = [run(chain, [session(i, k, want)])[0] for i in range(len(PROMPTS))]
    assert outputs(sessions) == greedy
    assert sum(s.spec.accepted for s in sessions) > 0 < sum(s.spec.rejections for s in sessions)


def test_verification_computed_together_differs(chain, greedy, want) -> None:
    """The control: verifying the drafts in multi-query steps (as stages without paged
    attention do) gives other logits."""
    sessions = [run(chain, [session(i, 3, want)], one_query=False)[0]
                for i in range(len(PROMPTS))]
    assert outputs(sessions) != greedy
    # a numeric difference, not another model: a stream may leave greedy's tokens only
    # where greedy's first two candidates sat within TIE of each other
    for s, (tokens, logprobs) in zip(sessions, greedy, strict=True):
        apart = next((j for j, (a, b) in enumerate(zip(s.emitted, tokens, strict=False)) if a != b), None)
        if apart is not None:
            first, second = logprobs[apart].top_logprobs[:2]
            assert first - second < TIE, (apart, logprobs[apart])


def test_adaptive_and_pipelined_speculation_give_greedys(chain, greedy, want) -> None:
    from zctl.engine.pipelined import PipelinedSession

    adaptive = [run(chain, [session(i, 6, want, auto_k=True)])[0] for i in range(len(PROMPTS))]
    assert outputs(adaptive) == greedy
    pipelined = [run(chain, [session(i, 0, want, PipelinedSession, width=3)])[0]
                 for i in range(len(PROMPTS))]
    assert outputs(pipelined) == greedy
    assert sum(s.spec.accepted for s in pipelined) > 0


def test_speculating_rows_beside_a_prompt_give_each_alone(chain, greedy, want) -> None:
    """Speculating sessions in one row group (ragged rows), and a prompt arriving while
    they decode: its pieces ride in their steps, which then feed one token a row (a step
    is one-query or not); every session's output is greedy's alone."""
    rows = [session(i, 3, want, prefill_chunk=8) for i in range(3)]
    done = run(chain, rows, row_groups=1, late=session(3, 3, want, prefill_chunk=8))
    assert outputs(done) == greedy
    assert sum(s.spec.accepted for s in rows) > 0


def test_a_one_query_row_cannot_share_a_step_with_a_prompts_piece() -> None:
    verify = Step(1, np.array([5, 6, 7]), np.arange(10, 13), np.arange(3), one_query=True)
    piece = Step(2, np.array([1, 2]), np.arange(0, 2))
    lone = Step(3, np.array([9]), np.array([20]))
    assert ragged_rows(9, [verify, lone]).step.one_query
    assert not ragged_rows(9, [piece, lone]).step.one_query
    with pytest.raises(ValueError, match=r"rows \[1\] feed several tokens computed together"):
        ragged_rows(9, [verify, piece])


@pytest.mark.parametrize("k", [0, 3])
def test_a_replay_in_one_query_steps_goes_on_as_greedy(chain, greedy, want, k) -> None:
    """After a restart the prompt goes in pieces, then the emitted tokens in one-query
    steps of a prefill chunk each: the generation goes on with greedy's output."""
    for i in range(2):
        s = session(i, k, want if k else None, prefill_chunk=16)
        s.stream_id = 10 + i
        s.pieces, s.one_query = CANONICAL, True
        drive_with_kv_losses(chain, s, {6, 12})
        assert (s.emitted, s.logprobs) == greedy[i] and s.restarts == 2


def test_the_replay_plans_its_emitted_tokens_as_one_query_chunks() -> None:
    model = CountingModel()
    s = DecodeSession(0, list(range(1, 41)), 20, prefill_chunk=16)
    s.pieces, s.one_query = PieceRule(1), True
    flags = []
    compute = model.compute

    def recording(step):
        flags.append((int(step.positions[0]), len(step.token_ids), step.one_query))
        return compute(step)

    model.compute = recording
    drive_with_kv_losses(model, s, {12})  # 3 prompt pieces, then 9 decode steps
    # the prompt's pieces again, then the 9 tokens its decode steps fed (the 10th emitted
    # is fed next, as a decode step)
    assert flags[12:17] == [(0, 16, False), (16, 16, False), (32, 8, False), (40, 9, True),
                            (49, 1, False)]
    assert s.emitted == fake_greedy(list(range(1, 41)), 20)
