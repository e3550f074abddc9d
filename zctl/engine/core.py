"""GenerationEngine: requests in, streamed chunks out, over one executor. No sockets.

Requests become ``DecodeSession``s on one ``StreamScheduler``: up to ``max_streams``
generate concurrently (each on its own stream, so its own KV on every stage) and the
rest wait their turn. Each request is answered with ``GenerationChunk``s and one
``GenerationDone``, addressed to the ``client`` that submitted it. A front door (the
coordinator's ZeroMQ service, an HTTP server) calls ``submit`` and ``cancel`` and drives
``poll`` from the one thread that owns the executor (executors are not thread-safe).

``health()`` says when the pipeline cannot serve (a stage's node is down, or it is being
re-wired). Generations in flight then pause (a chunk with a note says why) instead of
waiting out the data plane's timeout; when the pipeline serves again each resumes: its
stream is reset and the session replays its prompt and tokens on the fresh KV, then goes
on as if nothing happened. Not back within ``resume_timeout_s`` (0: do not wait), they
end with ``PipelineDown`` and the tokens they have. New requests wait meanwhile, for up to
``ADMISSION_HOLD_S`` (a re-wiring or a heal takes a moment), then are refused.
A step or reset that no next stage took (``PipelineUnreachable``: its node went before
the cluster noticed) is such an outage too, not the request's failure.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from zctl.engine.admission import DrafterLoader, SessionLimits, new_session
from zctl.engine.constraints import GrammarCompiler, GrammarQueue
from zctl.engine.decode_rates import DecodeRateMeter
from zctl.engine.executor import Executor, PipelineUnreachable
from zctl.engine.kv_cost import EVERY_TOKEN, KvCost
from zctl.engine.outcomes import PipelineDown, error_kind, session_tokens, spec_summary, stop_reason
from zctl.engine.prefill_pieces import CANONICAL, PieceRule
from zctl.engine.prefix_index import PrefixIndexStats
from zctl.engine.requests import (
    BAD_REQUEST,
    DEFAULT_MAX_STREAMS,
    UNAVAILABLE,
    GenerationChunk,
    GenerationDone,
    GenerationRequest,
    RequestRefused,
    Sampling,
    TokenLogprob,
)
from zctl.engine.sampling_defaults import LLAMA_SERVER_SAMPLING, request_sampling
from zctl.engine.scheduler import SessionUpdate, StreamScheduler
from zctl.engine.sessions import DecodeSession
from zctl.engine.stops import StopMatcher
from zctl.engine.tokenizer import ChatTokenizer, StreamDecoder, prompt_logprob_texts, with_texts

log = logging.getLogger("zctl.engine")
TIMING_REFRESH_S = 0.5  # how often the percentiles those chunks carry are recomputed
POLL_S = 0.02  # how long a scheduler poll waits for a reply
ADMISSION_HOLD_S = 10.0  # how long new requests wait for a pipeline that cannot serve
HEALTH_CHECK_S = 0.25  # how often generations in flight ask whether the pipeline is down
RESUME_TIMEOUT_S = 120.0  # how long paused generations wait for the pipeline to be back
PAUSE_NOTE_S = 10.0  # while paused, clients hear so this often (their idle timers restart)

Event = GenerationChunk | GenerationDone
Outgoing = tuple[Hashable, Event]  # (the client that asked, what it is told)


@dataclass
class _Job:
    client: Hashable
    request: GenerationRequest
    session: DecodeSession
    decoder: StreamDecoder
    stops: StopMatcher
    pending: list[int] = field(default_factory=list)
    pending_text: str = ""
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs_due: bool = False  # the prompt's logprobs go with the next chunk
    raw_text: str = ""  # what the decoder gave, before stop strings were taken out
    sent_text: str = ""  # what the client was sent
    kept: int = 0  # tokens of session.emitted the client gets (a stop string cuts the rest)
    last_sent: float = 0.0
    timing_sent: float = -1.0  # when the timing summary the client last got was computed
    cancelled: bool = False

    @property
    def stopped(self) -> bool:
        return self.stops.hit is not None


class GenerationEngine:
    """Serve generations on the executor ``get_executor()`` returns (None: not wired yet)."""

    def __init__(self, tokenizer: ChatTokenizer, stop_ids: Sequence[int],
                 get_executor: Callable[[], Executor | None], *, max_streams: int = DEFAULT_MAX_STREAMS,
                 row_groups: int = 0, shared_cores: bool = False,
                 health: Callable[[], str | None] | None = None,
                 resume_timeout_s: float = RESUME_TIMEOUT_S,
                 load_drafter: DrafterLoader | None = None,
                 max_context: int | None = None, kv_budget_tokens: int | None = None,
                 kv_cost: KvCost = EVERY_TOKEN,
                 prefix_cache_tokens: int = 0, vocab_size: int | None = None,
                 sampling_defaults: Sampling = LLAMA_SERVER_SAMPLING,
                 prefill_pieces: PieceRule = CANONICAL, one_query: bool = True) -> None:
        if max_streams < 1:
            raise ValueError("max_streams must be at least 1")
        if row_groups < 0:
            raise ValueError("row_groups must be >= 0")
        self.tokenizer, self.stop_ids = tokenizer, sorted(set(stop_ids))
        self.get_executor, self.health = get_executor, health
        self.max_streams, self.row_groups = max_streams, row_groups
        self.shared_cores = shared_cores  # the stages share this machine's cores (StageLoad)
        self.resume_timeout_s = resume_timeout_s
        self.load_drafter = load_drafter
        self.max_context = max_context  # prompt + new tokens must fit (None: no limit)
        # the token ids a logit_bias may name: the model's logits (None: the tokenizer's)
        self.vocab_size = vocab_size if vocab_size is not None else tokenizer.vocab_size
        # KV tokens a stage may hold for running streams and cached prefixes together (the
        # fullest stage's memory budget over its KV bytes per token; None: no limit).
        # A stream reserves its prompt + max_tokens when it starts; one that does not fit
        # waits (cached prefixes are evicted first), one that could never fit is refused.
        self.kv_budget_tokens = kv_budget_tokens
        # what a stream's tokens cost against it (sliding layers that keep only their window)
        self.kv_cost = kv_cost
        self.prefix_cache_tokens = prefix_cache_tokens  # 0: no prefix cache
        # the model's sampling, for the fields a request leaves out (model_sampling)
        self.sampling_defaults = sampling_defaults
        # where prompts are cut into steps: CANONICAL makes a cached, replayed or batched
        # prompt compute what a cold one does (zctl.engine.prefill_pieces)
        self.prefill_pieces = prefill_pieces
        # verification steps (and replays' emitted tokens) as one-query steps where the
        # stages compute them: speculation gives the tokens plain decoding does, bit for bit
        self.one_query = one_query
        self.prefix_stats = PrefixIndexStats()
        # aggregate decode tok/s by streams decoding together, on the running executor
        self.decode_rates = DecodeRateMeter()
        self.counters = {"requests": 0, "failed": 0, "cancelled": 0, "peak_streams": 0,
                         "structured": 0}  # structured: generations held to a grammar
        self._finished_tokens: Counter[str] = Counter()  # session_tokens of finished ones
        self._scheduler: StreamScheduler | None = None
        self._jobs: dict[int, _Job] = {}  # by stream id
        self._waiting: deque[tuple[Hashable, GenerationRequest]] = deque()
        self._blocked_since: float | None = None  # since when waiting requests are held
        self._out: list[Outgoing] = []
        self._health_checked = -1e9
        self._paused: tuple[float, str] | None = None  # since when, and why
        self._pause_noted = 0.0
        self._timing: tuple[float, dict[str, dict[str, float]]] = (-1e9, {})
        # requests' grammars, compiled off this thread as they arrive (zctl.engine.constraints)
        self.grammars = GrammarQueue(lambda: GrammarCompiler(
            self.tokenizer.backend.to_str(), self.vocab_size, self.stop_ids))

    @property
    def busy(self) -> bool:
        """Whether generations run or wait."""
        return bool(self._jobs or self._waiting)

    @property
    def active(self) -> int:
        return len(self._jobs)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def token_counters(self) -> dict[str, int]:
        """The tokens of finished and running generations so far (session_tokens, summed
        once): generated (generated_tokens), draft tokens proposed and accepted
        (spec_drafted, spec_accepted), and structured output's: generations held to a
        grammar (structured_requests, started so far) and the tokens their grammars forced,
        fed without a step of their own (forced_tokens)."""
        totals = sum((session_tokens(j.session) for j in self._jobs.values()),
                     Counter(self._finished_tokens))
        return {"generated_tokens": totals["generated"], "spec_drafted": totals["proposed"],
                "spec_accepted": totals["accepted"],
                "structured_requests": self.counters["structured"],
                "forced_tokens": totals["forced"]}

    def prefix_counters(self) -> dict[str, int]:
        """The prefix cache's figures: lookups, hits, prompt tokens saved, evictions (all
        cumulative) and the tokens cached now."""
        stats, sched = self.prefix_stats, self._scheduler
        cached = sched.prefixes.cached_tokens if sched is not None else 0
        return {"prefix_lookups": stats.lookups, "prefix_hits": stats.hits,
                "prefix_tokens_saved": stats.tokens_saved,
                "prefix_evictions": stats.evictions, "prefix_cached_tokens": cached}

    @property
    def scheduler(self) -> StreamScheduler | None:
        """The current schedule (None before the first request and while paused)."""
        return self._scheduler

    # -- the front door's calls ----------------------------------------------------------
    def submit(self, client: Hashable, request: GenerationRequest) -> None:
        """Queue a request; ``client`` is whom its chunks are for (a bad one is refused at
        the next ``poll``)."""
        self.counters["requests"] += 1
        self._waiting.append((client, request))
        if request.grammar_kind and request.problem() is None:
            self.grammars.start(id(request), request.grammar_kind, request.grammar)

    def cancel(self, client: Hashable, request_id: str) -> bool:
        """Stop ``client``'s generation ``request_id``: it ends at the next ``poll`` with the
        tokens it has (stop_reason "cancelled"). False if there is no such generation."""
        for waiting in list(self._waiting):
            if waiting[0] == client and waiting[1].request_id == request_id:
                self._waiting.remove(waiting)
                self.grammars.forget(id(waiting[1]))
                self.counters["cancelled"] += 1
                self._out.append((client, GenerationDone(waiting[1].request_id, [], "", 0, 0.0,
                                                         0.0, stop_reason="cancelled")))
                return True
        for job in self._jobs.values():
            if job.client == client and job.request.request_id == request_id:
                job.cancelled = True
                if self._scheduler is not None:
                    self._scheduler.cancel(job.session.stream_id)
                job.session.finish()
                self._progress(SessionUpdate(job.session, []))  # what it has, then its end
                return True
        return False

    def cancel_client(self, client: Hashable) -> int:
        """Cancel every generation of ``client`` (it went away); how many there were."""
        ids = [r.request_id for c, r in self._waiting if c == client]
        ids += [j.request.request_id for j in self._jobs.values() if j.client == client]
        return sum(self.cancel(client, request_id) for request_id in ids)

    def poll(self, timeout_s: float = POLL_S) -> list[Outgoing]:
        """Start waiting requests, watch the pipeline's health, advance the generations
        (waiting up to ``timeout_s`` for a reply); what to tell which client."""
        self._start_waiting()
        if self._jobs:
            self._watch_pipeline()
        decoded = 0
        if self._scheduler is not None and self._scheduler.active:
            updates = self._scheduler.poll(timeout_s)
            errors = [u.session.error for u in updates if u.session.error is not None]
            outage = self._outage(errors) if errors else None
            for update in updates:
                # the tokens after a stream's first (its prompt's), as the scheduler added them
                first = bool(update.tokens) and len(update.session.emitted) == len(update.tokens)
                decoded += len(update.tokens) - first
                if outage is not None and update.session.error is not None:
                    update.session.clear_failure()  # held: it resumes by replay
                else:
                    self._progress(update)
            if outage is not None and self._paused is None:
                self._pause(outage, time.monotonic())
        self.decode_rates.observe(time.monotonic(), decoded, self._decoding_streams())
        out, self._out = self._out, []
        return out

    def _decoding_streams(self) -> int:
        """Streams past their first token and not done (none while the pipeline is held)."""
        if self._paused is not None:
            return 0
        return sum(bool(job.session.emitted) and not job.session.done
                   for job in self._jobs.values())

    def _outage(self, errors: Sequence[BaseException] = ()) -> str | None:
        """Why steps just failed (``errors``), when the pipeline went down or was re-wired
        under them (the executor they ran on is not the one to use any more), or a next
        stage took no frame (``PipelineUnreachable``: its node went before the cluster
        noticed): their generations pause and resume instead of failing. None: the
        failures are the steps' own."""
        problem = self._problem()
        if problem is not None:
            return problem
        unreachable = next((e for e in errors if isinstance(e, PipelineUnreachable)), None)
        if unreachable is not None:
            return str(unreachable)
        if self._scheduler is not None and self.get_executor() is not self._scheduler.executor:
            return "the pipeline was re-wired"
        return None

    # -- starting requests ---------------------------------------------------------------
    def _start_waiting(self) -> None:
        while self._waiting and len(self._jobs) < self.max_streams:
            client, req = self._waiting[0]
            # a grammar still compiling: the queue waits (a moment here when nothing runs,
            # instead of spinning; else the scheduler's poll is the wait)
            if not self.grammars.ready(id(req), 0.0 if self._jobs else POLL_S):
                break
            self._waiting.popleft()
            problem = req.problem()
            if problem is not None:
                self._refuse(client, req, f"bad request: {problem}", BAD_REQUEST)
                continue
            executor = self.get_executor()
            if executor is None:
                self._refuse(client, req, "the pipeline is not wired yet", UNAVAILABLE)
                continue
            problem = self._paused[1] if self._paused else self._problem()
            if problem is not None:
                now = time.monotonic()
                if self._blocked_since is None:
                    self._blocked_since = now
                if now - self._blocked_since < min(self.resume_timeout_s, ADMISSION_HOLD_S):
                    self._waiting.appendleft((client, req))  # held: a re-wiring or a heal
                    if not self._jobs:  # is over in a moment (a wait here, not a spin)
                        time.sleep(POLL_S)
                    break
                self._refuse(client, req, f"the pipeline cannot serve now: {problem}", UNAVAILABLE)
                continue
            self._blocked_since = None
            if self._scheduler is None or (not self._jobs and self._scheduler.executor is not executor):
                self._scheduler = self._new_scheduler(executor)
            if not self._jobs:  # a new busy period: fresh per-stage figures
                executor.clear_timings()
            stream_id = min(set(range(self.max_streams)) - set(self._jobs))
            try:
                session = self._session(stream_id, req)
            except (RequestRefused, ValueError) as exc:
                self._refuse(client, req, f"{type(exc).__name__}: {exc}", BAD_REQUEST)
                continue
            if not self._kv_fits(session):
                self._waiting.appendleft((client, req))  # its turn comes when KV frees up
                break
            unreachable = None
            try:
                self._scheduler.add(session)
            except PipelineUnreachable as exc:  # held: it starts by replay once it serves
                unreachable = str(exc)
            except RuntimeError as exc:
                self._refuse(client, req, f"{type(exc).__name__}: {exc}", UNAVAILABLE)
                continue
            self.grammars.forget(id(req))
            self.counters["structured"] += bool(req.grammar_kind)
            self._jobs[stream_id] = _Job(client, req, session, StreamDecoder(self.tokenizer),
                                         StopMatcher(self.stop_strings_of(req)))
            self.counters["peak_streams"] = max(self.counters["peak_streams"], len(self._jobs))
            if unreachable is not None:
                self._pause(unreachable, time.monotonic())
                break

    def _new_scheduler(self, executor: Executor) -> StreamScheduler:
        self.decode_rates.reset()  # another placement: its own figures
        return StreamScheduler(executor, self.row_groups, self.shared_cores,
                               prefix_cache_tokens=self.prefix_cache_tokens,
                               prefix_stats=self.prefix_stats, pieces=self.prefill_pieces,
                               one_query=self.one_query)

    def _kv_fits(self, session: DecodeSession) -> bool:
        """Whether the session's KV fits the budget beside the running streams' now
        (cached prefixes are evicted to make room); False: it waits for streams to end."""
        budget = self.kv_budget_tokens
        if budget is None:
            return True
        cost = self.kv_cost.tokens
        free = budget - sum(cost(job.session.kv_tokens) for job in self._jobs.values())
        need = cost(session.kv_tokens)
        if need > free:
            return False
        if self._scheduler is not None:
            self._scheduler.prefixes.evict(free - need)
        return True

    def prompt_ids(self, req: GenerationRequest) -> list[int]:
        """The request's prompt as token ids (its messages through the chat template, or
        its own ids: RequestRefused for one outside the vocabulary)."""
        if req.prompt_ids:
            if max(req.prompt_ids) >= self.vocab_size:
                raise RequestRefused(f"prompt token id {max(req.prompt_ids)} is outside the "
                                     f"model's vocabulary of {self.vocab_size}")
            return list(req.prompt_ids)
        if req.messages:
            return self.tokenizer.encode_chat([(m.role, m.content) for m in req.messages])
        return self.tokenizer.encode(req.prompt, chat=req.chat)

    def stop_strings_of(self, req: GenerationRequest) -> list[str]:
        """The text that ends ``req``'s reply: its own stop strings, and for a chat put
        through the chat template those ending a turn of it (ChatTokenizer.chat_stops)."""
        chat = not req.prompt_ids and (bool(req.messages) or
                                       self.tokenizer.through_template(req.chat))
        return [*req.stop, *(self.tokenizer.chat_stops if chat else ())]

    def _session(self, stream_id: int, req: GenerationRequest) -> DecodeSession:
        # its grammar's constraint, compiled since it arrived (raises RequestRefused)
        constraint = self.grammars.take(id(req)) if req.grammar_kind else None
        limits = SessionLimits(self.max_context, self.kv_budget_tokens, self.vocab_size,
                               self.stop_ids, self.kv_cost)
        return new_session(stream_id, req, self.prompt_ids(req), limits, constraint,
                           self.load_drafter, self.sampling_defaults)

    def _refuse(self, client: Hashable, req: GenerationRequest, error: str, kind: str) -> None:
        self.grammars.forget(id(req))
        self.counters["failed"] += 1
        self._out.append((client, GenerationDone(req.request_id, [], "", 0, 0.0, 0.0,
                                                 stop_reason="error", error=error,
                                                 error_kind=kind)))

    # -- the pipeline's health -----------------------------------------------------------
    def _problem(self) -> str | None:
        return self.health() if self.health is not None else None

    def _watch_pipeline(self) -> None:
        """Every HEALTH_CHECK_S while generating: pause when the pipeline cannot serve,
        resume when it can again, give up after ``resume_timeout_s``."""
        now = time.monotonic()
        if ((self.health is None and self._paused is None)
                or now - self._health_checked < HEALTH_CHECK_S):
            return  # (without a health check, only a pause of its own is watched)
        self._health_checked = now
        problem = self._problem()
        if self._paused is None:
            if problem is not None:
                self._pause(problem, now)
            return
        since, why = self._paused
        executor = self.get_executor() if problem is None else None
        if executor is not None:
            self._resume(executor, now - since)
        elif now - since >= self.resume_timeout_s:
            self._paused = None
            self._fail_all(PipelineDown(f"{problem or why} (not back within "
                                        f"{self.resume_timeout_s:g} s)"))
        elif now - self._pause_noted >= PAUSE_NOTE_S:
            self._pause_noted = now
            self._note_all(f"paused {now - since:.0f} s: {problem or why}")

    def _pause(self, problem: str, now: float) -> None:
        """Drop every step in flight (the data plane forgets them) and hold the sessions."""
        if self._scheduler is not None:  # the resumed sessions get a fresh schedule
            self._scheduler.executor.abandon_all(f"the pipeline went down: {problem}")
            self._scheduler = None
        if self.resume_timeout_s <= 0:
            self._fail_all(PipelineDown(problem))
            return
        log.warning("the pipeline cannot serve (%s): %d generation(s) paused for up to %g s",
                    problem, len(self._jobs), self.resume_timeout_s)
        self._paused, self._pause_noted = (now, problem), now
        self._note_all(f"paused: {problem}; resuming when it is back (up to "
                       f"{self.resume_timeout_s:g} s)")

    def _resume(self, executor: Executor, outage_s: float) -> None:
        """Restart every held session on ``executor``: reset streams, replay, go on."""
        self._paused = None
        self._scheduler = self._new_scheduler(executor)
        log.warning("the pipeline serves again after %.1f s: resuming %d generation(s)",
                    outage_s, len(self._jobs))
        for job in list(self._jobs.values()):
            job.session.restart()
            try:
                self._scheduler.add(job.session)
            except Exception as exc:  # noqa: BLE001 - its stream cannot be reset
                outage = self._outage([exc])
                if outage is not None:  # down or re-wired again: every generation holds on
                    self._pause(outage, time.monotonic())
                    return
                job.session.fail(PipelineDown(f"could not resume: {exc}"))
                self._progress(SessionUpdate(job.session, []))
        self._note_all(f"resumed after {outage_s:.1f} s")

    def _fail_all(self, error: Exception) -> None:
        for job in list(self._jobs.values()):
            job.session.fail(error)
            self._progress(SessionUpdate(job.session, []))

    def _note_all(self, note: str) -> None:
        """Tell every client what happened to its generation (a chunk without tokens)."""
        for job in self._jobs.values():
            session = job.session
            self._out.append((job.client, GenerationChunk(
                job.request.request_id, [], "", len(session.emitted), session.stats.ttft_ms,
                session.stats.tok_s or None, {}, spec_summary(session), note)))

    # -- progress ------------------------------------------------------------------------
    def _progress(self, update: SessionUpdate) -> None:
        session = update.session
        job = self._jobs.get(session.stream_id)
        if job is None or job.session is not session:
            return
        self._take_tokens(job, update.tokens)
        now = time.monotonic()
        first = len(session.emitted) == len(update.tokens) and update.tokens
        if first and session.prompt_logprobs is not None:
            job.prompt_logprobs_due = True  # (even if the first token is a stop token)
        interval = job.request.chunk_interval_ms / 1e3
        if (job.pending or job.prompt_logprobs_due) and (
                first or now - job.last_sent >= interval or session.done):
            self._send_pending(job, now)
        if session.done:
            self._finish(job)

    def _take_tokens(self, job: _Job, tokens: list[int]) -> None:
        """Decode a session's new tokens into the job's pending chunk; a stop string ends
        the generation (the tokens after it are not the client's)."""
        session = job.session
        first_index = len(session.emitted) - len(tokens)
        for i, token in enumerate(tokens):
            if job.stopped:
                break
            job.kept = first_index + i + 1
            if token in session.stops:  # (with ignore_eos: only the request's stop_token_ids)
                continue
            job.pending.append(token)
            if session.top_logprobs is not None:
                job.pending_logprobs.append(with_texts(self.tokenizer, session.logprobs[first_index + i]))
            raw = job.decoder.push(token)
            job.raw_text += raw
            job.pending_text += job.stops.push(raw)
        if job.stopped and not session.done:
            if self._scheduler is not None:
                self._scheduler.cancel(session.stream_id)  # frees its KV on every stage
            session.finish()

    def _prompt_logprobs(self, job: _Job) -> list[TokenLogprob]:
        """The prompt's logprobs for the job's first chunk (after it: none)."""
        session = job.session
        if not job.prompt_logprobs_due or session.prompt_logprobs is None:
            return []
        job.prompt_logprobs_due = False
        return prompt_logprob_texts(self.tokenizer, int(session.prompt[0]),
                                    session.prompt_logprobs)

    def _send_pending(self, job: _Job, now: float) -> None:
        session = job.session
        self._out.append((job.client, GenerationChunk(
            job.request.request_id, job.pending, job.pending_text, job.kept,
            session.stats.ttft_ms, session.stats.tok_s or None,
            self._new_timing(job, now), spec_summary(session), logprobs=job.pending_logprobs,
            prompt_logprobs=self._prompt_logprobs(job))))
        job.sent_text += job.pending_text
        job.pending, job.pending_text, job.pending_logprobs = [], "", []
        job.last_sent = now

    def _new_timing(self, job: _Job, now: float) -> dict[str, dict[str, float]]:
        """The timing summary for ``job``'s next chunk: the current one if the client has
        not had it yet, else nothing (a client keeps the figures it last got). With a
        chunk per token, most chunks then carry no figures to encode and decode."""
        summary = self._timing_summary(now)
        at = self._timing[0]
        if at == job.timing_sent:
            return {}
        job.timing_sent = at
        return summary

    def _timing_summary(self, now: float, fresh: bool = False) -> dict[str, dict[str, float]]:
        """The executor's step-timing percentiles, recomputed at most every TIMING_REFRESH_S
        (between steps: every stream's chunk shares one summary) unless ``fresh``."""
        at, summary = self._timing
        if fresh or now - at >= TIMING_REFRESH_S:
            summary = self._scheduler.executor.timing_summary() if self._scheduler else {}
            self._timing = (now, summary)
        return summary

    def _finish(self, job: _Job) -> None:
        session = job.session
        del self._jobs[session.stream_id]
        self._finished_tokens += session_tokens(session)
        produced = session.emitted[:job.kept] if job.stopped else session.emitted
        self._flush_text(job, produced)
        reason = stop_reason(produced, job.request, self.stop_ids, session.error,
                             job.cancelled, job.stopped or session.grammar_complete)
        error, kind = "", ""
        if reason == "error":
            self.counters["failed"] += 1
            error = f"{type(session.error).__name__}: {session.error}"
            kind = error_kind(session.error)
            log.warning("generation %s failed: %s", job.request.request_id, error)
        elif reason == "cancelled":
            self.counters["cancelled"] += 1
        stats = session.stats
        self._out.append((job.client, GenerationDone(
            job.request.request_id, list(produced), job.sent_text, stats.prompt_tokens,
            stats.ttft_ms, stats.tok_s, self._timing_summary(time.monotonic(), fresh=True),
            reason, error, spec_summary(session), kind, session.cached_tokens,
            request_sampling(job.request, self.sampling_defaults))))

    def _flush_text(self, job: _Job, produced: list[int]) -> None:
        """Send what the streaming decoder and the stop strings still hold: the tail of
        the whole text decoded at once (a trailing incomplete character is not held back)."""
        if not job.stopped:
            whole = self.tokenizer.decode([t for t in produced if t not in job.session.stops])
            tail = whole[len(job.raw_text):] if whole.startswith(job.raw_text) else ""
            job.pending_text += job.stops.push(tail) + job.stops.flush()
        if job.pending_text or job.pending:
            self._send_pending(job, time.monotonic())
