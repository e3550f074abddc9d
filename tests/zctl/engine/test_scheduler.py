"""DecodeSession and StreamScheduler: one loop for greedy and speculative decoding of one or
many streams; several streams interleaved (in one process, and pipelined across stage
processes) produce exactly what each produces alone."""

from __future__ import annotations

import numpy as np
import pytest

from dataplane.runtime.config import RuntimeSpec
from zctl.engine.drafting import LookupDrafter
from zctl.engine.executor import InlineExecutor, Step, StepReply
from zctl.engine.scheduler import StreamScheduler, generate_greedy, generate_speculative, run_sessions
from zctl.engine.sessions import DecodeSession
from zctl.engine.stats import SpeculativeStats

EXACT = RuntimeSpec(precision="f32", kv_cache_precision="f32")
PROMPTS = [[0, 17, 42, 99, 5, 230, 7], [0, 11, 12, 13, 11, 12, 13, 11], [0, 300, 301, 302],
           [0, 5, 6, 7, 8, 9]]
N = 16


class CountingModel(InlineExecutor):
    """A fake pipeline: the token after t at position p is (t + p) % 7 (periodic, so lookup
    drafting is sometimes right); it records every step."""

    num_stages = 1

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[int, list[int], list[int], int]] = []

    def open(self, stream_id: int) -> None:
        pass

    def reset(self, stream_id: int, long_rope: bool = False) -> None:
        self.steps.append((stream_id, [], [], 0))

    def close_stream(self, stream_id: int) -> None:
        pass

    def compute(self, step):
        ids, pos = list(map(int, step.token_ids)), list(map(int, step.positions))
        self.steps.append((step.stream_id, ids, pos, step.mask_tail))
        nxt = [(t + p) % 7 for t, p in zip(ids, pos, strict=True)]
        return StepReply(tokens=np.array(nxt if step.logits_idx is not None else nxt[-1:]))


def fake_greedy(prompt: list[int], n: int) -> list[int]:
    token, pos, out = (prompt[-1] + len(prompt) - 1) % 7, len(prompt), []
    out.append(token)
    while len(out) < n:
        token = (token + pos) % 7
        pos += 1
        out.append(token)
    return out


def test_greedy_session_plans_contiguous_positions() -> None:
    model = CountingModel()
    got = list(generate_greedy(model, [1, 2, 3, 4, 5], 6, prefill_chunk=2))
    assert got == fake_greedy([1, 2, 3, 4, 5], 6)
    feeds = [s for s in model.steps if s[1]]
    assert [s[2] for s in feeds[:3]] == [[0, 1], [2, 3], [4]]  # prefill chunks
    assert [s[2] for s in feeds[3:]] == [[5], [6], [7], [8], [9]]  # one token per step
    assert all(s[3] == 0 for s in feeds)


def test_speculative_session_equals_greedy_and_rewinds_with_the_next_step() -> None:
    model = CountingModel()
    stats = SpeculativeStats()
    prompt = [3, 4, 5, 6, 0, 1, 2, 3, 4]
    got = list(generate_speculative(model, prompt, 30, k=4, stats=stats))
    assert got == fake_greedy(prompt, 30)
    assert stats.proposed > 0 and stats.new_tokens == 30
    decode = [s for s in model.steps if s[1]][1:]
    # logical positions stay contiguous: every step starts where the accepted tokens end
    for (_, ids, pos, _), (_, _, nxt, _) in zip(decode, decode[1:], strict=False):
        assert pos == list(range(pos[0], pos[0] + len(ids)))
        assert nxt[0] > pos[0]
    # each rewind drops at most the previous step's drafts, and never more than were rejected
    for (_, prev_ids, _, _), (_, _, _, rewind) in zip(decode, decode[1:], strict=False):
        assert 0 <= rewind <= len(prev_ids) - 1
    assert 0 < sum(s[3] for s in decode) <= stats.proposed - stats.accepted


