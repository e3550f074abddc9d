"""Pipelined speculation (zctl.engine.pipelined) on a fake pipeline whose steps overlap: the output
is greedy's (and with sampling, plain sampling's for the same seed), wrong guesses are
cancelled with the stream rewound to what it keeps, and a cancel that rewinds wrongly shows."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from zctl.engine.drafting import LookupDrafter
from zctl.engine.executor import StepReply
from zctl.engine.pipelined import (
    GUESS_MIN,
    LONG,
    LONG_MATCH,
    PipelinedSession,
    Run,
    pipeline_depth,
    stands,
)
from zctl.engine.sampling import SamplingParams
from zctl.engine.scheduler import (
    StreamScheduler,
    generate_greedy,
    generate_pipelined,
    run_session,
)
from zctl.engine.sessions import DecodeSession
from zctl.engine.stats import SpeculativeStats

VOCAB = 64
# the "true" text: periodic with a perturbation now and then, so prompt-lookup guesses are
# right for a while, then wrong
TEXT = [(i % 5) + (7 if i % 13 == 0 else 0) for i in range(400)]
PROMPT = TEXT[:12]


class OverlappingModel:
    """A fake two-stage pipeline whose steps overlap (answers wait until collected) and whose
    answer at a position depends on the whole sequence before it: the next token of TEXT
    while the sequence is TEXT's prefix, else a function of all its tokens. So a wrong
    token left in the KV (a cancel that did not rewind) changes every later answer, and a
    step that does not start where the KV ends fails."""

    num_stages = 2
    overlaps_steps = True
    paged_attention = False
    row_groups_supported = False
    one_query_supported = False
    prefix_cache_supported = False
    wirings = 0
    rope_short_context = 0

    def __init__(self, skew_cancel: int = 0) -> None:
        self.kv: dict[int, list[int]] = {}
        self.answers: deque[StepReply] = deque()
        self.cancels: list[tuple[int, list[int], int]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.skew_cancel = skew_cancel  # a broken cancel keeps this many tokens too many
        self.guessed: list[bool | None] = []  # what each decode step said of its tokens
        self._rid = 0

    def open(self, stream_id: int) -> None:
        self.kv.setdefault(stream_id, [])

    def reset(self, stream_id: int, long_rope: bool = False) -> None:
        self.kv[stream_id] = []

    def close_stream(self, stream_id: int) -> None:
        self.kv.pop(stream_id, None)

    @staticmethod
    def next_token(seq: list[int]) -> int:
        if seq == TEXT[:len(seq)]:
            return TEXT[len(seq)]
        return (sum((i + 1) * t for i, t in enumerate(seq)) % (VOCAB - 20)) + 20

    def submit(self, step) -> int:
        kv = self.kv[step.stream_id]
        if kv:
            self.guessed.append(step.guessed)
        if step.mask_tail:
            del kv[len(kv) - int(step.mask_tail):]
        ids, pos = [int(t) for t in step.token_ids], [int(p) for p in step.positions]
        if pos[0] != len(kv) or pos != list(range(pos[0], pos[0] + len(ids))):
            raise RuntimeError(f"a step at {pos} on a stream holding {len(kv)} tokens")
        kv += ids
        nxt = [self.next_token(kv[:p + 1]) for p in pos]
        answered = nxt if step.logits_idx is not None else nxt[-1:]
        logits = None
        if step.want_logits:
            logits = np.zeros((len(answered), VOCAB), np.float32)
            for row, token in enumerate(answered):
                logits[row, token], logits[row, (token + 1) % VOCAB] = 2.0, 1.6
        self._rid += 1
        self.answers.append(StepReply(np.array(answered), logits, [1.0, 1.0], self._rid))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        return self._rid

    def collect_any(self, timeout_s=None):
        if not self.answers:
            return None
        self.in_flight -= 1
        return self.answers.popleft()

    def cancel(self, stream_id, request_ids, keep) -> None:
        self.cancels.append((stream_id, list(request_ids), keep))
        dropped = set(request_ids)
        self.in_flight -= sum(1 for a in self.answers if a.request_id in dropped)
        self.answers = deque(a for a in self.answers if a.request_id not in dropped)
        kv = self.kv[stream_id]
        if keep > len(kv):
            raise RuntimeError(f"cannot keep {keep} of {len(kv)} tokens")
        del kv[keep + self.skew_cancel:]


def greedy_reference(n: int) -> list[int]:
    return list(generate_greedy(OverlappingModel(), PROMPT, n))


def test_pipelined_output_is_greedys_and_wrong_guesses_are_cancelled() -> None:
    model, stats, n = OverlappingModel(), SpeculativeStats(), 120
    want = greedy_reference(n)
    assert want == TEXT[len(PROMPT):len(PROMPT) + n]
    got = list(generate_pipelined(model, PROMPT, n, depth=3, stats=stats))
    assert got == want
    assert model.most_in_flight == 3  # runs ahead on guesses
    assert model.cancels  # the perturbations made guesses wrong
    for _sid, rids, keep in model.cancels:
        assert rids and keep > len(PROMPT)
    assert stats.accepted > len(model.cancels)  # most guesses stood
    assert True in model.guessed and False in model.guessed  # the last stage may check
    assert model.kv == {} and model.in_flight == 0  # closed, nothing left in flight


def test_a_cancel_that_rewinds_wrongly_is_caught() -> None:
    with pytest.raises(RuntimeError, match="holding"):
        list(generate_pipelined(OverlappingModel(skew_cancel=1), PROMPT, 120, depth=3))


@pytest.mark.parametrize("width", [1, 3])
def test_wider_runs_verify_their_drafts_and_stay_greedy(width: int) -> None:
    model, n = OverlappingModel(), 100
    got = list(generate_pipelined(model, PROMPT, n, width=width, depth=2))
    assert got == greedy_reference(n)
    assert model.cancels


def test_a_stop_token_cancels_the_runs_after_it() -> None:
    model = OverlappingModel()
    stop = TEXT[len(PROMPT) + 20]
    got = list(generate_pipelined(model, PROMPT, 100, stop_ids=[stop], depth=4))
    want = greedy_reference(100)
    assert got == want[:want.index(stop) + 1]
    assert model.kv == {} and model.in_flight == 0


def test_sampling_draws_what_plain_sampling_draws() -> None:
    sampling = SamplingParams(temperature=1.0, seed=7)
    plain = list(run_session(OverlappingModel(), DecodeSession(
        0, PROMPT, 80, sampling=sampling)))
    model = OverlappingModel()
    got = list(run_session(model, PipelinedSession(0, PROMPT, 80, depth=3, sampling=sampling)))
    assert got == plain
    assert model.cancels and model.most_in_flight == 3
    assert set(model.guessed) == {None}  # a sampled token is not the top-1 a stage sees


def test_where_steps_do_not_overlap_it_decodes_one_step_at_a_time() -> None:
    model = OverlappingModel()
    model.overlaps_steps = False
    assert list(generate_pipelined(model, PROMPT, 60, depth=4)) == greedy_reference(60)
    assert model.most_in_flight == 1 and not model.cancels


def test_several_busy_streams_turn_it_off() -> None:
    model = OverlappingModel()
    scheduler = StreamScheduler(model)
    scheduler.load.saturated = lambda: True  # the stages are kept busy by the streams
    sessions = [PipelinedSession(i, PROMPT, 40, depth=4) for i in range(2)]
    for session in sessions:
        scheduler.add(session)
    while scheduler.active:
        scheduler.poll()
    assert [s.emitted for s in sessions] == [greedy_reference(40)] * 2
    assert model.most_in_flight == 2 and not model.cancels  # one step per stream


def test_the_drafter_must_be_replayable() -> None:
    class Stateful:
        replayable = False

        def propose(self, history, k):
            return []

        def accept(self, n):
            pass

    with pytest.raises(ValueError, match="lookup"):
        PipelinedSession(0, PROMPT, 8, drafter=Stateful())
    with pytest.raises(ValueError, match="depth"):
        PipelinedSession(0, PROMPT, 8, depth=0)
    PipelinedSession(0, PROMPT, 8, drafter=LookupDrafter())


def test_stands_needs_every_draft_and_the_guess() -> None:
    answered = Run(10, [4, 5, 6], False, 0.0)
    assert stands(answered, 2, 9, Run(13, [9], True, 0.0))
    assert not stands(answered, 1, 9, Run(13, [9], True, 0.0))  # a draft was rejected
    assert not stands(answered, 2, 8, Run(13, [9], True, 0.0))  # the guess was wrong


def test_pipeline_depth_covers_the_round_trip_and_follows_the_guesses() -> None:
    assert pipeline_depth([], [], []) == 2  # nothing measured yet
    lan = pipeline_depth([10.5] * 8, [[5.0, 5.0]] * 8, [])
    assert lan == 3  # (10 ms compute + 0.5 ms hops) / 5 ms busiest
    wan = pipeline_depth([62.0, 70.0] * 4, [[6.0, 6.0]] * 8, [])
    assert wan == 11  # 12 ms compute + the least gap, 50 ms, over 6 ms: 10.3
    assert pipeline_depth([62.0] * 8, [[6.0, 6.0]] * 8, [1] * GUESS_MIN, cap=5) == 5
    half = [1, 0] * GUESS_MIN
    assert pipeline_depth([10.5] * 8, [[5.0, 5.0]] * 8, half) == 2  # LAN: h / (1 - h) = 1
    # behind slow hops a wrong guess costs little next to the round trip a right one saves
    assert pipeline_depth([62.0] * 8, [[6.0, 6.0]] * 8, half) == 11
    assert pipeline_depth([62.0] * 8, [[6.0, 6.0]] * 8, [0] * GUESS_MIN) == 1  # rarely stand
    assert pipeline_depth([10.5] * 8, [[5.0, 5.0]] * 8, [0] * GUESS_MIN) == 1


def test_a_guess_that_stood_is_history_not_a_guess_again() -> None:
    """With an oracle drafter every guess stands: none is cancelled (a run whose guess was
    confirmed must not be counted twice in the history the next guesses are drafted on)."""
    text = greedy_reference(60)

    class Oracle:
        replayable = True

        def propose(self, history, k):
            return (PROMPT + text)[len(history):len(history) + k]

        def accept(self, n):
            pass

    model, stats = OverlappingModel(), SpeculativeStats()
    assert list(generate_pipelined(model, PROMPT, 60, drafter=Oracle(), width=0, depth=3,
                                   stats=stats)) == text
    assert not model.cancels and stats.accepted == stats.proposed > 50


def test_a_restart_with_runs_in_flight_replays_and_stays_greedy() -> None:
    """The pipeline goes down mid-generation (the service restarts its sessions on fresh
    KV): the runs in flight are forgotten and the output is still greedy's."""
    model = OverlappingModel()
    session = PipelinedSession(0, PROMPT, 80, depth=3)
    scheduler = StreamScheduler(model)
    scheduler.add(session)
    while len(session.emitted) < 30:
        scheduler.poll()
    assert session.runs  # runs in flight when it goes down
    model.answers.clear()
    model.in_flight = 0
    session.restart()
    assert not session.runs and session.take_cancel() is None
    scheduler = StreamScheduler(model)  # a fresh schedule; adding resets the stream
    scheduler.add(session)
    while scheduler.active:
        scheduler.poll()
    assert session.emitted == greedy_reference(80) and session.restarts == 1


