"""The coordinator's generation loop, written once: ``StreamScheduler`` steps many
``DecodeSession``s on one ``Executor``.

It keeps one step of every active session (or row group) submitted, so on a
``ClusterHead`` stage 0 computes one stream while another's activations are on the wire or
on later stages (micro-batching with async overlap, paper §7); a ``LocalChain`` computes
each step as it is submitted, so there the sessions take turns. With row groups, sessions
are stepped together as the rows of one inference per stage (``StageRunner.step_rows``);
a group is scheduled like one stream. ``run_session``, ``generate_greedy`` and
``generate_speculative`` are that loop with one session.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from zctl.engine.drafting import Drafter, StageLoad, StepCost
from zctl.engine.executor import Executor, Step, StepError, StepReply
from zctl.engine.long_rope import long_rope_prompt
from zctl.engine.pipelined import PipelinedSession
from zctl.engine.prefill import PAGED_PRIOR, STATEFUL_PRIOR
from zctl.engine.prefill_pieces import ANYWHERE, PieceRule
from zctl.engine.prefill_planner import PrefillPlanner
from zctl.engine.prefix_cache_manager import PrefixCacheManager
from zctl.engine.prefix_index import PrefixIndexStats
from zctl.engine.row_groups import GROUP_ID_BASE, RowGroups
from zctl.engine.row_plans import RowsPlan
from zctl.engine.sampling import SamplingParams
from zctl.engine.sessions import DecodeSession
from zctl.engine.stats import GenerationStats

log = logging.getLogger("zctl.engine.scheduler")

@dataclass
class SessionUpdate:
    """Tokens a session emitted in one scheduler poll; ``session.done`` / ``.error`` tell the rest."""

    session: DecodeSession
    tokens: list[int]


class StreamScheduler:
    """Steps many sessions on one executor: the coordinator's generation loop.

    With ``row_groups`` > 0 (on stages that support row groups), sessions join one of
    that many row groups once their prompt is in: a group steps all its members in one
    batched inference per stage (``StageRunner.step_rows``; the scheduler's ``RowGroups``
    keep who steps in which). On paged stages the rows are
    ragged (``zctl.engine.row_plans``): each feeds its own token count, and a prompt arriving
    while others decode joins a group so its chunks ride in their steps (split-fuse). On
    stateful stages rows feeding fewer tokens than the longest (a speculative row with
    fewer drafts, a plain one-token row) are padded with masked slots, rewound per row
    with the next step, and prefill runs per stream. Groups are
    pipelined like streams, so ``row_groups`` = the number of stages keeps every stage
    busy across PCs; on one machine whose stages share cores, 1 batches the most.
    While several streams keep a stage computing >= SATURATED of the time (``load``; with
    ``shared_cores``, the stages together), adaptive-K sessions draft nothing; a fixed K
    is left as asked.

    Where the executor computes one-query steps (``one_query``: paged stages), a decode
    step of several tokens (a verification step) is one, and a row group's step that
    carries a prompt's piece (computed together) feeds one token of every other row.

    A prompt is prefilled in chunks sized from the stages' measured step costs
    (``zctl.engine.prefill``; the scheduler's ``PrefillPlanner`` keeps the figures): alone, the
    chunking that gives its first token soonest, its chunks following each other through
    the stages without waiting for answers (on an executor whose ``overlaps_steps``);
    beside streams that are decoding, chunks that add a share of one of their steps,
    riding in their group's steps (paged, held to a measured budget) or one at a time
    between them (stateful). With ``prefix_cache_tokens`` > 0 (on stages that support
    it), a finished stream's KV stays on the stages as a prefix entry and a running
    stream's prompt is a source: a new prompt starting with either's tokens loads that KV
    and prefills only the rest (the scheduler's ``PrefixCacheManager``); a session whose
    cached prefix failed to load on a later stage is prefilled in full.

    Not thread-safe (nor are the executors): drive it from one thread.
    """

    def __init__(self, executor: Executor, row_groups: int = 0, shared_cores: bool = False,
                 prefix_cache_tokens: int = 0, prefix_stats: PrefixIndexStats | None = None,
                 pieces: PieceRule = ANYWHERE, one_query: bool = True) -> None:
        if row_groups < 0:
            raise ValueError(f"row_groups must be >= 0, got {row_groups}")
        self.executor = executor
        self.sessions: dict[int, DecodeSession] = {}  # active, by stream id
        self._in_flight: dict[int, list[DecodeSession]] = {}  # request id -> its sessions
        batching = row_groups and executor.row_groups_supported
        self.row_groups = RowGroups(row_groups if batching else 0)
        self._group_steps: dict[int, int] = {}  # request id -> group id
        self._row_answers: dict[int, list[tuple[int, int]]] = {}  # request id -> each row's
        # slice of the reply's answers
        self.row_steps = 0  # batched steps run (one inference per stage for all rows)
        self.rows_stepped = 0  # stream steps they carried
        self.load = StageLoad(shared_cores=shared_cores)
        paged = executor.paged_attention
        # paged stages step a group's rows ragged: a prompt's chunks ride in its decode steps
        self.ragged = paged and bool(self.row_groups)
        self.overlaps = executor.overlaps_steps
        self.prefill = PrefillPlanner(PAGED_PRIOR if paged else STATEFUL_PRIOR,
                                      executor.num_stages, self.overlaps, shared_cores)
        # where prompts are cut into steps (zctl.engine.prefill_pieces): canonical pieces
        # make a cached prompt, a replayed one and a cold one compute the same
        self.pieces = pieces
        # decode steps of several tokens (a verification step) and a replay's emitted
        # tokens as one-query steps, where the stages compute them: bit for bit the single
        # decode steps' tokens (else they are computed together, as a prompt's piece)
        self.one_query = one_query and executor.one_query_supported
        self.prefixes = PrefixCacheManager(executor, prefix_cache_tokens, prefix_stats, pieces)

    @property
    def active(self) -> bool:
        return bool(self.sessions)

    def add(self, session: DecodeSession) -> None:
        """Reset the session's stream on every stage and schedule it."""
        if session.stream_id in self.sessions or session.stream_id >= GROUP_ID_BASE:
            raise ValueError(f"stream {session.stream_id} is already generating, or its id is "
                             f"in the row groups' range (>= {GROUP_ID_BASE})")
        session.long_rope = long_rope_prompt(session.prompt.size,
                                             self.executor.rope_short_context)
        self.executor.open(session.stream_id)
        self.executor.reset(session.stream_id, session.long_rope)
        session.pieces = self.pieces
        session.one_query = self.one_query
        if not session.done:
            self.sessions[session.stream_id] = session
            self.prefixes.load(session, fused=self.ragged and self._beside_decoders(session))

    def cancel(self, stream_id: int) -> None:
        """Stop a session: its step in flight is abandoned and its KV slots are freed on
        every stage (closing gives a new epoch); in a row group its row is dropped when the
        group is next re-formed, before its next step."""
        session = self.sessions.pop(stream_id, None)
        if session is None:
            return
        self.prefixes.untrack(stream_id)
        if self.row_groups.leave(session):
            return
        for rid in [r for r, s in self._in_flight.items() if s == [session]]:
            del self._in_flight[rid]
            self.prefill.forget_step(rid)
        self.executor.close_stream(stream_id)

    def poll(self, timeout_s: float | None = None) -> list[SessionUpdate]:
        """Advance: start a step for every idle session or group, then take one answer (or
        none within ``timeout_s``). Finished or failed sessions leave the schedule."""
        updates = self._join_groups()
        updates += self._poll_executor(timeout_s)
        for update in updates:
            if update.session.done:
                self._retire(update.session)
        updates += self._settle_groups()
        return updates

    def _retire(self, session: DecodeSession) -> None:
        """A finished session leaves the schedule: its row group drops its row at the next
        settle; a stream stepped on its own is freed on every stage now (nothing of it is
        in flight: it finished on its last reply)."""
        if self.sessions.pop(session.stream_id, None) is None:
            return
        grouped = session.stream_id in self.row_groups.group_of
        in_flight = any(session in s for s in self._in_flight.values())
        if not in_flight:
            self.prefixes.save(session, alone=not grouped)
        self.row_groups.leave(session)
        if not grouped and not in_flight:
            try:
                self.executor.close_stream(session.stream_id)
            except Exception:  # noqa: BLE001 - a broken executor: the next reset starts over
                pass

    # -- row groups ------------------------------------------------------------------
    def _busy(self) -> dict[int, int]:
        """Steps in flight per session (by id; a session with none is absent). A plain
        dict read with ``get``: a Counter's missing key costs a Python-level call, and
        this is read for every unit on every poll."""
        busy: dict[int, int] = {}
        for sessions in self._in_flight.values():
            for session in sessions:
                busy[id(session)] = busy.get(id(session), 0) + 1
        return busy

    def _join_groups(self) -> list[SessionUpdate]:
        """Put idle one-token-a-step sessions into the smallest row group."""
        groups = self.row_groups
        if not groups:
            return []
        busy = self._busy()
        joining = [s for s in self.sessions.values() if s.stream_id not in groups.group_of
                   and id(s) not in busy and self._would_group(s)]
        for session in joining:
            groups.join(session)
        return self._settle_groups()

    def _would_group(self, session: DecodeSession) -> bool:
        """Whether a session outside the row groups joins one when next idle: if groups
        exist and it is not the only stream decoding, once its prompt is in, or on paged
        stages (ragged rows) while others decode, so its chunks ride in their steps. A lone
        stream steps on its own: a one-row group computes the same, but its per-row inputs
        cost ~0.3 ms more host time a token (measured on SmolLM2, 2 stages); so does a lone
        prompt, whose chunks pipeline through the stages instead."""
        if not self.row_groups or session.done:
            return False
        if session.prefilling and not (self.ragged and self._beside_decoders(session)
                                       and not self._prefix_unchecked(session)):
            return False
        if self.row_groups.group_of:
            return True
        active = [s for s in self.sessions.values()
                  if not s.done and (self.ragged or not s.prefilling)]
        return len(active) >= 2 and any(not s.prefilling for s in active)

    @staticmethod
    def _prefix_unchecked(session: DecodeSession) -> bool:
        """A prompt that started from a cached prefix and has not stepped since: its first
        chunk steps alone, so a stage that lacks the entry fails that step, not a group's."""
        return bool(session.cached_tokens) and session.prefill_position == session.cached_tokens

    def _settle_groups(self) -> list[SessionUpdate]:
        """Send the stages each idle group's new membership (rows join, leave, disband)."""
        updates: list[SessionUpdate] = []
        groups = self.row_groups
        for gid, wanted in groups.regroups_due(set(self._group_steps.values())):
            try:
                self.executor.regroup(gid, wanted)
            except Exception as exc:  # noqa: BLE001 - the members carry it to their callers
                for session in groups.disband(gid):
                    session.fail(exc)
                    updates.append(SessionUpdate(session, []))
                    self.sessions.pop(session.stream_id, None)
                continue
            groups.mark_formed(gid, wanted)
        return updates

    def _units(self) -> list[tuple[int, list[DecodeSession]]]:
        """What steps next: (stream or group id, its sessions), groups first."""
        units = self.row_groups.units()
        group_of = self.row_groups.group_of
        units += [(sid, [s]) for sid, s in self.sessions.items() if sid not in group_of]
        return units

    def _plan(self, unit_id: int, sessions: list[DecodeSession]
              ) -> tuple[Step, RowsPlan | None]:
        """One session's plan, or a group's rows as one step (ragged on paged stages, else
        padded to one length)."""
        # Several streams on saturated stages: adaptive K drafts nothing (drafts would only
        # take compute from the other streams); a lone stream's drafts fill its own idle time.
        cap = 0 if len(self.sessions) > 1 and self.load.saturated() else None
        for session in sessions:
            session.k_cap = cap
        if unit_id not in self.row_groups:
            sessions[0].one_token = False
            return sessions[0].plan(), None
        self._size_fused(unit_id, [s for s in sessions if s.prefilling])
        # A step is one-query or not, every row alike: a prompt's piece riding in it is
        # computed together, so the rows beside it feed one token each this step.
        piece = self.one_query and any(s.feeds_prompt for s in sessions)
        for session in sessions:
            session.one_token = piece
        plans = [s.plan() for s in sessions]
        self.row_steps += 1
        self.rows_stepped += len(plans)
        rows = self.row_groups.step(unit_id, sessions, plans, self.ragged)
        return rows.step, rows

    def _advance(self, sessions: list[DecodeSession], reply: StepReply,
                 answers: list[tuple[int, int]] | None) -> list[SessionUpdate]:
        """Hand each session its part of the reply (a group's rows: their ``answers``)."""
        self.load.observe(time.perf_counter(), reply.stage_ms)
        updates = []
        for row, session in enumerate(sessions):
            if session.done or session.stream_id not in self.sessions:
                continue  # failed or cancelled while its step was in flight
            if answers is None:
                row_reply = reply
            else:
                lo, hi = answers[row]
                logits = reply.logits[lo:hi] if reply.logits is not None else None
                row_reply = StepReply(reply.tokens[lo:hi], logits, reply.stage_ms,
                                      logprob_rows=reply.logprob_rows)
            prefilling = session.prefilling
            try:
                emitted = session.advance(row_reply)
            except Exception as exc:  # noqa: BLE001 - the stream's own (its grammar refused
                session.fail(exc)  # every token): it fails alone, its KV freed as it retires
                updates.append(SessionUpdate(session, []))
                continue
            updates.append(SessionUpdate(session, emitted))
            if isinstance(session, PipelinedSession):
                updates += self._cancel_runs(session)
            if prefilling and not session.prefilling:
                self.prefixes.track(session)
        return updates

    def _cancel_runs(self, session: PipelinedSession) -> list[SessionUpdate]:
        """Cancel the runs in flight the session's last answer showed to be wrong: on every
        stage, in order with its steps; their answers are never collected."""
        cancel = session.take_cancel()
        if cancel is None:
            return []
        rids = [r for r, s in self._in_flight.items() if s == [session]]  # oldest first
        for rid in rids:
            del self._in_flight[rid]
        try:
            self.executor.cancel(session.stream_id, rids, cancel.keep)
        except Exception as exc:  # noqa: BLE001 - the stream's KV is unknown now
            return self._fail([session], exc)
        return []

    def _fail(self, sessions: list[DecodeSession], exc: Exception) -> list[SessionUpdate]:
        """Fail the sessions; their other steps in flight (pipelined prefill chunks) are
        forgotten, so their answers are ignored. A session that started from a cached
        prefix and has not emitted yet starts over without it instead (a later stage may
        not have had the entry: a node that came back empty)."""
        sessions = [s for s in sessions if not self._prefill_again(s)]
        for session in sessions:
            session.fail(exc)
        for rid in [r for r, ss in self._in_flight.items() if all(s.done for s in ss)]:
            del self._in_flight[rid]
            self.prefill.forget_step(rid)
        return [SessionUpdate(s, []) for s in sessions]

    def _prefill_again(self, session: DecodeSession) -> bool:
        """Restart a session whose cached prefix may be what failed, from no cache."""
        if not session.cached_tokens or session.emitted or session.done:
            return False
        log.warning("stream %s: a step after loading its cached prefix failed; prefilling "
                    "its whole prompt (the prefix cache starts empty)", session.stream_id)
        for rid in [r for r, ss in self._in_flight.items() if session in ss]:
            del self._in_flight[rid]
            self.prefill.forget_step(rid)
        self.prefixes.clear()
        try:
            self.executor.reset(session.stream_id, session.long_rope)
        except Exception:  # noqa: BLE001 - the executor is broken: fail it after all
            return False
        session.restart()
        return True

    # -- prompts ----------------------------------------------------------------------
    def _is_prefill_step(self, unit_id: int, sessions: list[DecodeSession]) -> bool:
        """Whether the unit's next step is a prefill step (a stream alone, in its prompt)."""
        return unit_id not in self.row_groups and sessions[0].prefilling

    def _beside_decoders(self, session: DecodeSession) -> bool:
        """Whether streams other than ``session`` are decoding."""
        return any(s is not session and not s.prefilling and not s.done
                   for s in self.sessions.values())

    def _may_plan_ahead(self, unit_id: int, sessions: list[DecodeSession],
                        busy: dict[int, int]) -> bool:
        """Whether a unit with steps in flight may submit another: a pipelined session's
        run ahead, or a lone prompt's next chunk (``PrefillPlanner.depth`` in flight)."""
        session = sessions[0]
        if isinstance(session, PipelinedSession) and unit_id not in self.row_groups:
            # Pipelined speculation where steps overlap on stages of their own cores, unless
            # several streams already keep the stages busy (then each runs one step at a
            # time, or in a row group). Where the stages share cores, a guessed run takes
            # them from the run it guesses after: one step at a time there too.
            alone = len(self.sessions) == 1 or not self.load.saturated()
            own_cores = self.overlaps and not self.load.shared_cores
            session.depth_cap = None if own_cores and alone else 1
            if not session.prefilling:
                return session.stream_id in self.sessions and session.can_run_ahead
        if not self._is_prefill_step(unit_id, sessions):
            return False
        return (session.stream_id in self.sessions and session.can_plan_ahead
                and busy.get(id(session), 0) < self.prefill.depth(self._beside_decoders(session)))

    def _size_prefill(self, session: DecodeSession) -> None:
        """Set the session's next prefill chunk from the measured step costs."""
        session.prefill_chunk = self.prefill.chunk(session, self._beside_decoders(session))

    def _size_fused(self, group_id: int, prompts: list[DecodeSession]) -> None:
        """Set the chunks of the prompts riding in a group's step: beside streams that are
        decoding, the group's measured allowance of prompt tokens (split-fuse held to a
        budget); else each as a prompt alone."""
        if prompts and self._beside_decoders(prompts[0]):
            chunks = self.prefill.fused_chunks(group_id, prompts)
            for session, chunk in zip(prompts, chunks, strict=True):
                session.prefill_chunk = chunk
            return
        for session in prompts:
            self._size_prefill(session)

    # -- driving the executor ---------------------------------------------------------
    def _poll_executor(self, timeout_s: float | None) -> list[SessionUpdate]:
        """Submit every ready unit, collect one reply, advance its sessions and submit
        their next steps before returning (where nothing is about to change: see
        ``_is_settled``): the caller's work on the updates (streaming text to clients) then
        overlaps the steps in flight instead of delaying them. A lone stream's first token
        is the exception (``_first_token_alone``): it goes to its client first."""
        executor = self.executor
        updates = self._submit_ready()
        if not self._in_flight:
            return updates
        try:
            reply = executor.collect_any(timeout_s)
        except Exception as exc:  # noqa: BLE001 - a failed or expired request
            rid = exc.request_id if isinstance(exc, StepError) else 0
            failed = self._in_flight.pop(rid, None)
            self._group_steps.pop(rid, None)
            self._row_answers.pop(rid, None)
            self.prefill.forget_step(rid)
            if failed is None:
                failed = [s for sessions in self._in_flight.values() for s in sessions]
                for lost in self._in_flight:
                    self.prefill.forget_step(lost)
                self._in_flight.clear()
                self._group_steps.clear()
                self._row_answers.clear()
            return updates + self._fail(failed, exc)
        if reply is None:
            return updates
        sessions = self._in_flight.pop(reply.request_id, None)
        group = self._group_steps.pop(reply.request_id, None)
        answers = self._row_answers.pop(reply.request_id, None)
        self.prefill.note_answer(reply.request_id, reply.stage_ms)
        if sessions is not None:
            advanced = self._advance(sessions, reply, answers)
            updates += advanced
            if group is not None or not _first_token_alone(advanced):
                updates += self._submit_ready(settled_only=True, decode_only=True)
        return updates

    def _is_settled(self, unit_id: int, sessions: list[DecodeSession]) -> bool:
        """Whether a unit may step before poll retires finished sessions and settles row
        groups: none of its sessions is done or cancelled, a group's members are the rows
        its stages hold, and a session outside the groups is not about to join one."""
        if any(s.done or s.stream_id not in self.sessions for s in sessions):
            return False
        if unit_id in self.row_groups:
            return self.row_groups.stages_hold(unit_id, sessions)
        return not self._would_group(sessions[0])

    def _submit_ready(self, settled_only: bool = False, decode_only: bool = False
                      ) -> list[SessionUpdate]:
        """Submit the next step of every unit with nothing in flight (``settled_only``:
        and ``_is_settled``; ``decode_only``: no prefill steps, whose stage-0 compute would
        hold back the updates the caller is about to deliver), and further chunks of a
        prefill while ``PrefillPlanner.depth`` allows; the failures."""
        updates: list[SessionUpdate] = []
        busy = self._busy()
        groups, stepping = self.row_groups, set(self._group_steps.values())
        for unit_id, sessions in self._units():
            if settled_only and not self._is_settled(unit_id, sessions):
                continue
            if unit_id in groups and (unit_id in stepping
                                      or not groups.stages_hold(unit_id, sessions)):
                continue  # its stages hold other rows: it steps once re-formed (settle)
            if decode_only and self._is_prefill_step(unit_id, sessions):
                continue
            while not any(id(s) in busy for s in sessions) or self._may_plan_ahead(
                    unit_id, sessions, busy):
                if not self._submit(unit_id, sessions, updates):
                    break
                for session in sessions:
                    busy[id(session)] = busy.get(id(session), 0) + 1
        return updates

    def _submit(self, unit_id: int, sessions: list[DecodeSession],
                updates: list[SessionUpdate]) -> bool:
        """Plan and submit one step of a unit; False (and the failure in ``updates``) if
        the executor refused it."""
        prefill = self._is_prefill_step(unit_id, sessions)
        if prefill:
            self._size_prefill(sessions[0])
            past = sessions[0].prefill_position
        fused = unit_id in self.row_groups and any(s.prefilling for s in sessions)
        step, rows = self._plan(unit_id, sessions)
        try:
            rid = self.executor.submit(step)
        except Exception as exc:  # noqa: BLE001
            updates += self._fail(sessions, exc)
            return False
        self._in_flight[rid] = list(sessions)
        if prefill and not step.one_query:  # (a replay's emitted tokens: not a prompt's cost)
            self.prefill.note_step(rid, [(int(step.token_ids.size), past)])
        elif fused and rows is not None:  # a prompt's chunk rode in the group's step
            shapes = rows.shapes()
            prompt_tokens = sum(tokens for s, (tokens, _) in zip(sessions, shapes, strict=True)
                                if s.prefilling)
            self.prefill.note_step(rid, shapes, (unit_id, prompt_tokens))
        if rows is not None:
            self._group_steps[rid] = unit_id
            self._row_answers[rid] = rows.answers
        return True


def _first_token_alone(updates: Sequence[SessionUpdate]) -> bool:
    """Whether a unit stepped alone (not a row group) just gave its session its first
    tokens. Its next step then waits for the next poll: started now, stage 0's compute
    of it (in the caller's thread on a cluster's head) would come between the prompt's
    last step and the first token reaching the client, one more step in the time to
    first token. A row group's step goes first even then: it carries every row's pace."""
    return any(u.tokens and len(u.session.emitted) == len(u.tokens) for u in updates)


def run_sessions(executor: Executor, sessions: Sequence[DecodeSession], row_groups: int = 0
                 ) -> Iterator[SessionUpdate]:
    """Run sessions concurrently to the end, yielding every update (raises nothing:
    a failed session has ``error`` set). ``row_groups``: see ``StreamScheduler``."""
    scheduler = StreamScheduler(executor, row_groups)
    for session in sessions:
        scheduler.add(session)
    while scheduler.active:
        yield from scheduler.poll()


def run_session(executor: Executor, session: DecodeSession) -> Iterator[int]:
    """Yield one session's tokens as they come; raises the error that stopped it."""
    for update in run_sessions(executor, [session]):
        yield from update.tokens
        if update.session.error is not None:
            raise update.session.error


def generate_greedy(executor: Executor, prompt_ids: Sequence[int], max_new_tokens: int,
                    stop_ids: Sequence[int] = (), stream_id: int = 0,
                    prefill_chunk: int | None = None,
                    stats: GenerationStats | None = None) -> Iterator[int]:
    """Yield greedy tokens one by one; the stream is reset first."""
    return run_session(executor, DecodeSession(
        stream_id, prompt_ids, max_new_tokens, stop_ids, prefill_chunk=prefill_chunk,
        stats=stats))


def greedy_kept_open(executor: Executor, prompt_ids: Sequence[int], count: int,
                     stream_id: int = 0, after_each: Callable[[], None] | None = None
                     ) -> list[int]:
    """The first ``count`` greedy tokens of ``prompt_ids`` as stream ``stream_id``, with
    ``after_each()`` called after each; the stream stays open with its KV (its generation
    is left before its end), for a caller that looks at the stages' state afterwards."""
    got: list[int] = []
    for token in generate_greedy(executor, prompt_ids, count + 1, stream_id=stream_id):
        got.append(token)
        if after_each is not None:
            after_each()
        if len(got) == count:
            break
    return got


def generate_speculative(executor: Executor, prompt_ids: Sequence[int], max_new_tokens: int,
                         stop_ids: Sequence[int] = (), drafter: Drafter | None = None, k: int = 5,
                         stream_id: int = 0, stats: GenerationStats | None = None,
                         prefill_chunk: int | None = None, cost: StepCost | None = None,
                         auto_k: bool = False, sampling: SamplingParams | None = None
                         ) -> Iterator[int]:
    """Yield exactly the tokens ``generate_greedy`` yields, verifying up to ``k`` drafts a step.

    ``drafter`` defaults to a LookupDrafter. With a ``cost`` model (or ``auto_k``, which
    fits one online) K is re-chosen every step by ``adapt_k`` (``k`` is then the maximum).
    A ``SpeculativeStats`` passed as ``stats`` also gets the draft counters. The stream is
    reset first; rejected slots of the last step are left in its KV. With ``sampling``
    (temperature > 0) the tokens are sampled and keep the target's distribution instead.
    """
    return run_session(executor, DecodeSession(
        stream_id, prompt_ids, max_new_tokens, stop_ids, drafter=drafter, k=k, auto_k=auto_k,
        cost=cost, prefill_chunk=prefill_chunk, stats=stats, sampling=sampling))


def generate_pipelined(executor: Executor, prompt_ids: Sequence[int], max_new_tokens: int,
                       stop_ids: Sequence[int] = (), drafter: Drafter | None = None,
                       width: int | None = None, depth: int | None = None, stream_id: int = 0,
                       stats: GenerationStats | None = None, prefill_chunk: int | None = None,
                       sampling: SamplingParams | None = None) -> Iterator[int]:
    """Yield exactly the tokens ``generate_greedy`` yields, by pipelined speculation
    (``zctl.engine.pipelined``): while a step is on later stages, stage 0 starts the next on a
    guessed continuation (``drafter``, prompt lookup by default), up to ``depth`` steps in
    flight (None: adaptive); wrong guesses are cancelled on every stage. On an executor
    whose steps do not overlap it decodes one step at a time."""
    return run_session(executor, PipelinedSession(
        stream_id, prompt_ids, max_new_tokens, stop_ids, drafter=drafter, width=width,
        depth=depth, prefill_chunk=prefill_chunk, stats=stats, sampling=sampling))