def test_session_stops_on_stop_token_and_budget() -> None:
    prompt = [1, 2, 3]
    want = fake_greedy(prompt, 20)
    stop = want[4]
    first = want.index(stop) + 1
    assert list(generate_greedy(CountingModel(), prompt, 20, stop_ids=[stop])) == want[:first]
    assert list(generate_speculative(CountingModel(), prompt, 20, [stop], k=3)) == want[:first]
    assert list(generate_greedy(CountingModel(), prompt, 0)) == []
    with pytest.raises(ValueError):
        DecodeSession(0, [], 4)
    with pytest.raises(ValueError):
        DecodeSession(0, [1], 4, k=-1)


class UnreplayableDrafter:
    """A drafter adaptive K cannot replay (as a draft model): lookup drafts, not
    ``replayable``."""

    replayable = False

    def propose(self, history, k):
        return LookupDrafter().propose(history, k)

    def accept(self, n):
        pass


@pytest.mark.parametrize("drafter", [LookupDrafter(), UnreplayableDrafter()])
def test_auto_k_measures_both_step_sizes(drafter) -> None:
    session = DecodeSession(0, [1, 2, 3], 100, k=6, auto_k=True, drafter=drafter)
    # no cost model yet: a moderate K until MEASURE_STEPS steps fed drafts (one width:
    # one shape change), then 1-token steps give the fit its other size
    assert session.choose_k() == 4
    session.spec.fed, session.stats.step_ms, session.spec.steps = [5], [12.0], 1
    assert session.choose_k() == 4
    session.spec.fed, session.stats.step_ms, session.spec.steps = [5, 5], [12.0, 11.0], 2
    assert session.choose_k() == 0


def test_auto_k_probes_at_zero_a_drafter_it_cannot_replay() -> None:
    session = DecodeSession(0, [1, 2, 3], 100, k=6, auto_k=True, drafter=UnreplayableDrafter())
    # a cost where drafting never pays (huge per-token cost, nothing accepted): K = 0,
    # but every PROBE_EVERY-th step drafts one token to keep measuring
    session.spec.fed, session.stats.step_ms = [1, 7] * 4, [10.0, 1000.0] * 4
    session.spec.rejections, session.spec.steps = 50, 0
    ks = []
    for step in range(32):
        session.spec.steps = step
        ks.append(session.choose_k())
    assert ks.count(1) == 2 and set(ks) == {0, 1}


def test_width_changes_are_priced_into_the_fit_and_into_k() -> None:
    from zctl.engine.drafting import StepCost, adapt_k, fit_step_cost, switch_penalty, width_changes

    fed = [1, 1, 5, 5, 1, 1, 1, 2, 1, 1, 5, 1, 3, 3]
    changed = width_changes(fed)
    assert changed[:4] == [True, False, True, False]
    ms = [8.0 + 1.0 * (f - 1) + 5.0 * c for f, c in zip(fed, changed, strict=True)]
    cost = fit_step_cost(fed, ms, changed)
    assert cost is not None
    assert (round(cost.step_ms, 6), round(cost.token_ms, 6), round(cost.switch_ms, 6)) == (8, 1, 5)
    assert fit_step_cost([1, 2, 1, 2], [8.0, 9.0, 8.0, 9.0], [True] * 4).switch_ms == 0.0  # not told apart
    # from 1-token steps a draft pays two shape changes; from width 5 staying costs none
    assert switch_penalty(4, 1, 5.0) == 10.0 and switch_penalty(0, 1, 5.0) == 0.0
    assert switch_penalty(4, 5, 5.0) == 0.0 and switch_penalty(0, 5, 5.0) == 0.0
    assert switch_penalty(2, 5, 5.0) == 5.0 and switch_penalty(4, None, 5.0) == 0.0
    model = StepCost(8.0, 1.0, switch_ms=5.0)
    assert adapt_k(0.5, model, k_max=8, prev_fed=1) == 0  # leaving 1-token steps: no
    assert adapt_k(0.5, model, k_max=8, prev_fed=5) == 4  # already at width 5: stay
    assert adapt_k(0.95, model, k_max=8, prev_fed=1) > 0  # a lot accepted: worth it
    assert adapt_k(0.5, StepCost(8.0, 1.0), k_max=8, prev_fed=1) > 0  # no switch cost


