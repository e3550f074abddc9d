"""Prefill planning: the step-cost fit, chunk choice, and pipelined prefill on a cluster
giving the same tokens as one chunk at a time."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from zctl.engine import prefill_planner
from zctl.engine.prefill import (
    FAIR_MIN_CHUNK,
    FUSED_BUDGET,
    FUSED_SHARE,
    MAX_CHUNK,
    MIN_CHUNK,
    MODELLED_PROMPT,
    PAGED_PRIOR,
    SHORT_PREFILL,
    STATEFUL_PRIOR,
    FusedChunkBudget,
    PrefillCost,
    StepCostModel,
    fair_chunk,
    lone_chunk,
    pipelined_ms,
    split,
)
from zctl.engine.prefill_planner import PrefillPlanner
from zctl.engine.scheduler import StreamScheduler, generate_greedy, run_sessions
from zctl.engine.sessions import DecodeSession


def test_the_fit_recovers_the_four_terms() -> None:
    truth = StepCostModel(3.0, 0.1, 2e-3, 5e-5)
    cost = PrefillCost(prior=StepCostModel(9.0, 9.0, 9.0, 9.0))
    assert cost.model == cost.prior  # nothing observed yet
    rng = np.random.default_rng(0)
    for _ in range(40):
        t, p = int(rng.integers(16, 512)), int(rng.integers(0, 4000))
        cost.observe(t, p, truth.ms(t, p))
    fitted = cost.model
    assert fitted.fixed_ms == pytest.approx(3.0, rel=1e-6)
    assert fitted.per_token_ms == pytest.approx(0.1, rel=1e-6)
    assert fitted.per_past_ms == pytest.approx(2e-3, rel=1e-6)
    assert fitted.per_self_ms == pytest.approx(5e-5, rel=1e-6)


def test_terms_the_samples_cannot_tell_keep_the_prior() -> None:
    prior = StepCostModel(2.0, 0.2, 1e-3, 1e-4)
    cost = PrefillCost(prior)
    for _ in range(10):
        cost.observe(1, 100, 5.0)  # decode-like steps are not prefill samples
    assert cost.model == prior
    truth = StepCostModel(1.0, 0.3, 1e-3, 2e-5)
    for t in (32, 64, 128, 256, 512, 1024):
        cost.observe(t, 0, truth.ms(t, 0))  # every sample with no past
    assert cost.model.per_token_ms == pytest.approx(0.3)
    assert cost.model.per_self_ms == pytest.approx(2e-5)
    assert cost.model.per_past_ms == prior.per_past_ms  # not identified: the prior's
    same = PrefillCost(prior)
    for _ in range(8):
        same.observe(256, 0, 80.0)  # one shape only: the fixed term takes up the rest
    assert same.model.per_token_ms == prior.per_token_ms
    assert same.model.ms(256, 0) == pytest.approx(80.0)
    cheap = PrefillCost(prior)
    for _ in range(8):
        cheap.observe(256, 0, 20.0)  # cheaper than the prior's other terms allow
    assert cheap.model.fixed_ms == 0.0 and all(v >= 0 for v in cheap.model.terms())


def test_small_steps_with_a_large_fixed_cost_fit_sanely() -> None:
    truth = StepCostModel(15.0, 0.2, 1e-4, 5e-5)  # what chunks beside decoders cost
    cost = PrefillCost(PAGED_PRIOR)
    for t, p in [(4, 400), (5, 500), (8, 600), (9, 700), (4, 800), (104, 0), (104, 104),
                 (1660, 0)]:
        cost.observe(t, p, truth.ms(t, p))
    fitted = cost.model
    assert fitted.fixed_ms == pytest.approx(15.0, rel=0.05)
    assert fitted.per_token_ms == pytest.approx(0.2, rel=0.2)


def test_pipelined_makespan() -> None:
    flat = StepCostModel(0.0, 1.0, 0.0, 0.0)
    assert pipelined_ms([100], 0, 2, flat) == 200  # one chunk: the stages one after another
    assert pipelined_ms([50, 50], 0, 2, flat) == 150  # two: stage 0 takes chunk 2 meanwhile
    assert pipelined_ms([25] * 4, 0, 1, flat) == 100
    assert split(10, 4) == [4, 4, 2]


def test_a_costly_past_keeps_a_lone_prompt_in_one_step() -> None:
    assert lone_chunk(2048, 0, 2, STATEFUL_PRIOR) == 2048  # the stateful CPU kernel
    chunk = lone_chunk(2048, 0, 2, PAGED_PRIOR)  # a past costs what the step's own tokens do
    free_past = PAGED_PRIOR
    assert MIN_CHUNK <= chunk < 2048  # pipelined through the two stages
    assert pipelined_ms(split(2048, chunk), 0, 2, free_past) < pipelined_ms([2048], 0, 2,
                                                                              free_past)
    assert lone_chunk(20_000, 0, 1, STATEFUL_PRIOR) == MAX_CHUNK
    no_past_cost = StepCostModel(2.0, 0.2, 0.0, 1e-3)  # a fit that says cutting would pay
    assert lone_chunk(2048, 0, 1, no_past_cost) == 2048  # nothing overlaps on one stage


def test_a_fair_chunk_costs_about_one_decode_step() -> None:
    cost = StepCostModel(2.0, 0.2, 1e-3, 0.0)
    chunk = fair_chunk(12.0, 1000, cost)
    assert cost.ms(chunk, 1000) <= 12.0 < cost.ms(chunk + 1, 1000)
    assert fair_chunk(1.0, 1000, cost) == FAIR_MIN_CHUNK  # never below the floor
    assert fair_chunk(1e6, 0, cost) == MAX_CHUNK
    assert fair_chunk(1.0, 1000, cost, left=SHORT_PREFILL) == SHORT_PREFILL  # short: whole
    assert fair_chunk(1.0, 1000, cost, left=SHORT_PREFILL + 1) == FAIR_MIN_CHUNK


def test_a_fused_chunk_adds_a_share_of_the_decode_step_it_rides_in() -> None:
    cost = StepCostModel(5.0, 0.2, 1e-3, 0.0)
    chunk = fair_chunk(12.0, 1000, cost, fused=True)  # the step's fixed cost is paid
    added = cost.ms(chunk, 1000) - cost.fixed_ms
    assert added <= FUSED_SHARE * 12.0 < added + cost.ms(1, 1000) - cost.fixed_ms
    assert chunk > fair_chunk(12.0, 1000, cost)


def test_a_fused_allowance_halves_over_the_budget_and_grows_well_under_it() -> None:
    budget = FusedChunkBudget()
    assert budget.tokens == FAIR_MIN_CHUNK  # nothing measured: a small start
    budget.observe(4, step_ms=10.0, decode_ms=10.0)
    assert budget.tokens == 5  # well under: a quarter more, one token at the least
    budget.tokens = 40
    budget.observe(40, step_ms=10.0 * FUSED_BUDGET + 1, decode_ms=10.0)
    assert budget.tokens == 20  # over: halved
    budget.observe(20, step_ms=10.0 * FUSED_BUDGET - 1, decode_ms=10.0)
    assert budget.tokens == 20  # near the budget: kept
    budget.observe(3, step_ms=10.0 * FUSED_BUDGET - 1, decode_ms=10.0)
    budget.observe(3, step_ms=10.0, decode_ms=10.0)
    assert budget.tokens == 20  # a prompt's short last chunk never shrinks it
    budget.observe(64, step_ms=100.0, decode_ms=10.0)
    assert budget.tokens == 20  # nor a step that carried more (chunks the model sized)
    budget.observe(20, step_ms=10.0, decode_ms=10.0)
    assert budget.tokens == 25
    for _ in range(8):
        budget.observe(budget.tokens, step_ms=100.0, decode_ms=10.0)
    assert budget.tokens == 1  # never below one token
    budget.observe(1, step_ms=0.0, decode_ms=10.0)  # nothing measured: nothing learnt
    budget.observe(1, step_ms=5.0, decode_ms=0.0)
    budget.observe(0, step_ms=50.0, decode_ms=10.0)
    assert budget.tokens == 1


def test_long_prompts_in_one_group_step_share_its_allowance_first_come_first_served() -> None:
    planner = PrefillPlanner(PAGED_PRIOR)
    first = DecodeSession(0, list(range(MODELLED_PROMPT + 100)), 4)
    second = DecodeSession(1, list(range(MODELLED_PROMPT + 1)), 4)
    assert planner.fused_chunks(7, [first, second]) == [FAIR_MIN_CHUNK, 1]  # one token at least
    planner.note_step(1, [(FAIR_MIN_CHUNK, 0), (1, 0)], (7, FAIR_MIN_CHUNK))
    planner.note_answer(1, [10.0])  # no decode figure yet: nothing learnt of the group
    planner.note_answer(2, [10.0])  # a decode step: the figure
    planner.note_step(3, [(4, 0)], (7, 4))
    planner.note_answer(3, [10.5])  # 4 prompt tokens cost 0.5 ms: the allowance grows
    assert planner.fused_chunks(7, [second, first]) == [5, 1]
    assert planner.fused_chunks(8, [first]) == [FAIR_MIN_CHUNK]  # another group: its own
    planner.note_step(4, [(1, 0)], (8, 1))
    planner.forget_step(4)
    assert planner.notes == 0


def test_shorter_prompts_ride_in_chunks_the_cost_model_sizes() -> None:
    """A prompt of at most MODELLED_PROMPT tokens (whose rows the model prices well) takes
    the model's fused chunk, whole if short, and leaves the allowance to the long ones."""
    planner = PrefillPlanner(PAGED_PRIOR)
    planner.note_answer(1, [20.0])  # a decode step: the figure
    short = DecodeSession(0, list(range(SHORT_PREFILL)), 4)
    medium = DecodeSession(1, list(range(MODELLED_PROMPT)), 4)
    long = DecodeSession(2, list(range(MODELLED_PROMPT + 1)), 4)
    modelled = fair_chunk(20.0, 0, planner.cost.model, left=MODELLED_PROMPT, fused=True)
    assert FAIR_MIN_CHUNK < modelled < MODELLED_PROMPT
    assert planner.fused_chunks(7, [short, medium, long]) == [SHORT_PREFILL, modelled,
                                                              FAIR_MIN_CHUNK]


