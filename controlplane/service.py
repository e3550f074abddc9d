"""The generation service: the coordinator's front door for ``zctl run``.

One thread owns a ROUTER socket and drives the coordinator's stage-0 pipeline
(``ClusterPipeline`` is not thread-safe, so generation never leaves this thread).
Requests become ``DecodeSession``s on one ``StreamScheduler``: up to ``max_streams``
generate concurrently (each on its own stream, so its own KV on every stage) and the
rest wait their turn. Each request is answered with a stream of ``GenerateChunk``
messages and one ``GenerateDone``; bad requests get an ``Error`` and the service keeps
serving. Speculative requests draft by prompt lookup or with a draft model (a 1-stage
export on this machine, loaded once and shared by the streams that ask for it).

``health()`` (the coordinator's view of the pipeline) says when it cannot serve (a
stage's node is down, or it is being re-wired). Generations in flight then pause (a
chunk with a note says why) instead of waiting out the data plane's timeout; when the
pipeline serves again (the node came back, or a spare took its stage) each resumes:
its stream is reset and the session replays its prompt and tokens on the fresh KV,
then goes on as if nothing happened. Not back within ``resume_timeout_s`` (0: do not
wait), they end with ``PipelineDown`` and the tokens they have. New requests are
refused with the reason meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from common.manifest import ManifestError, load_manifest
from controlplane.messages import Error, MessageError, from_frames, to_frames
from controlplane.service_messages import (
    MAX_DRAFT_TOKENS,
    GenerateChunk,
    GenerateDone,
    GenerateRequest,
)
from dataplane.draft_model import ModelDrafter
from dataplane.runtime import StageError, StageRunner, load_runner
from engine.drafting import Drafter, LookupDrafter
from engine.executor import Executor
from engine.sampling import SamplingParams
from engine.scheduler import SessionUpdate, StreamScheduler
from engine.sessions import DecodeSession
from engine.tokenizer import ChatTokenizer, StreamDecoder

log = logging.getLogger("zctl.service")
CHUNK_INTERVAL_S = 0.1  # how often a stream's new tokens and running figures are sent
TIMING_REFRESH_S = 0.5  # how often the percentiles those chunks carry are recomputed
AUTO_K_MAX = MAX_DRAFT_TOKENS // 2
POLL_S = 0.02  # how long a scheduler poll waits for a reply before checking for requests
HEALTH_CHECK_S = 0.25  # how often generations in flight ask whether the pipeline is down
RESUME_TIMEOUT_S = 120.0  # how long paused generations wait for the pipeline to be back
PAUSE_NOTE_S = 10.0  # while paused, clients hear so this often (their idle timers restart)


class PipelineDown(RuntimeError):
    """A stage's node is dead, gone or failed: steps through it cannot complete."""


def timing_summary(pipeline: Any) -> dict[str, dict[str, float]]:
    window = getattr(pipeline, "timings", None)
    return window.summary() if window is not None and len(window) else {}


def spec_summary(session: DecodeSession) -> dict[str, float]:
    """Acceptance, the current K and tokens per verify step of a speculative session."""
    spec = session.spec
    if session.k == 0 or not spec.steps:
        return {}
    recent = session.k_used[-16:]
    return {"acceptance": round(spec.acceptance_rate, 4), "k": float(session.last_k),
            "k_mean": round(sum(recent) / len(recent), 2),
            "tokens_per_step": round(spec.tokens_per_step, 3), "steps": float(spec.steps)}


class RequestRefused(ValueError):
    """A well-formed request this service cannot run (e.g. a missing draft model)."""


@dataclass
class _Job:
    identity: bytes
    request: GenerateRequest
    session: DecodeSession
    decoder: StreamDecoder
    pending: list[int] = field(default_factory=list)
    pending_text: str = ""
    last_sent: float = 0.0