def test_a_failing_session_does_not_stop_the_others() -> None:
    class Flaky(CountingModel):
        def compute(self, step):
            if step.stream_id == 1 and len([s for s in self.steps if s[0] == 1 and s[1]]) >= 3:
                raise RuntimeError("stage 1 is gone")
            return super().compute(step)

    sessions = [DecodeSession(i, PROMPTS[i], 8) for i in range(3)]
    updates = list(run_sessions(Flaky(), sessions))
    assert isinstance(sessions[1].error, RuntimeError)
    assert sessions[0].emitted == fake_greedy(PROMPTS[0], 8)
    assert sessions[2].emitted == fake_greedy(PROMPTS[2], 8)
    assert sum(len(u.tokens) for u in updates) == 16 + len(sessions[1].emitted)


def test_scheduler_rejects_a_stream_twice_and_cancels() -> None:
    model = CountingModel()
    sched = StreamScheduler(model)
    sched.add(DecodeSession(0, [1, 2], 50))
    with pytest.raises(ValueError):
        sched.add(DecodeSession(0, [1, 2], 5))
    sched.poll()
    sched.cancel(0)
    assert not sched.active and sched.poll() == []


class PipelinedCounting(CountingModel):
    """CountingModel behind submit/collect_any: replies come back in submission order."""

    def __init__(self) -> None:
        super().__init__()
        self.queue: list[tuple[int, int, StepReply]] = []  # (request id, stream, reply)
        self.submitted: list[int] = []  # stream id per submission
        self._next = 0

    def submit(self, step):
        from dataplane.head.replies import ClusterReply

        reply = self.compute(step)
        self._next += 1
        self.queue.append((self._next, step.stream_id, ClusterReply(
            tokens=reply.tokens, request_id=self._next, stream_id=step.stream_id)))
        self.submitted.append(step.stream_id)
        return self._next

    def collect_any(self, timeout_s=None):
        return self.queue.pop(0)[2] if self.queue else None


class GroupingCounting(PipelinedCounting):
    """PipelinedCounting that also steps row groups ([rows, T] ids, one-token rows)."""

    row_groups_supported = True

    def __init__(self) -> None:
        super().__init__()
        self.groups: dict[int, list[int]] = {}

    def regroup(self, group_id: int, members: list[int]) -> None:
        self.groups[group_id] = list(members)

    def submit(self, step):
        if np.ndim(step.token_ids) == 1:
            return super().submit(step)
        from dataplane.head.replies import ClusterReply

        stream_id = step.stream_id
        assert np.shape(step.token_ids)[1] == 1 and stream_id in self.groups
        rows = [self.compute(Step(sid, ids, pos)) for sid, ids, pos in
                zip(self.groups[stream_id], step.token_ids, step.positions, strict=True)]
        self._next += 1
        self.queue.append((self._next, stream_id, ClusterReply(
            tokens=np.concatenate([r.tokens for r in rows]), request_id=self._next,
            stream_id=stream_id)))
        self.submitted.append(stream_id)
        return self._next


def test_pipelined_next_steps_go_out_before_the_updates_are_handled() -> None:
    """A stream's next step is in flight by the time its update reaches the caller (whose
    streaming work then overlaps it), except its first token's, which reaches the caller
    before its next step starts (that step's stage-0 compute would delay the first token);
    a finished stream gets no step past its end."""
    model = PipelinedCounting()
    sessions = [DecodeSession(i, PROMPTS[i], 6) for i in range(2)]
    firsts = 0
    for update in run_sessions(model, sessions):
        sid = update.session.stream_id
        in_flight = [stream for _, stream, _ in model.queue]
        first = len(update.session.emitted) == len(update.tokens) > 0
        firsts += first
        assert (sid in in_flight) != (update.session.done or first), (sid, in_flight)
    assert firsts == 2
    for i, session in enumerate(sessions):
        assert session.emitted == fake_greedy(PROMPTS[i], 6)
        assert model.submitted.count(i) == 6  # the prompt's step and 5 decode steps