def test_steps_of_several_rows_fit_the_same_terms() -> None:
    truth = StepCostModel(3.0, 0.15, 2e-4, 4e-5)
    fit = PrefillCost(StepCostModel(1.0, 1.0, 1.0, 1.0))
    rng = np.random.default_rng(2)
    for _ in range(40):  # a chunk beside 1 to 4 decoding rows at their own contexts
        rows = [(int(rng.integers(8, 300)), int(rng.integers(0, 2000)))]
        rows += [(1, int(rng.integers(10, 3000))) for _ in range(int(rng.integers(1, 5)))]
        ms = truth.fixed_ms + sum(truth.ms(t, p) - truth.fixed_ms for t, p in rows)
        fit.observe_rows(rows, ms)
    np.testing.assert_allclose(fit.model.terms(), truth.terms(), rtol=1e-3)


class _Counting:
    """An executor wrapper that records the most steps of one stream in flight at once."""

    def __init__(self, pipe) -> None:
        self.pipe, self.in_flight, self.most = pipe, {}, 0

    def __getattr__(self, name):
        return getattr(self.pipe, name)

    def submit(self, step):
        rid = self.pipe.submit(step)
        self.in_flight[rid] = step.stream_id
        self.most = max(self.most, list(self.in_flight.values()).count(step.stream_id))
        return rid

    def collect_any(self, timeout_s=None):
        reply = self.pipe.collect_any(timeout_s)
        if reply is not None:
            self.in_flight.pop(reply.request_id, None)
        return reply


