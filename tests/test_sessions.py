"""DecodeSession and StreamScheduler: one loop for greedy and speculative decoding of one or
many streams; several streams interleaved (in one process, and pipelined across stage
processes) produce exactly what each produces alone."""

from __future__ import annotations

import numpy as np
import pytest

from dataplane.generate import LocalChain, StepReply
from dataplane.runtime import RuntimeConfig
from dataplane.scheduler import StreamScheduler, generate_greedy, generate_speculative, run_sessions
from dataplane.sessions import DecodeSession
from dataplane.speculative import LookupDrafter, SpeculativeStats

EXACT = RuntimeConfig(precision="f32", kv_cache_precision="f32")
PROMPTS = [[0, 17, 42, 99, 5, 230, 7], [0, 11, 12, 13, 11, 12, 13, 11], [0, 300, 301, 302],
           [0, 5, 6, 7, 8, 9]]
N = 16


class CountingModel:
    """A fake pipeline: the token after t at position p is (t + p) % 7 (periodic, so lookup
    drafting is sometimes right); it records every step."""

    num_stages = 1

    def __init__(self) -> None:
        self.steps: list[tuple[int, list[int], list[int], int]] = []

    def open(self, stream_id: int) -> None:
        pass

    def reset(self, stream_id: int) -> None:
        self.steps.append((stream_id, [], [], 0))

    def step(self, stream_id, token_ids, positions, logits_idx=None, want_logits=False, *,
             mask_tail=0):
        ids, pos = list(map(int, token_ids)), list(map(int, positions))
        self.steps.append((stream_id, ids, pos, mask_tail))
        nxt = [(t + p) % 7 for t, p in zip(ids, pos, strict=True)]
        return StepReply(tokens=np.array(nxt if logits_idx is not None else nxt[-1:]))


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


def test_auto_k_measures_both_step_sizes_and_probes_at_zero() -> None:
    session = DecodeSession(0, [1, 2, 3], 100, k=6, auto_k=True, drafter=LookupDrafter())
    # no cost model yet: a moderate K for MEASURE_STEPS steps (one width: one shape
    # change), then 1-token steps give the fit its other size
    assert session.choose_k() == 4
    session.spec.steps = 1
    assert session.choose_k() == 4
    session.spec.steps = 2
    assert session.choose_k() == 0
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
    from dataplane.speculative import StepCost, adapt_k, fit_step_cost, switch_penalty, width_changes

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
        def step(self, stream_id, *args, **kwargs):
            if stream_id == 1 and len([s for s in self.steps if s[0] == 1 and s[1]]) >= 3:
                raise RuntimeError("stage 1 is gone")
            return super().step(stream_id, *args, **kwargs)

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

    def submit(self, stream_id, token_ids, positions, logits_idx=None, want_logits=False, *,
               top_k=0, mask_tail=0):
        from dataplane.cluster_types import ClusterReply

        reply = self.step(stream_id, token_ids, positions, logits_idx, want_logits,
                          mask_tail=mask_tail)
        self._next += 1
        self.queue.append((self._next, stream_id, ClusterReply(
            tokens=reply.tokens, request_id=self._next, stream_id=stream_id)))
        self.submitted.append(stream_id)
        return self._next

    def collect_any(self, timeout_s=None):
        return self.queue.pop(0)[2] if self.queue else None