class GenerationService:
    """Serve generations on ``endpoint`` using the pipeline ``get_pipeline()`` returns."""

    def __init__(self, export_dir: Path | str, get_pipeline: Callable[[], Executor | None],
                 endpoint: str = "tcp://127.0.0.1:*", max_streams: int = 8,
                 row_groups: int = 0, shared_cores: bool = False,
                 health: Callable[[], str | None] | None = None,
                 resume_timeout_s: float = RESUME_TIMEOUT_S) -> None:
        if max_streams < 1:
            raise ValueError("max_streams must be at least 1")
        if row_groups < 0:
            raise ValueError("row_groups must be >= 0")
        self.row_groups = row_groups
        self.shared_cores = shared_cores  # the stages share this machine's cores (StageLoad)
        self.export_dir = Path(export_dir)
        self.manifest = load_manifest(self.export_dir, verify_files=False)
        self.tokenizer = ChatTokenizer(self.export_dir)
        stops = set(self.manifest.model.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            stops.add(self.tokenizer.eos_token_id)
        self.stop_ids = sorted(stops)
        self.get_pipeline = get_pipeline
        self.health = health  # None, or why the pipeline cannot run steps now
        self.resume_timeout_s = resume_timeout_s
        self._health_checked = -1e9
        self._paused: tuple[float, str] | None = None  # since when, and why
        self._pause_noted = 0.0
        self.max_streams = max_streams
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 4 << 20)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            raise OSError(f"generation service cannot bind {endpoint}: {exc}") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.counters = {"requests": 0, "malformed": 0, "failed": 0, "peak_streams": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._scheduler: StreamScheduler | None = None
        self._jobs: dict[int, _Job] = {}  # by stream id
        self._waiting: deque[tuple[bytes, GenerateRequest]] = deque()
        self._drafters: dict[Path, StageRunner] = {}
        self._timing: tuple[float, dict[str, dict[str, float]]] = (-1e9, {})

    def start(self) -> str:
        self._thread = threading.Thread(target=self.run, name="zctl-generation", daemon=True)
        self._thread.start()
        return self.endpoint

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._sock.close(0)
        self._ctx.term()

    # -- the loop --------------------------------------------------------------------
    def run(self) -> None:
        while not self._stop.is_set():
            busy = bool(self._jobs)
            if self._sock.poll(0 if busy else 200):
                self._receive_all()
            self._start_waiting()
            if self._jobs:
                self._watch_pipeline()
            if self._scheduler is not None and self._scheduler.active:
                for update in self._scheduler.poll(POLL_S):
                    self._progress(update)

    def _receive_all(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, body = frames[0], frames[1:]
            try:
                msg, _ = from_frames(body)
                if not isinstance(msg, GenerateRequest):
                    raise MessageError(f"the generation service takes generate_request, not {msg.TYPE}")
            except MessageError as exc:
                self.counters["malformed"] += 1
                self._send(identity, Error("bad-request", str(exc)))
                continue
            self.counters["requests"] += 1
            self._waiting.append((identity, msg))

    def _send(self, identity: bytes, msg: Any) -> None:
        try:
            self._sock.send_multipart([identity, *to_frames(msg)])
        except zmq.ZMQError as exc:  # the client went away: keep serving others
            log.info("client %r unreachable: %s", identity, exc)

    def _refuse(self, identity: bytes, req: GenerateRequest, error: str) -> None:
        self.counters["failed"] += 1
        self._send(identity, GenerateDone(req.request_id, [], "", 0, 0.0, 0.0, error=error))

    # -- starting requests -----------------------------------------------------------
    def _start_waiting(self) -> None:
        while self._waiting and len(self._jobs) < self.max_streams:
            identity, req = self._waiting.popleft()
            pipeline = self.get_pipeline()
            if pipeline is None:
                self._refuse(identity, req, "the pipeline is not wired yet")
                continue
            problem = self._paused[1] if self._paused else self._problem()
            if problem is not None:
                self._refuse(identity, req, f"the pipeline cannot serve now: {problem}")
                continue
            if self._scheduler is None or (not self._jobs and self._scheduler.pipeline is not pipeline):
                self._scheduler = StreamScheduler(pipeline, self.row_groups, self.shared_cores)
            if not self._jobs:  # a new busy period: fresh per-stage figures
                window = getattr(pipeline, "timings", None)
                if window is not None:
                    window.clear()
            stream_id = min(set(range(self.max_streams)) - set(self._jobs))
            try:
                session = self._session(stream_id, req, pipeline)
                self._scheduler.add(session)
            except (RequestRefused, ValueError, RuntimeError) as exc:
                self._refuse(identity, req, f"{type(exc).__name__}: {exc}")
                continue
            self._jobs[stream_id] = _Job(identity, req, session, StreamDecoder(self.tokenizer))
            self.counters["peak_streams"] = max(self.counters["peak_streams"], len(self._jobs))

    def _problem(self) -> str | None:
        return self.health() if self.health is not None else None

    def _watch_pipeline(self) -> None:
        """Every HEALTH_CHECK_S while generating: pause when the pipeline cannot serve,
        resume when it can again, give up after ``resume_timeout_s``."""
        now = time.monotonic()
        if self.health is None or now - self._health_checked < HEALTH_CHECK_S:
            return
        self._health_checked = now
        problem = self._problem()
        if self._paused is None:
            if problem is not None:
                self._pause(problem, now)
            return
        since, why = self._paused
        pipeline = self.get_pipeline() if problem is None else None
        if pipeline is not None:
            self._resume(pipeline, now - since)
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
            abandon = getattr(self._scheduler.pipeline, "abandon_all", None)
            if abandon is not None:
                abandon(f"the pipeline went down: {problem}")
            self._scheduler = None
        if self.resume_timeout_s <= 0:
            self._fail_all(PipelineDown(problem))
            return
        log.warning("the pipeline cannot serve (%s): %d generation(s) paused for up to %g s",
                    problem, len(self._jobs), self.resume_timeout_s)
        self._paused, self._pause_noted = (now, problem), now
        self._note_all(f"paused: {problem}; resuming when it is back (up to "
                       f"{self.resume_timeout_s:g} s)")

    def _resume(self, pipeline: Any, outage_s: float) -> None:
        """Restart every held session on ``pipeline``: reset streams, replay, go on."""
        self._paused = None
        self._scheduler = StreamScheduler(pipeline, self.row_groups, self.shared_cores)
        log.warning("the pipeline serves again after %.1f s: resuming %d generation(s)",
                    outage_s, len(self._jobs))
        for job in list(self._jobs.values()):
            job.session.restart()
            try:
                self._scheduler.add(job.session)
            except Exception as exc:  # noqa: BLE001 - its stream cannot be reset
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
            self._send(job.identity, GenerateChunk(
                job.request.request_id, [], "", len(session.emitted), session.stats.ttft_ms,
                session.stats.tok_s or None, {}, spec_summary(session), note))

    def _session(self, stream_id: int, req: GenerateRequest, pipeline: Any) -> DecodeSession:
        ids = self.tokenizer.encode(req.prompt, chat=req.chat)
        stops = () if req.ignore_eos else self.stop_ids
        sampling = SamplingParams(req.temperature, req.top_k, req.top_p, req.seed)
        if not req.speculative:
            return DecodeSession(stream_id, ids, req.max_tokens, stops, sampling=sampling)
        drafter: Drafter = (LookupDrafter() if req.speculative == "lookup" else ModelDrafter(
            self._draft_runner(req.speculative.removeprefix("draft:"), pipeline), stream_id))
        return DecodeSession(stream_id, ids, req.max_tokens, stops, drafter=drafter,
                             k=req.k or AUTO_K_MAX, auto_k=req.k == 0, sampling=sampling)

    def _draft_runner(self, path: str, pipeline: Any) -> StageRunner:
        """The draft model at ``path`` (loaded once), checked against the target's vocabulary."""
        export = Path(path).expanduser().resolve()
        if export in self._drafters:
            return self._drafters[export]
        try:
            manifest = load_manifest(export)
        except (ManifestError, OSError) as exc:
            raise RequestRefused(f"draft model {path}: {exc}") from None
        if len(manifest.stages) != 1:
            raise RequestRefused(f"draft model {path} has {len(manifest.stages)} stages; a drafter "
                                 "must be a 1-stage export (zctl export MODEL --stages 1)")
        if manifest.model.vocab_size != self.manifest.model.vocab_size:
            raise RequestRefused(
                f"draft model {path} has a {manifest.model.vocab_size}-token vocabulary, the "
                f"target {self.manifest.model.vocab_size}: a drafter must share the tokenizer")
        head = getattr(pipeline, "stage0", None) or pipeline.runners[0]
        try:
            runner = load_runner(export, 0, head.config, manifest=manifest, verify=False)
        except StageError as exc:
            raise RequestRefused(f"draft model {path}: {exc}") from None
        self._drafters[export] = runner
        return runner

    # -- progress --------------------------------------------------------------------
    def _progress(self, update: SessionUpdate) -> None:
        session = update.session
        job = self._jobs.get(session.stream_id)
        if job is None or job.session is not session:
            return
        stops = set() if job.request.ignore_eos else set(self.stop_ids)
        for token in update.tokens:
            if token not in stops:
                job.pending.append(token)
                job.pending_text += job.decoder.push(token)
        now = time.monotonic()
        first = len(session.emitted) == len(update.tokens) and update.tokens
        if job.pending and (first or now - job.last_sent >= CHUNK_INTERVAL_S or session.done):
            self._send(job.identity, GenerateChunk(
                job.request.request_id, job.pending, job.pending_text, len(session.emitted),
                session.stats.ttft_ms, session.stats.tok_s or None,
                self._timing_summary(now), spec_summary(session)))
            job.pending, job.pending_text, job.last_sent = [], "", now
        if session.done:
            self._finish(job)

    def _timing_summary(self, now: float, fresh: bool = False) -> dict[str, dict[str, float]]:
        """The pipeline's step-timing percentiles, recomputed at most every TIMING_REFRESH_S
        (the generation thread computes them between steps: every stream's chunk shares
        one summary) unless ``fresh``."""
        at, summary = self._timing
        if fresh or now - at >= TIMING_REFRESH_S:
            summary = timing_summary(self._scheduler.pipeline if self._scheduler else None)
            self._timing = (now, summary)
        return summary

    def _finish(self, job: _Job) -> None:
        session = job.session
        del self._jobs[session.stream_id]
        produced = session.emitted
        reason, error = "max_tokens", ""
        if session.error is not None:
            self.counters["failed"] += 1
            error, reason = f"{type(session.error).__name__}: {session.error}", "error"
            log.warning("generation %s failed: %s", job.request.request_id, error)
        elif produced and not job.request.ignore_eos and produced[-1] in self.stop_ids:
            reason = "eos"
        # The final text is decoded whole: a trailing incomplete character is not held back.
        kept = produced[:-1] if reason == "eos" else produced
        stats = session.stats
        self._send(job.identity, GenerateDone(
            job.request.request_id, list(produced), self.tokenizer.decode(kept),
            stats.prompt_tokens, stats.ttft_ms, stats.tok_s,
            self._timing_summary(time.monotonic(), fresh=True), reason, error,
            spec_summary(session)))