def test_pipelined_prefill_gives_the_tokens_of_one_chunk_at_a_time(dp_threaded2, dp_export2):
    local = LocalChain.load(str(dp_export2))
    rng = np.random.default_rng(5)
    prompt = [0, *(int(t) for t in rng.integers(4, 384, 90))]
    want = list(generate_greedy(local, prompt, 8, prefill_chunk=8))  # one chunk at a time
    pipe = _Counting(dp_threaded2[0])
    session = DecodeSession(3, prompt, 8, prefill_chunk=8)
    scheduler = StreamScheduler(pipe)
    scheduler.prefill.cost.prior = StepCostModel(1.0, 1.0, 0.0, 0.0)  # chunks pay: pipeline
    scheduler.add(session)
    while scheduler.active:
        scheduler.poll(5.0)
    assert session.error is None and session.emitted == want
    assert pipe.most == pipe.num_stages  # chunk k+1 entered stage 0 while chunk k was on stage 1


def _two_short_and_a_long(reference):
    """Two short prompts' sessions, a 241-token one's, and their tokens alone on
    ``reference``."""
    short = [[0, 5, 6, 7], [0, 9, 10, 11]]
    long = [0, *range(20, 260)]
    want = [list(generate_greedy(reference, p, 12, stream_id=30 + i))
            for i, p in enumerate([*short, long])]
    return [DecodeSession(i, p, 12) for i, p in enumerate(short)], DecodeSession(2, long, 12), want


