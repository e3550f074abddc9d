"""Generation as per-stream state machines, and the one loop that steps them on a pipeline.

A ``DecodeSession`` is one stream's generation: it says what the stream feeds next (a
prefill chunk, or the last token plus K draft tokens at contiguous logical positions)
and what a reply emits; it never touches a pipeline. Greedy decoding is the K = 0 case.

``StreamScheduler`` is the coordinator loop, written once. On a pipeline that can
``submit`` and ``collect_any`` (``ClusterPipeline``) it keeps one step of every active
session in flight, so stage 0 computes one stream while another's activations are on
the wire or on later stages (micro-batching with async overlap, paper §7); on a pipeline
that only has ``step`` (``LocalChain``) it steps the sessions in turn. With row groups,
sessions decoding one token a step are stepped together as the rows of one inference
per stage (``StageRunner.step_rows``); a group is scheduled like one stream. ``run_session``,
``generate_greedy`` and ``generate_speculative`` are that loop with one session.

Speculative steps (paper §5): the reply's top-1 at each of the K+1 fed positions checks
the drafts; ``accept_prefix`` of them are emitted plus the target's own next token, so
the output equals greedy decoding. When sampling (temperature > 0) the reply carries the
logits and drafts are checked by rejection sampling (``dataplane.sampling``), which keeps
the target's distribution. The K - n rejected slots are rewound *with the next
step* (``mask_tail``): no extra round trip. With ``auto_k``, K is re-chosen every step by
``adapt_k`` from the acceptance measured so far and a step-cost model fitted to this
session's own steps (and the drafter's measured time per token).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dataplane.generate import GenerationStats, Pipeline, StepReply, prefill_chunks, should_stop
from dataplane.sampling import SamplingParams, draw, speculative_sample, target_probs
from dataplane.speculative import (
    Drafter,
    LookupDrafter,
    SpeculativeStats,
    StepCost,
    StepFn,
    accept_prefix,
    adapt_k,
    estimate_acceptance,
    fit_step_cost,
    rewinding_step,
)

COST_WINDOW = 64  # decode steps the online cost model is fitted to
PROBE_EVERY = 16  # with adaptive K at 0, draft one token this often to keep measuring
AUTO_K_START = 4  # adaptive K's first draft length, until a cost model is fitted


@dataclass(frozen=True)
class StepPlan:
    """What a session feeds in its next step."""

    token_ids: np.ndarray
    positions: np.ndarray
    logits_idx: np.ndarray | None  # None: only the last position
    rewind: int | np.ndarray  # rejected slots of the previous step (per row for a group)
    want_logits: bool = False  # sampling needs the logits, greedy only the top-1


class DecodeSession:
    """One stream's generation, greedy (``k=0``) or speculative, as a state machine.

    Call ``plan()`` for the next step, run it on a pipeline, hand the reply to
    ``advance()``, which returns the tokens it emits; ``done`` tells when to stop. The
    pipeline's stream must be reset before the first step (the drivers do it).
    ``k`` is the draft length (the maximum when ``auto_k``); ``cost`` fixes the cost
    model for ``auto_k`` instead of fitting it online. ``sampling`` with a temperature
    > 0 samples (drafts are then checked by rejection sampling, so the output keeps the
    target's distribution); otherwise decoding is greedy.
    """

    def __init__(self, stream_id: int, prompt_ids: Sequence[int], max_new_tokens: int,
                 stop_ids: Sequence[int] = (), *, drafter: Drafter | None = None, k: int = 0,
                 auto_k: bool = False, cost: StepCost | None = None, prefill_chunk: int = 256,
                 stats: GenerationStats | None = None,
                 sampling: SamplingParams | None = None) -> None:
        if len(prompt_ids) == 0:
            raise ValueError("the prompt has no tokens")
        if k < 0:
            raise ValueError(f"draft length k must be >= 0, got {k}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        self.stream_id = stream_id
        self.prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        self.max_new_tokens = max_new_tokens
        self.stops = frozenset(int(t) for t in stop_ids)
        self.drafter = drafter if drafter is not None else LookupDrafter()
        self.k, self.auto_k, self.cost = k, auto_k or cost is not None, cost
        self.sampling = sampling if sampling is not None and not sampling.greedy else None
        self._rng = self.sampling.rng() if self.sampling is not None else None
        self.stats = stats if stats is not None else SpeculativeStats()
        self.spec = self.stats if isinstance(self.stats, SpeculativeStats) else SpeculativeStats()
        self.stats.prompt_tokens = self.prompt.size
        self.history = [int(t) for t in self.prompt]
        self.emitted: list[int] = []
        self.k_used: list[int] = []  # draft length asked for, per decode step
        self.error: Exception | None = None
        self._chunks = prefill_chunks(self.prompt.size, prefill_chunk)
        self._chunk = 0
        self._position = self.prompt.size  # logical position of the last emitted token
        self._draft: list[int] = []
        self._rewind = 0
        self._draft_ms: list[float] = []  # drafter time per proposed token
        self._planned_at = 0.0
        self._started_at = 0.0
        self._decode_start: float | None = None
        self.done = max_new_tokens == 0

    # -- state -----------------------------------------------------------------------
    @property
    def prefilling(self) -> bool:
        return self._chunk < len(self._chunks)

    @property
    def last_k(self) -> int:
        return self.k_used[-1] if self.k_used else 0

    def fail(self, error: Exception) -> None:
        self.error, self.done = error, True

    # -- planning --------------------------------------------------------------------
    def plan(self) -> StepPlan:
        """The next step to run (prefill chunk, or last token + drafts)."""
        if self.done:
            raise RuntimeError(f"stream {self.stream_id}'s generation is over")
        now = time.perf_counter()
        self._planned_at = now
        if self.prefilling:
            lo, hi = self._chunks[self._chunk]
            if self._chunk == 0:
                self._started_at = now
            last_chunk = self._chunk == len(self._chunks) - 1
            return StepPlan(self.prompt[lo:hi], np.arange(lo, hi), None, 0,
                            last_chunk and self.sampling is not None)
        if self._decode_start is None:
            self._decode_start = now
        k_now = min(self.choose_k(), self.max_new_tokens - self.stats.new_tokens - 1)
        self.k_used.append(k_now)
        draft: list[int] = []
        if k_now > 0:
            start = time.perf_counter()
            draft = [int(t) for t in self.drafter.propose(self.history, k_now)][:k_now]
            if draft:
                self._draft_ms.append((time.perf_counter() - start) * 1e3 / len(draft))
        self._draft = draft
        self._planned_at = time.perf_counter()  # the step's cost excludes drafting
        fed = len(draft) + 1
        token = self.emitted[-1]
        return StepPlan(np.array([token, *draft], dtype=np.int64),
                        np.arange(self._position, self._position + fed),
                        np.arange(fed) if draft else None, self._rewind,
                        self.sampling is not None)

    def choose_k(self) -> int:
        """This step's draft length: ``k``, or ``adapt_k`` under the cost model."""
        if not self.auto_k or self.k == 0:
            return self.k
        cost = self.cost or self.fitted_cost()
        if cost is None:  # not enough distinct step sizes yet: alternate to measure both
            return min(self.k, AUTO_K_START) if self.spec.steps % 2 == 0 else 1
        acceptance = estimate_acceptance(self.spec.accepted, self.spec.rejections)
        k_now = adapt_k(acceptance, cost, k_max=self.k)
        if k_now == 0 and self.spec.steps % PROBE_EVERY == PROBE_EVERY - 1:
            k_now = 1  # K = 0 learns nothing: probe now and then
        return k_now

    def fitted_cost(self) -> StepCost | None:
        """``fit_step_cost`` over this session's recent decode steps, plus draft time."""
        fed, ms = self.spec.fed[-COST_WINDOW:], self.stats.step_ms[-COST_WINDOW:]
        cost = fit_step_cost(fed, ms[-len(fed):]) if fed else None
        if cost is None:
            return None
        draft_ms = float(np.median(self._draft_ms[-COST_WINDOW:])) if self._draft_ms else 0.0
        return StepCost(cost.step_ms, cost.token_ms, draft_ms)

    # -- replies ---------------------------------------------------------------------
    def advance(self, reply: StepReply) -> list[int]:
        """Take the reply to the planned step; returns the tokens it emits."""
        now = time.perf_counter()
        if self.prefilling:
            self._chunk += 1
            if self.prefilling:
                return []
            self.stats.ttft_ms = (now - self._started_at) * 1e3
            return self._emit([self._first_token(reply)], now)
        draft = self._draft
        n, following = self._check(draft, reply)
        self.drafter.accept(n)
        self._rewind = len(draft) - n
        self._position += n + 1
        spec = self.spec
        spec.steps += 1
        spec.proposed += len(draft)
        spec.accepted += n
        spec.rejections += int(self._rewind > 0)
        spec.fed.append(len(draft) + 1)
        self.stats.step_ms.append((now - self._planned_at) * 1e3)
        self.stats.stage_ms.append(reply.stage_ms)
        return self._emit([*draft[:n], following], now)

    def _first_token(self, reply: StepReply) -> int:
        if self.sampling is None:
            return int(reply.tokens[-1])
        assert self._rng is not None and reply.logits is not None
        return draw(target_probs(reply.logits.reshape(-1, reply.logits.shape[-1])[-1],
                                 self.sampling), self._rng)

    def _check(self, draft: list[int], reply: StepReply) -> tuple[int, int]:
        """How many drafts the target accepts, and the token that follows them."""
        if self.sampling is None:
            target = [int(t) for t in reply.tokens]
            n = accept_prefix(draft, target)
            return n, target[n]
        assert self._rng is not None and reply.logits is not None
        rows = reply.logits.reshape(-1, reply.logits.shape[-1])
        return speculative_sample(draft, target_probs(rows, self.sampling), self._rng)

    def _emit(self, tokens: list[int], now: float) -> list[int]:
        out = []
        for token in tokens:
            self.history.append(token)
            self.emitted.append(token)
            self.stats.new_tokens += 1
            out.append(token)
            if should_stop(token, self.stats.new_tokens, self.max_new_tokens, self.stops):
                self.done = True
                break
        if self._decode_start is not None:
            self.stats.decode_ms = (now - self._decode_start) * 1e3
        return out


@dataclass
class SessionUpdate:
    """Tokens a session emitted in one scheduler poll; ``session.done`` / ``.error`` tell the rest."""

    session: DecodeSession
    tokens: list[int]


GROUP_ID_BASE = 1 << 30  # row group ids, clear of the stream ids callers use


class StreamScheduler:
    """Steps many sessions on one pipeline: the coordinator's generation loop.

    With ``row_groups`` > 0 (and a pipeline that can ``regroup``), sessions join one of
    that many row groups once their prompt is in: a group steps all its members in one
    batched inference per stage (``StageRunner.step_rows``). Rows feeding fewer tokens
    than the longest (a speculative row with fewer drafts, a plain one-token row) are
    padded with masked slots, rewound per row with the next step. Prefill runs per stream. Groups are
    pipelined like streams, so ``row_groups`` = the number of stages keeps every stage
    busy across PCs; on one machine whose stages share cores, 1 batches the most.

    Not thread-safe (nor are the pipelines): drive it from one thread.
    """

    def __init__(self, pipeline: Pipeline, row_groups: int = 0) -> None:
        if row_groups < 0:
            raise ValueError(f"row_groups must be >= 0, got {row_groups}")
        self.pipeline = pipeline
        self.sessions: dict[int, DecodeSession] = {}  # active, by stream id
        self._in_flight: dict[int, list[DecodeSession]] = {}  # request id -> its sessions
        self._pipelined = callable(getattr(pipeline, "submit", None)) and callable(
            getattr(pipeline, "collect_any", None))
        self._rewinding_step: StepFn | None = None  # made on the first rewind
        self._turn = 0
        batching = row_groups and callable(getattr(pipeline, "regroup", None))
        self._groups: dict[int, list[DecodeSession]] = {
            GROUP_ID_BASE + i: [] for i in range(row_groups if batching else 0)}
        self._formed: dict[int, list[int]] = {gid: [] for gid in self._groups}  # on the stages
        self._group_of: dict[int, int] = {}  # stream id -> its row group
        self._group_steps: dict[int, int] = {}  # request id -> group id
        self._last_lens: list[int] = []  # real tokens per row of the last group plan
        self._pads: dict[int, int] = {}  # stream id -> padding slots of its last row step
        self._row_lens: dict[int, list[int]] = {}  # request id -> real tokens per row
        self.row_steps = 0  # batched steps run (one inference per stage for all rows)
        self.rows_stepped = 0  # stream steps they carried

    @property
    def active(self) -> bool:
        return bool(self.sessions)

    def add(self, session: DecodeSession) -> None:
        """Reset the session's stream on every stage and schedule it."""
        if session.stream_id in self.sessions or session.stream_id >= GROUP_ID_BASE:
            raise ValueError(f"stream {session.stream_id} is already generating, or its id is "
                             f"in the row groups' range (>= {GROUP_ID_BASE})")
        self.pipeline.open(session.stream_id)
        self.pipeline.reset(session.stream_id)
        if not session.done:
            self.sessions[session.stream_id] = session

    def cancel(self, stream_id: int) -> None:
        """Stop a session: its step in flight is abandoned (a reset gives a new epoch); in
        a row group its row is dropped at the group's next step."""
        session = self.sessions.pop(stream_id, None)
        if session is None:
            return
        self._pads.pop(stream_id, None)
        if self._group_of.pop(stream_id, None) is not None:
            for members in self._groups.values():
                if session in members:
                    members.remove(session)
            return
        for rid in [r for r, s in self._in_flight.items() if s == [session]]:
            del self._in_flight[rid]
        self.pipeline.reset(stream_id)

    def poll(self, timeout_s: float | None = None) -> list[SessionUpdate]:
        """Advance: start a step for every idle session or group, then take one answer (or
        none within ``timeout_s``). Finished or failed sessions leave the schedule."""
        updates = self._join_groups()
        if self._pipelined:
            updates += self._poll_pipelined(timeout_s)
        else:
            updates += self._poll_in_turn()
        for update in updates:
            if update.session.done:
                self.sessions.pop(update.session.stream_id, None)
                self._leave_group(update.session)
        updates += self._settle_groups()
        return updates

    # -- row groups ------------------------------------------------------------------
    def _busy(self) -> set[int]:
        return {id(s) for sessions in self._in_flight.values() for s in sessions}

    def _join_groups(self) -> list[SessionUpdate]:
        """Put idle one-token-a-step sessions into the smallest row group."""
        if not self._groups:
            return []
        busy = self._busy()
        for session in self.sessions.values():
            if (session.stream_id not in self._group_of and id(session) not in busy
                    and not session.prefilling and not session.done):
                gid = min(self._groups, key=lambda g: len(self._groups[g]))
                self._groups[gid].append(session)
                self._group_of[session.stream_id] = gid
        return self._settle_groups()

    def _leave_group(self, session: DecodeSession) -> None:
        gid = self._group_of.pop(session.stream_id, None)
        self._pads.pop(session.stream_id, None)
        if gid is not None and session in self._groups[gid]:
            self._groups[gid].remove(session)

    def _settle_groups(self) -> list[SessionUpdate]:
        """Send the stages each idle group's new membership (rows join, leave, disband)."""
        updates: list[SessionUpdate] = []
        in_flight = set(self._group_steps.values())
        for gid, members in self._groups.items():
            wanted = [s.stream_id for s in members]
            if gid in in_flight or wanted == self._formed[gid]:
                continue
            try:
                self.pipeline.regroup(gid, wanted)  # type: ignore[attr-defined]
            except Exception as exc:  # noqa: BLE001 - the members carry it to their callers
                self._formed[gid] = []
                for session in members:
                    session.fail(exc)
                    updates.append(SessionUpdate(session, []))
                    self.sessions.pop(session.stream_id, None)
                    self._group_of.pop(session.stream_id, None)
                members.clear()
                continue
            self._formed[gid] = wanted
        return updates

    def _units(self) -> list[tuple[int, list[DecodeSession]]]:
        """What steps next: (stream or group id, its sessions), groups first."""
        units = [(gid, members) for gid, members in self._groups.items() if members]
        units += [(sid, [s]) for sid, s in self.sessions.items() if sid not in self._group_of]
        return units

    def _plan(self, unit_id: int, sessions: list[DecodeSession]) -> StepPlan:
        """One session's plan, or the plans of a group's rows padded to one length."""
        if unit_id not in self._groups:
            return sessions[0].plan()
        plans = [s.plan() for s in sessions]
        self.row_steps += 1
        self.rows_stepped += len(plans)
        lens = [len(p.token_ids) for p in plans]
        tokens = max(lens)
        ids = np.empty((len(plans), tokens), dtype=np.int64)
        positions = np.empty((len(plans), tokens), dtype=np.int64)
        rewinds = np.empty(len(plans), dtype=np.int64)
        for row, (session, plan, n) in enumerate(zip(sessions, plans, lens, strict=True)):
            ids[row, :n] = plan.token_ids
            ids[row, n:] = plan.token_ids[-1]  # padding: masked by the next step's rewind
            positions[row] = plan.positions[0] + np.arange(tokens)
            rewinds[row] = int(plan.rewind) + self._pads.get(session.stream_id, 0)
            self._pads[session.stream_id] = tokens - n
        self._last_lens = lens
        return StepPlan(ids, positions, np.arange(tokens) if tokens > 1 else None, rewinds,
                        any(p.want_logits for p in plans))

    def _advance(self, sessions: list[DecodeSession], reply: StepReply,
                 row_lens: list[int] | None) -> list[SessionUpdate]:
        if row_lens is None:
            return [SessionUpdate(sessions[0], sessions[0].advance(reply))]
        updates = []
        per_row = reply.tokens.size // len(sessions)  # answers per row: all fed, or the last
        for row, (session, n) in enumerate(zip(sessions, row_lens, strict=True)):
            if session.done or session.stream_id not in self.sessions:
                continue  # cancelled while its row was in flight
            lo, hi = row * per_row, row * per_row + (n if per_row > 1 else 1)
            logits = reply.logits[lo:hi] if reply.logits is not None else None
            row_reply = StepReply(reply.tokens[lo:hi], logits, reply.stage_ms)
            updates.append(SessionUpdate(session, session.advance(row_reply)))
        return updates

    def _fail(self, sessions: list[DecodeSession], exc: Exception) -> list[SessionUpdate]:
        for session in sessions:
            session.fail(exc)
        return [SessionUpdate(s, []) for s in sessions]

    # -- the two ways to drive a pipeline --------------------------------------------
    def _poll_in_turn(self) -> list[SessionUpdate]:
        units = self._units()
        if not units:
            return []
        unit_id, sessions = units[self._turn % len(units)]
        self._turn += 1
        plan = self._plan(unit_id, sessions)
        grouped = unit_id in self._groups
        try:
            if grouped:
                reply = self.pipeline.step(  # type: ignore[call-arg]
                    unit_id, plan.token_ids, plan.positions, plan.logits_idx, plan.want_logits,
                    mask_tail=plan.rewind)
            elif plan.rewind:
                self._rewinding_step = self._rewinding_step or rewinding_step(self.pipeline)
                reply = self._rewinding_step(unit_id, plan.token_ids, plan.positions,
                                             plan.logits_idx, plan.rewind, plan.want_logits)
            else:
                reply = self.pipeline.step(unit_id, plan.token_ids, plan.positions,
                                           plan.logits_idx, plan.want_logits)
        except Exception as exc:  # noqa: BLE001 - the session carries it to its caller
            return self._fail(sessions, exc)
        return self._advance(sessions, reply, self._last_lens if grouped else None)

    def _poll_pipelined(self, timeout_s: float | None) -> list[SessionUpdate]:
        pipe: Any = self.pipeline
        updates: list[SessionUpdate] = []
        busy = self._busy()
        for unit_id, sessions in self._units():
            if any(id(s) in busy for s in sessions):
                continue
            plan = self._plan(unit_id, sessions)
            try:
                rid = pipe.submit(unit_id, plan.token_ids, plan.positions,
                                  plan.logits_idx, plan.want_logits, mask_tail=plan.rewind)
            except Exception as exc:  # noqa: BLE001
                updates += self._fail(sessions, exc)
                continue
            self._in_flight[rid] = list(sessions)
            if unit_id in self._groups:
                self._group_steps[rid] = unit_id
                self._row_lens[rid] = self._last_lens
        if not self._in_flight:
            return updates
        try:
            reply = pipe.collect_any(timeout_s)
        except Exception as exc:  # noqa: BLE001 - a failed or expired request
            rid = getattr(exc, "request_id", -1)
            failed = self._in_flight.pop(rid, None)
            self._group_steps.pop(rid, None)
            self._row_lens.pop(rid, None)
            if failed is None:
                failed = [s for sessions in self._in_flight.values() for s in sessions]
                self._in_flight.clear()
                self._group_steps.clear()
                self._row_lens.clear()
            return updates + self._fail(failed, exc)
        if reply is None:
            return updates
        sessions = self._in_flight.pop(reply.request_id, None)
        self._group_steps.pop(reply.request_id, None)
        row_lens = self._row_lens.pop(reply.request_id, None)
        if sessions is not None:
            updates += self._advance(sessions, reply, row_lens)
        return updates


def run_sessions(pipeline: Pipeline, sessions: Sequence[DecodeSession], row_groups: int = 0
                 ) -> Iterator[SessionUpdate]:
    """Run sessions concurrently to the end, yielding every update (raises nothing:
    a failed session has ``error`` set). ``row_groups``: see ``StreamScheduler``."""
    scheduler = StreamScheduler(pipeline, row_groups)
    for session in sessions:
        scheduler.add(session)
    while scheduler.active:
        yield from scheduler.poll()


def run_session(pipeline: Pipeline, session: DecodeSession) -> Iterator[int]:
    """Yield one session's tokens as they come; raises the error that stopped it."""
    for update in run_sessions(pipeline, [session]):
        yield from update.tokens
        if update.session.error is not None:
            raise update.session.error


def generate_greedy(pipeline: Pipeline, prompt_ids: Sequence[int], max_new_tokens: int,
                    stop_ids: Sequence[int] = (), stream_id: int = 0, prefill_chunk: int = 256,
                    stats: GenerationStats | None = None) -> Iterator[int]:
    """Yield greedy tokens one by one; the stream is reset first."""
    return run_session(pipeline, DecodeSession(
        stream_id, prompt_ids, max_new_tokens, stop_ids, prefill_chunk=prefill_chunk,
        stats=stats))


def generate_speculative(pipeline: Pipeline, prompt_ids: Sequence[int], max_new_tokens: int,
                         stop_ids: Sequence[int] = (), drafter: Drafter | None = None, k: int = 5,
                         stream_id: int = 0, stats: GenerationStats | None = None,
                         prefill_chunk: int = 256, cost: StepCost | None = None,
                         auto_k: bool = False, sampling: SamplingParams | None = None
                         ) -> Iterator[int]:
    """Yield exactly the tokens ``generate_greedy`` yields, verifying up to ``k`` drafts a step.

    ``drafter`` defaults to a LookupDrafter. With a ``cost`` model (or ``auto_k``, which
    fits one online) K is re-chosen every step by ``adapt_k`` (``k`` is then the maximum).
    A ``SpeculativeStats`` passed as ``stats`` also gets the draft counters. The stream is
    reset first; rejected slots of the last step are left in its KV. With ``sampling``
    (temperature > 0) the tokens are sampled and keep the target's distribution instead.
    """
    return run_session(pipeline, DecodeSession(
        stream_id, prompt_ids, max_new_tokens, stop_ids, drafter=drafter, k=k, auto_k=auto_k,
        cost=cost, prefill_chunk=prefill_chunk, stats=stats, sampling=sampling))