def test_cancelled_runs_leave_no_width_behind_and_count_as_rejections() -> None:
    model, stats = OverlappingModel(), SpeculativeStats()
    session = PipelinedSession(0, PROMPT, 120, depth=3, stats=stats)
    assert list(run_session(model, session)) == greedy_reference(120)
    assert session.cancelled > 0 and len(session.k_used) == stats.steps  # one per answer
    assert stats.rejections >= len(model.cancels)  # a wrong guess is a rejected draft


@pytest.mark.parametrize("step_ms", [10.5, 62.0])  # a LAN, and hops 4x the stages' compute
def test_runs_stay_one_token_wide_behind_slow_hops_too(step_ms: float) -> None:
    """Wide runs stand only if every draft in them does: behind slow hops too the adaptive
    width keeps one-token runs (deep enough to cover the round trip) while drafts match
    short, and goes wide only while they match long."""
    session = PipelinedSession(0, PROMPT, 120)
    session.stats.step_ms = [step_ms] * 8
    session.stats.stage_ms = [[6.0, 6.0]] * 8
    assert session.run_width() == 0
    hindsight = session.draft_length.hindsight
    assert hindsight is not None
    hindsight.matches.extend([LONG_MATCH] * (hindsight.matches.maxlen or 0))
    assert hindsight.ready() and session.run_width() == LONG


def test_stages_sharing_cores_take_one_step_at_a_time_as_speculation() -> None:
    """On one machine's shared cores a guessed run would take the cores from the run it
    guesses after: the stream steps one run at a time, drafting today's adaptive K."""
    model = OverlappingModel()
    scheduler = StreamScheduler(model, shared_cores=True)
    session = PipelinedSession(0, PROMPT, 80)
    scheduler.add(session)
    while scheduler.active:
        scheduler.poll()
    assert session.emitted == greedy_reference(80)
    assert session.depth_cap == 1 and model.most_in_flight == 1 and not model.cancels
    assert max(session.k_used) > 1  # drafts, as speculation drafts them


def test_one_step_at_a_time_it_drafts_what_adaptive_speculation_drafts() -> None:
    session = PipelinedSession(0, PROMPT, 120)
    session.depth_cap = 1
    assert session.run_width() == session.choose_k()
    session.k_cap = 0  # the scheduler's cap under load
    assert session.run_width() == 0