def test_a_prefill_beside_decoding_streams_is_cut_into_fair_chunks(dp_export2):
    local = LocalChain.load(str(dp_export2))
    sessions, late, want = _two_short_and_a_long(local)
    chunks = []  # (tokens planned by a poll, whether the short streams were decoding)
    scheduler = StreamScheduler(local)
    for s in sessions:
        scheduler.add(s)
    for _ in range(3):
        scheduler.poll()
    scheduler.add(late)
    while scheduler.active:
        left, decoding = late.prefill_left, not all(s.done for s in sessions)
        # decode steps far cheaper than any chunk: the fair chunk is the least one. (The
        # measured figure, which each decode step moves, made chunks of 6 on a slower run.)
        scheduler.prefill.decode_ms = 1e-6
        scheduler.poll()
        if late.prefill_left != left:
            chunks.append((left - late.prefill_left, decoding))
    assert [s.emitted for s in [*sessions, late]] == want
    beside = [n for n, decoding in chunks if decoding]
    assert len(beside) >= 2 and max(beside) == FAIR_MIN_CHUNK  # the decoders kept stepping
    alone = [n for n, decoding in chunks if not decoding]
    assert alone and alone[0] > FAIR_MIN_CHUNK  # the rest in one step once they were done


class _RowSteps:
    """An executor wrapper that records each ragged step's rows (their token counts)."""

    def __init__(self, pipe) -> None:
        self.pipe, self.ragged, self.alone = pipe, [], []

    def __getattr__(self, name):
        return getattr(self.pipe, name)

    def submit(self, step):
        if step.row_tokens is not None:
            self.ragged.append(list(step.row_tokens))
        else:
            self.alone.append(step.stream_id)
        return self.pipe.submit(step)


def test_a_prompt_beside_decoding_streams_rides_in_their_steps_on_paged_stages(dp_export2):
    """Split-fuse: on paged stages a prompt arriving while streams decode joins their row
    group, each chunk a ragged row of their step: they never wait for a prefill step."""
    exact = dict(precision="f32", kv_cache_precision="f32", dynamic_quantization=False)
    stateful = LocalChain.load(str(dp_export2), RuntimeSpec(**exact))
    paged = _RowSteps(LocalChain.load(str(dp_export2),
                                      RuntimeSpec(**exact, paged_attention=True)))
    sessions, late, want = _two_short_and_a_long(stateful)
    scheduler = StreamScheduler(paged, row_groups=1)
    assert scheduler.ragged
    for s in sessions:
        scheduler.add(s)
    for _ in range(4):
        scheduler.poll()
    scheduler.prefill.decode_ms = 2.0  # chunks of a few tokens: several steps carry one
    before = len(paged.ragged)
    paged.alone.clear()
    scheduler.add(late)
    while scheduler.active:
        scheduler.poll()
    assert [s.emitted for s in [*sessions, late]] == want
    fused = [rows for rows in paged.ragged[before:] if max(rows) > 1 and len(rows) > 1]
    assert len(fused) >= 3 and all(min(rows) == 1 for rows in fused)
    assert sorted(fused[0])[:2] == [1, 1]  # it joined both decoding streams' step
    assert 2 not in paged.alone  # no prefill step of its own while the others decoded
    assert scheduler.prefill.cost._samples  # the fused steps fed the cost model


class _CostedSteps(_RowSteps):
    """Ragged steps whose replies report a made-up stage cost: ``decode_ms``, plus
    ``token_ms`` for each token the prompt of stream ``prompt_id`` carries in the step
    while ``prefilling()``. ``members(group id)`` names a group step's rows in order."""

    def __init__(self, pipe, decode_ms: float, token_ms: float, prompt_id: int) -> None:
        super().__init__(pipe)
        self.decode_ms, self.token_ms, self.prompt_id = decode_ms, token_ms, prompt_id
        self.members, self.prefilling = (lambda group_id: []), (lambda: False)
        self.chunks, self._chunk = [], {}

    def submit(self, step):
        rid = super().submit(step)
        if step.row_tokens is not None and self.prefilling():
            rows = dict(zip(self.members(step.stream_id), (int(t) for t in step.row_tokens),
                            strict=True))
            self._chunk[rid] = rows.get(self.prompt_id, 0)
        return rid

    def collect_any(self, timeout_s=None):
        reply = self.pipe.collect_any(timeout_s)
        if reply is not None:
            chunk = self._chunk.pop(reply.request_id, 0)
            if chunk:
                self.chunks.append(chunk)
            reply = replace(reply, stage_ms=[self.decode_ms + self.token_ms * chunk])
        return reply