class GroupingCounting(PipelinedCounting):
    """PipelinedCounting that also steps row groups ([rows, T] ids, one-token rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.groups: dict[int, list[int]] = {}

    def regroup(self, group_id: int, members: list[int]) -> None:
        self.groups[group_id] = list(members)

    def submit(self, stream_id, token_ids, positions, logits_idx=None, want_logits=False, *,
               top_k=0, mask_tail=0):
        if np.ndim(token_ids) == 1:
            return super().submit(stream_id, token_ids, positions, logits_idx, want_logits,
                                  mask_tail=mask_tail)
        from dataplane.cluster_types import ClusterReply

        assert np.shape(token_ids)[1] == 1 and stream_id in self.groups
        rows = [self.step(sid, ids, pos) for sid, ids, pos in
                zip(self.groups[stream_id], token_ids, positions, strict=True)]
        self._next += 1
        self.queue.append((self._next, stream_id, ClusterReply(
            tokens=np.concatenate([r.tokens for r in rows]), request_id=self._next,
            stream_id=stream_id)))
        self.submitted.append(stream_id)
        return self._next


def test_pipelined_next_steps_go_out_before_the_updates_are_handled() -> None:
    """A stream's next step is in flight by the time its update reaches the caller (whose
    streaming work then overlaps it); a finished stream gets no step past its end."""
    model = PipelinedCounting()
    sessions = [DecodeSession(i, PROMPTS[i], 6) for i in range(2)]
    for update in run_sessions(model, sessions):
        sid = update.session.stream_id
        in_flight = [stream for _, stream, _ in model.queue]
        assert (sid in in_flight) != update.session.done, (sid, in_flight)
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
            gid = scheduler._group_of.get(update.session.stream_id)
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
    assert scheduler.row_steps == 0 and not scheduler._group_of
    assert model.submitted.count(0) == len(first.emitted) + 1  # the next one already out
    second = DecodeSession(1, PROMPTS[1], 10)
    scheduler.add(second)
    while scheduler.active:
        scheduler.poll()
    assert scheduler.row_steps > 0
    assert first.emitted == fake_greedy(PROMPTS[0], 10)
    assert second.emitted == fake_greedy(PROMPTS[1], 10)


# -- real stages --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def export2(tiny_exports):
    return tiny_exports.get([(0, 2), (2, 4)])


def alone(pipe, prompt, speculative: bool) -> list[int]:
    if speculative:
        return list(generate_speculative(pipe, prompt, N, k=3, prefill_chunk=4))
    return list(generate_greedy(pipe, prompt, N, prefill_chunk=4))


def interleaved(pipe, speculative: bool) -> list[list[int]]:
    sessions = [DecodeSession(10 + i, p, N, k=3 if speculative else 0, prefill_chunk=4)
                for i, p in enumerate(PROMPTS)]
    for update in run_sessions(pipe, sessions):
        assert update.session.error is None, update.session.error
    return [s.emitted for s in sessions]


@pytest.mark.parametrize("speculative", [False, True])
def test_interleaved_streams_on_one_compiled_model_equal_each_alone(export2, speculative) -> None:
    """Several InferRequests of one compiled model on CPU keep their own KV: safe to share."""
    chain = LocalChain.load(str(export2), EXACT)
    want = [alone(chain, p, speculative) for p in PROMPTS]
    assert interleaved(chain, speculative) == want
    # one compiled model per stage, one InferRequest (own KV state) per stream on it
    for runner in chain.runners:
        requests = {id(runner.streams[10 + i].request) for i in range(len(PROMPTS))}
        assert len(requests) == len(PROMPTS)


@pytest.mark.parametrize("speculative", [False, True])
def test_pipelined_streams_across_processes_equal_each_alone(export2, dp_hosts, dp_spawn,
                                                             speculative) -> None:
    from test_cluster_pipeline import chain_in_processes

    pipe = chain_in_processes(export2, dp_hosts, dp_spawn, 2)
    try:
        want = [alone(pipe, p, speculative) for p in PROMPTS]
        assert interleaved(pipe, speculative) == want
        assert pipe.stats.errors == 0 and pipe.stats.timeouts == 0
    finally:
        pipe.close()


@pytest.mark.parametrize("row_groups", [1, 2])
def test_row_groups_across_processes_equal_each_alone(export2, dp_hosts, dp_spawn,
                                                      row_groups) -> None:
    """Greedy streams and a speculative one batched as rows of one inference per stage
    (joining after their prefill, leaving as they finish, padded and rewound per row)."""
    from test_cluster_pipeline import chain_in_processes

    pipe = chain_in_processes(export2, dp_hosts, dp_spawn, 2)
    try:
        lengths = [N, N - 5, N + 3, N - 9]
        want = [list(generate_greedy(pipe, p, n, prefill_chunk=4))
                for p, n in zip(PROMPTS, lengths, strict=True)]
        want_spec = alone(pipe, PROMPTS[1], speculative=True)
        sessions = [DecodeSession(10 + i, p, n, prefill_chunk=4)
                    for i, (p, n) in enumerate(zip(PROMPTS, lengths, strict=True))]
        spec = DecodeSession(20, PROMPTS[1], N, k=3, prefill_chunk=4)
        pipe.compact_threshold = 2  # re-form groups (compacting rows) as padding piles up
        scheduler = StreamScheduler(pipe, row_groups)
        for session in [*sessions, spec]:
            scheduler.add(session)
        while scheduler.active:
            for update in scheduler.poll():
                assert update.session.error is None, update.session.error
        assert [s.emitted for s in sessions] == want and spec.emitted == want_spec
        assert scheduler.rows_stepped > scheduler.row_steps > 0  # some steps carried 2+ rows
        assert pipe.compactions > 0
        assert not pipe.stage0.groups  # finished rows left; empty groups were disbanded
        assert pipe.stats.errors == 0 and pipe.stats.timeouts == 0
        # bad regroups are refused before anything is sent, and the pipeline keeps serving
        from dataplane.cluster import DataPlaneError
        from dataplane.runtime import StageError
        from dataplane.scheduler import GROUP_ID_BASE

        with pytest.raises(StageError, match="not open"):
            pipe.regroup(GROUP_ID_BASE, [99])
        pipe.open(30)
        pipe.reset(30)
        rid = pipe.submit(30, np.array(PROMPTS[0]), np.arange(len(PROMPTS[0])))
        with pytest.raises(DataPlaneError, match="in flight"):
            pipe.regroup(GROUP_ID_BASE, [30])
        pipe.collect(rid)
        assert list(generate_greedy(pipe, PROMPTS[0], N, prefill_chunk=4)) == want[0][:N]
    finally:
        pipe.close()


@pytest.mark.parametrize("speculative", [False, True])
def test_row_groups_in_one_process_equal_each_alone(export2, speculative) -> None:
    """Rows of one group: plain one-token rows, or speculative rows whose drafts differ in
    length (padded, then rewound per row with the next step); compaction re-forms the
    group (a low threshold makes it happen)."""
    chain = LocalChain.load(str(export2), EXACT, compact_threshold=3)
    want = [alone(chain, p, speculative=False) for p in PROMPTS]
    sessions = [DecodeSession(10 + i, p, N, prefill_chunk=4,
                              k=(1 + i) if speculative else 0) for i, p in enumerate(PROMPTS)]
    scheduler = StreamScheduler(chain, row_groups=1)
    for session in sessions:
        scheduler.add(session)
    while scheduler.active:
        scheduler.poll()
    assert [s.emitted for s in sessions] == want
    assert scheduler.rows_stepped > scheduler.row_steps > 0
    assert all(not runner.groups for runner in chain.runners)
    if speculative:
        assert sum(s.spec.accepted for s in sessions) > 0 and chain.compactions > 0
    with pytest.raises(ValueError, match=">= 0"):
        StreamScheduler(chain, row_groups=-1)


def test_stage_load_is_the_busiest_stages_share_of_the_wall_time() -> None:
    from dataplane.scheduler import StageLoad
    from dataplane.speculative import busiest_stage_share

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
    from dataplane.sessions import PROBE_EVERY
    from dataplane.speculative import StepCost

    class OneAhead:  # always proposes one token: the last token + 1
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
    from dataplane.sessions import PROBE_EVERY

    session = DecodeSession(0, [1, 2, 3], PROBE_EVERY + 4, k=6, auto_k=True)
    assert session.choose_k() == 4  # enough budget left: measure
    session.stats.new_tokens = 4
    assert session.choose_k() == 0  # PROBE_EVERY tokens to go: nothing left to gain


def drive_with_kv_losses(chain, session: DecodeSession, lose_at: set[int]) -> list[int]:
    """Step ``session`` on ``chain``; before the steps numbered in ``lose_at`` the stream's
    KV is wiped on every stage (as when a node went down) and the session restarted."""
    sid = session.stream_id
    chain.open(sid)
    chain.reset(sid)
    steps = 0
    while not session.done:
        if steps in lose_at:
            chain.reset(sid)
            session.restart()
        plan = session.plan()
        reply = chain.step(sid, plan.token_ids, plan.positions, plan.logits_idx,
                           plan.want_logits, mask_tail=plan.rewind)
        session.advance(reply)
        steps += 1
    return session.emitted


@pytest.mark.parametrize("speculative", [False, True])
def test_a_restarted_session_replays_its_tokens_and_continues_as_if_nothing_happened(
        export2, speculative) -> None:
    chain = LocalChain.load(str(export2), EXACT)
    for prompt in PROMPTS[:2]:
        want = alone(chain, prompt, speculative)
        session = DecodeSession(5, prompt, N, k=3 if speculative else 0, prefill_chunk=4)
        # step 1 is inside the prompt's prefill; the others after 1 and several tokens
        assert drive_with_kv_losses(chain, session, {1, 3, 7}) == want
        assert session.restarts == 3
        if speculative:  # the lost steps are not counted as decode steps
            assert session.spec.steps == len(session.k_used)


def test_restart_replays_prompt_and_emitted_but_the_last_at_their_positions() -> None:
    model = CountingModel()
    session = DecodeSession(0, [1, 2, 3, 4, 5], 8, prefill_chunk=4)
    drive_with_kv_losses(model, session, {4})  # 2 prefill steps, 2 decode steps, then lost
    replay = [s for s in model.steps if s[1]][4:6]
    assert replay[0][1:3] == ([1, 2, 3, 4], [0, 1, 2, 3])
    assert replay[1][1] == [5, *session.emitted[:2]] and replay[1][2] == [4, 5, 6]
    decode = [s for s in model.steps if s[1]][6]
    assert decode[1] == [session.emitted[2]] and decode[2] == [7]
    assert session.emitted == fake_greedy([1, 2, 3, 4, 5], 8)