def test_row_groups_submit_their_next_step_before_the_updates_are_handled() -> None:
    """A formed group whose members all go on steps again before its rows' updates reach
    the caller; membership changes (joins, finished rows) still wait for the next poll."""
    model = GroupingCounting()
    sessions = [DecodeSession(i, PROMPTS[i], 12) for i in range(3)]
    scheduler = StreamScheduler(model, row_groups=1)
    for session in sessions:
        scheduler.add(session)
    ahead = behind = 0
    while scheduler.active:
        for update in scheduler.poll():
            gid = scheduler.row_groups.group_of.get(update.session.stream_id)
            if gid is None or update.session.done:
                continue
            in_flight = [unit for _, unit, _ in model.queue]
            ahead += gid in in_flight
            behind += gid not in in_flight
    for i, session in enumerate(sessions):
        assert session.emitted == fake_greedy(PROMPTS[i], 12)
    assert ahead > 2 * behind, (ahead, behind)  # only steps where membership changed wait for a poll


def test_a_lone_stream_steps_outside_the_row_groups_until_another_decodes() -> None:
    """One decoding stream steps alone (a one-row group costs host time for nothing), with
    its next step submitted before its update is handled; it joins a group once a second
    stream's prompt is in."""
    model = GroupingCounting()
    first = DecodeSession(0, PROMPTS[0], 10)
    scheduler = StreamScheduler(model, row_groups=1)
    scheduler.add(first)
    for _ in range(6):
        scheduler.poll()
    assert scheduler.row_steps == 0 and not scheduler.row_groups.group_of
    assert model.submitted.count(0) == len(first.emitted) + 1  # the next one already out
    second = DecodeSession(1, PROMPTS[1], 10)
    scheduler.add(second)
    while scheduler.active:
        scheduler.poll()
    assert scheduler.row_steps > 0
    assert first.emitted == fake_greedy(PROMPTS[0], 10)
    assert second.emitted == fake_greedy(PROMPTS[1], 10)


def test_stage_load_is_the_busiest_stages_share_of_the_wall_time() -> None:
    from zctl.engine.drafting import StageLoad, busiest_stage_share

    assert busiest_stage_share([3.0, 9.0], 10.0) == 0.9
    assert busiest_stage_share([], 10.0) == 0.0 and busiest_stage_share([1.0], 0.0) == 0.0
    load = StageLoad(window=8)
    for i in range(3):
        load.observe(i * 0.010, [4.0, 9.0])
    assert load.share() == 0.0 and load.saturated()  # too few replies to tell: assume busy
    for i in range(3, 8):
        load.observe(i * 0.010, [4.0, 9.0])  # 9 ms of every 10 on stage 1
    assert abs(load.share() - 0.9) < 1e-9 and load.saturated()
    for i in range(8, 16):
        load.observe(i * 0.010, [4.0, 2.0])  # the window moved on: 4 ms in 10
    assert abs(load.share() - 0.4) < 1e-9 and not load.saturated()
    # stages sharing one machine's cores: 4 + 2 ms of every 10 computing, together 0.6
    assert busiest_stage_share([4.0, 2.0], 10.0, shared_cores=True) == 0.6
    shared = StageLoad(window=8, shared_cores=True)
    for i in range(8):
        shared.observe(i * 0.010, [4.5, 4.5])  # each stage 45%, the cores 90%
    assert abs(shared.share() - 0.9) < 1e-9 and shared.saturated()


def test_auto_k_drafts_nothing_under_a_zero_cap() -> None:
    session = DecodeSession(0, [1, 2, 3], 100, k=6, auto_k=True)
    session.k_cap = 0
    assert [session.choose_k() for _ in range(3)] == [0, 0, 0]  # no alternation, no probe
    session.k_cap = 2
    assert session.choose_k() == 2  # the measuring alternation, within the cap
    fixed = DecodeSession(0, [1, 2, 3], 100, k=3)
    fixed.k_cap = 0
    assert fixed.choose_k() == 3  # a fixed K is the caller's choice