def test_a_fused_chunk_is_held_to_the_budget_its_steps_measure(dp_export2, monkeypatch):
    """A long prompt's chunks riding in the decoding rows' steps start small and, however
    cheap the cost model thinks them, are then held by the steps' measured cost to
    FUSED_BUDGET decode steps; the tokens are those of any chunking."""
    monkeypatch.setattr(prefill_planner, "MODELLED_PROMPT", 64)  # a tiny model's long prompt
    exact = dict(precision="f32", kv_cache_precision="f32", dynamic_quantization=False)
    stateful = LocalChain.load(str(dp_export2), RuntimeSpec(**exact))
    short = [[0, 5, 6, 7], [0, 9, 10, 11]]
    long = [0, *range(20, 260)]
    want = [list(generate_greedy(stateful, p, n, stream_id=30 + i))
            for i, (p, n) in enumerate([(short[0], 40), (short[1], 40), (long, 8)])]
    paged = _CostedSteps(LocalChain.load(str(dp_export2),
                                         RuntimeSpec(**exact, paged_attention=True)),
                         decode_ms=10.0, token_ms=3.0, prompt_id=2)  # t prompt tokens: 10 + 3t
    sessions = [DecodeSession(i, p, 40) for i, p in enumerate(short)]
    late = DecodeSession(2, long, 8)
    scheduler = StreamScheduler(paged, row_groups=1)
    paged.members = lambda group_id: scheduler.row_groups.formed[group_id]
    paged.prefilling = lambda: late.prefilling
    for s in sessions:
        scheduler.add(s)
    for _ in range(4):
        scheduler.poll()
    assert scheduler.prefill.decode_ms == pytest.approx(10.0)
    scheduler.add(late)
    while scheduler.active:
        scheduler.poll()
    assert [s.emitted for s in [*sessions, late]] == want
    fused, rest = paged.chunks[:-1], paged.chunks[-1]  # the rest went in once they ended
    assert rest > 1 and fused and fused[0] == FAIR_MIN_CHUNK  # the first: a small start
    within = int((FUSED_BUDGET - 1) * 10.0 / 3.0 + 1e-9)  # 10 + 3t <= 14: t <= 1
    settled = fused.index(within)
    assert settled <= 3  # halved after each step over the budget, down to it
    assert all(b == max(1, a // 2) for a, b in zip(fused[:settled], fused[1:settled + 1], strict=True))
    assert len(fused) > settled + 5 and all(c <= within for c in fused[settled:])
    assert scheduler.prefill.notes == 0  # every step answered


def test_a_short_cached_prefix_is_not_loaded_beside_decoding_streams(dp_export2):
    """Loading a cached prefix makes a prompt's first step go alone, a step the decoding
    streams wait for: beside them, a prefix under SHORT_PREFILL tokens is not worth it
    (the prompt rides in their steps from its first chunk); alone, it is loaded."""
    exact = dict(precision="f32", kv_cache_precision="f32", dynamic_quantization=False)
    paged = _RowSteps(LocalChain.load(str(dp_export2),
                                      RuntimeSpec(**exact, paged_attention=True)))
    scheduler = StreamScheduler(paged, row_groups=1, prefix_cache_tokens=4096)
    first = DecodeSession(0, [0, *range(40, 60)], 4)  # leaves a 24-token entry
    list(run_sessions_on(scheduler, [first]))
    follow = [*first.prompt, *first.emitted, *range(100, 200)]
    assert scheduler.prefixes.index is not None
    hits = scheduler.prefixes.index.stats.hits
    decoders = [DecodeSession(1, [0, 5, 6, 7], 30), DecodeSession(2, [0, 9, 10, 11], 30)]
    for s in decoders:
        scheduler.add(s)
    for _ in range(4):
        scheduler.poll()
    paged.alone.clear()
    late = DecodeSession(3, follow, 4)
    scheduler.add(late)
    list(run_sessions_on(scheduler, []))
    assert scheduler.prefixes.index.stats.hits == hits and 3 not in paged.alone
    alone = DecodeSession(4, follow, 4)  # nothing decoding now: the entry is worth loading
    list(run_sessions_on(scheduler, [alone]))
    assert scheduler.prefixes.index.stats.hits == hits + 1
    assert alone.emitted == late.emitted


def run_sessions_on(scheduler: StreamScheduler, sessions: list[DecodeSession]):
    """Add ``sessions`` and poll until the scheduler is idle."""
    for session in sessions:
        scheduler.add(session)
    while scheduler.active:
        yield scheduler.poll()


def test_run_sessions_still_steps_everything(dp_export2):
    local = LocalChain.load(str(dp_export2))
    prompts = [[0, 3, 4], [0, 8, 9, 10, 11]]
    want = [list(generate_greedy(local, p, 6, stream_id=20 + i)) for i, p in enumerate(prompts)]
    sessions = [DecodeSession(i, p, 6) for i, p in enumerate(prompts)]
    list(run_sessions(local, sessions))
    assert [s.emitted for s in sessions] == want