@pytest.mark.parametrize("saturated", [False, True])
def test_streams_on_saturated_stages_stop_drafting(saturated: bool) -> None:
    prompts = [[3, 4, 5, 6, 0, 1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 0, 1]]
    sessions = [DecodeSession(i, p, 30, k=4, auto_k=True) for i, p in enumerate(prompts)]
    scheduler = StreamScheduler(CountingModel())
    scheduler.load.saturated = lambda: saturated  # type: ignore[method-assign]
    for session in sessions:
        scheduler.add(session)
    while scheduler.active:
        scheduler.poll()
    for session, prompt in zip(sessions, prompts, strict=True):
        assert session.emitted == fake_greedy(prompt, 30)
    drafted = sum(s.spec.proposed for s in sessions)
    assert (drafted == 0) if saturated else (drafted > 0)
    lone = DecodeSession(0, prompts[0], 30, k=4, auto_k=True)  # one stream: never capped
    scheduler = StreamScheduler(CountingModel())
    scheduler.load.saturated = lambda: True  # type: ignore[method-assign]
    scheduler.add(lone)
    while scheduler.active:
        scheduler.poll()
    assert lone.spec.proposed > 0 and lone.emitted == fake_greedy(prompts[0], 30)


def test_rejected_probes_back_off_and_an_accepted_one_resets_the_gap() -> None:
    from zctl.engine.drafting import StepCost
    from zctl.engine.sessions import PROBE_EVERY

    class OneAhead:  # always proposes one token: the last token + 1
        replayable = False

        def propose(self, history, k):
            return [history[-1] + 1]

        def accept(self, n):
            pass

    # drafting never pays under this cost model: K = 0 but for the probes
    session = DecodeSession(0, [1, 2, 3], 400, k=4, drafter=OneAhead(),
                            cost=StepCost(step_ms=10.0, token_ms=1000.0))
    probes, accept_from = [], 140
    session.plan()
    session.advance(StepReply(tokens=np.array([5])))  # the prompt's step
    while not session.done:
        plan = session.plan()
        step = session.spec.steps
        if len(plan.token_ids) > 1:
            probes.append(step)
        # the target's next tokens: the draft is right only from step accept_from on
        want = [int(plan.token_ids[-1]) + (1 if step >= accept_from else 2)]
        if len(plan.token_ids) > 1:
            want = [int(plan.token_ids[0]) + (1 if step >= accept_from else 2)] * 2
        session.advance(StepReply(tokens=np.array(want)))
    gaps = np.diff(probes).tolist()
    assert probes[0] == PROBE_EVERY - 1
    assert gaps[:3] == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY]  # rejected: back off
    after = [p for p in probes if p > accept_from]
    assert np.diff(after).tolist()[:2] == [PROBE_EVERY, PROBE_EVERY]  # accepted: every 16 again


def test_auto_k_does_not_start_measuring_near_the_end() -> None:
    from zctl.engine.sessions import PROBE_EVERY

    session = DecodeSession(0, [1, 2, 3], PROBE_EVERY + 4, k=6, auto_k=True)
    assert session.choose_k() == 4  # enough budget left: measure
    session.stats.new_tokens = 4
    assert session.choose_k() == 0  # PROBE_EVERY tokens to go: nothing left to gain


class LongRopeModel(CountingModel):
    """CountingModel of a LongRoPE model whose threshold is 6 tokens, noting its resets."""

    rope_short_context = 6

    def __init__(self) -> None:
        super().__init__()
        self.resets: list[tuple[int, bool]] = []

    def reset(self, stream_id: int, long_rope: bool = False) -> None:
        self.resets.append((stream_id, long_rope))
        super().reset(stream_id, long_rope)


def test_a_prompt_past_the_longrope_threshold_resets_its_stream_long() -> None:
    """A prompt longer than the executor's threshold begins a long sequence (however it is
    cut: 2-token pieces here), one of the threshold or shorter a short one, each stream for
    itself; an executor of one set never gets a long one."""
    model = LongRopeModel()
    sessions = [DecodeSession(1, [1, 2, 3, 4, 5, 6, 7], 4, prefill_chunk=2),
                DecodeSession(2, [1, 2, 3, 4, 5, 6], 4, prefill_chunk=2)]
    list(run_sessions(model, sessions))
    assert sorted(model.resets) == [(1, True), (2, False)]
    assert [s.long_rope for s in sessions] == [True, False]
    plain = CountingModel()  # rope_short_context 0: one set
    session = DecodeSession(3, list(range(40)), 2)
    list(run_sessions(plain, [session]))
    assert not session.long_rope
