"""What every API the server speaks shares (``ServingContext``): the generation service's
client, the settings, the metrics, the queue (``Admission``, --max-queue), the model served
and the names it answers to, the key check, the model check, a prompt's tokens, and the
generations of a request, started, read (cancelled when the client goes) and collected.
Each API (zctl.serve.openai, zctl.serve.anthropic) is an adapter over it: it reads its
requests as the engine's, and the engine's chunks and ends as its replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
import uuid
from dataclasses import replace
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from zctl.engine.requests import GenerationDone, GenerationRequest, TokenLogprob
from zctl.serve.admission import Admission
from zctl.serve.encoding import json_reply
from zctl.serve.errors import (
    ApiError,
    backend_down_error,
    engine_error,
    raise_first_failure,
    unknown_model,
    validate_generation,
)
from zctl.serve.event_streams import Events, close_all, run_concurrently
from zctl.serve.metrics import RequestClock, ServeMetrics
from zctl.serve.settings import ServeSettings
from zctl.service.async_client import AsyncServiceClient
from zctl.service.errors import ServiceUnavailable
from zctl.service.messages import (
    DetokenizeRequest,
    GenerationEvent,
    ServiceStats,
    TokenizeRequest,
    TokensReply,
)

DISCONNECT_CHECK_S = 0.5  # how often a non-streamed request looks for its client
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class StageHealth(BaseModel):
    index: int
    node: str  # the node that runs it
    up: bool


class Health(BaseModel):
    """``GET /health``: whether the pipeline serves (else why not), the model, the
    generations running and waiting, and the stages."""

    status: Literal["ok", "down"]
    reason: str | None
    model: str
    running: int
    waiting: int
    stages: list[StageHealth]


class ServiceDown(BaseModel):
    """``GET /health`` while the generation service does not answer."""

    status: Literal["down"] = "down"
    reason: str


def new_request_id() -> str:
    return uuid.uuid4().hex[:24]


class RunningGenerations:
    """A request's generations once each has answered: its first event, its events, and
    its clock."""

    def __init__(self, firsts: list[GenerationEvent], events: list[Events],
                 clocks: list[RequestClock]) -> None:
        self.firsts, self.events, self.clocks = firsts, events, clocks


class ServingContext:
    """The generation service ``backend`` served under ``settings``."""

    def __init__(self, backend: AsyncServiceClient, settings: ServeSettings) -> None:
        self.backend, self.settings = backend, settings
        self.metrics = ServeMetrics()
        self.admission = Admission(settings.max_queue)
        self._model: ServiceStats | None = None

    # -- what is served -----------------------------------------------------------------
    async def served_stats(self) -> ServiceStats:
        """The model and stages served (asked once; 503 while the service is away)."""
        if self._model is None:
            try:
                self._model = self.with_reply_name(await self.backend.stats())
            except ServiceUnavailable as exc:
                raise backend_down_error(exc) from None
        return self._model

    async def current_stats(self) -> ServiceStats:
        """The stages as they are now (as last seen while the service is away; 503 if
        never)."""
        try:
            return self.with_reply_name(await self.backend.stats())
        except ServiceUnavailable:
            return await self.served_stats()

    def names(self, stats: ServiceStats) -> tuple[str, ...]:
        """The names requests may give the model, the first the one replies carry."""
        return self.settings.model_names or (stats.model,)

    def with_reply_name(self, stats: ServiceStats) -> ServiceStats:
        """``stats`` with the model under the name replies carry."""
        return replace(stats, model=self.names(stats)[0])

    async def health(self) -> JSONResponse:
        """``GET /health``: 200 while the pipeline serves, else a 503 saying why."""
        try:
            stats = await self.backend.stats()
        except ServiceUnavailable as exc:
            return json_reply(ServiceDown(reason=str(exc)), 503)
        down = [s for s in stats.stages if not s.up]
        reason = stats.health or (f"stage {down[0].index} on node {down[0].node_id} is down"
                                  if down else "")
        body = Health(status="down" if reason else "ok", reason=reason or None,
                      model=self.names(stats)[0], running=stats.running, waiting=stats.waiting,
                      stages=[StageHealth(index=s.index, node=s.node_id, up=s.up)
                              for s in stats.stages])
        return json_reply(body, 503 if reason else 200)

    async def render_metrics(self) -> Response:
        try:
            stats: ServiceStats | None = await self.backend.stats()
        except ServiceUnavailable:
            stats = None  # the request figures still count
        model = self.names(stats)[0] if stats is not None else \
            (self._model.model if self._model else "")
        body = self.metrics.render(stats, model, self.admission.in_flight,
                                   self.admission.max_queue)
        return Response(body, media_type=PROMETHEUS_TEXT)

    # -- what every request is checked for ----------------------------------------------
    def check_key(self, request: Request, x_api_key: bool = False) -> None:
        """401 unless the request carries the key (compared in constant time) as a bearer
        token, or with ``x_api_key`` in that header (Anthropic's clients send it so)."""
        key = self.settings.api_key
        if not key:
            return
        given = request.headers.get("x-api-key") if x_api_key else None
        expected, header = (key, "x-api-key") if given is not None else \
            (f"Bearer {key}", "Authorization: Bearer KEY")
        if given is None:
            given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode("latin-1"), expected.encode()):  # raw bytes
            raise ApiError(401, f"missing or wrong API key ({header})", "authentication_error",
                           code="invalid_api_key")

    async def check_request(self, request: Request, model: str | None, status: int = 400,
                            x_api_key: bool = False) -> ServiceStats:
        """The model served, once the key is checked and ``model`` (if given) names it
        (else ``status``: OpenAI answers a body naming another model with a 400, Anthropic
        with a 404)."""
        self.check_key(request, x_api_key)
        return self.check_model(await self.served_stats(), model, status)

    def check_model(self, info: ServiceStats, model: str | None, status: int) -> ServiceStats:
        """``info``, if ``model`` (when given) is one of the names it is served as."""
        if model is not None and model not in self.names(info):
            raise unknown_model(status, model, info.model)
        return info

    def count_failure(self, done: GenerationDone) -> ApiError:
        """The API error of a generation that failed after its reply started, counted."""
        error = engine_error(done)
        self.metrics.errors.labels(str(error.status)).inc()
        return error

    # -- tokens ---------------------------------------------------------------------------
    async def prompt_tokens(self, gen: GenerationRequest) -> TokensReply:
        """The ids ``gen`` would be prompted with (nothing is generated)."""
        return await self.tokens(TokenizeRequest(validate_generation(gen)))

    async def reader_text(self, tokens: list[int]) -> str:
        """The text of token ids as a reader sees it (special tokens left out), asked as
        part of a request already in flight."""
        msg = DetokenizeRequest(new_request_id(), tokens, skip_special_tokens=True)
        return (await self.tokens(msg, counted=False)).text

    async def tokens(self, msg: TokenizeRequest | DetokenizeRequest,
                     counted: bool = True) -> TokensReply:
        """The service's answer; ``counted``, in flight meanwhile (the generation thread
        tokenizes, so --max-queue bounds these as it bounds generations; a request's own
        detokenizing is the request's)."""
        with self.admission.hold(counted):
            try:
                reply = await self.backend.tokens(msg)
            except ServiceUnavailable as exc:
                raise backend_down_error(exc) from None
        if reply.error:
            raise ApiError(400, reply.error)
        return reply

    # -- generations ----------------------------------------------------------------------
    async def start_one(self, gen: GenerationRequest, request: Request, model: str,
                        start: float) -> tuple[GenerationEvent, Events, RequestClock]:
        """Start the one generation of a request (its first event, events and clock), as a
        chat completion's starts."""
        validate_generation(gen)
        self.admission.check_room(1)
        started = await self.start([gen], request, model, start)
        return started.firsts[0], started.events[0], started.clocks[0]

    async def start(self, gens: list[GenerationRequest], request: Request, model: str,
                    start: float, per_prompt: int = 1) -> RunningGenerations:
        """Start the generations of a request's choices (``per_prompt`` for each prompt):
        each one's first event, its events, and its clock from ``start``. Raises the API
        error of the first that failed, with none left running."""
        clocks = [RequestClock(self.metrics, model, start, counts_prompt=i % per_prompt == 0)
                  for i in range(len(gens))]
        admitted = [self.admission.admit(lambda gen=gen: self.backend.generate(gen))
                    for gen in gens]
        events = [e for e, _ in admitted]
        try:
            firsts = await self._first_events(events, request, per_prompt)
        except BaseException:
            for _, release in admitted:
                release()  # (a choice's events may never have started)
            await close_all(events)
            raise
        return RunningGenerations(firsts, events, clocks)

    async def _first_events(self, events: list[Events], request: Request,
                            per_prompt: int = 1) -> list[GenerationEvent]:
        """Each choice's first event, or the API error of the first that failed; the
        choices are ``per_prompt`` (``n``) for each prompt in turn. A prompt's first choice
        starts first (the prompts' concurrently): once it answers, its prompt is in the
        prefix cache (a running stream's prompt is a source), so the prompt's other
        choices, started together then, prefill only its last token rather than all of it
        (and none starts if a first choice failed)."""
        leads = range(0, len(events), per_prompt)
        answers = dict(zip(leads, await run_concurrently(
            [self.next_event(events[i], request) for i in leads]), strict=True))
        raise_first_failure(list(answers.values()))
        rest = [i for i in range(len(events)) if i not in answers]
        if rest:
            more = await run_concurrently([self.next_event(events[i], request) for i in rest])
            raise_first_failure(more)
            answers.update(zip(rest, more, strict=True))
        return [answers[i] for i in range(len(events))]

    async def next_event(self, events: Events, request: Request) -> GenerationEvent:
        """The next event, cancelling the generation if the client goes meanwhile."""
        step = asyncio.ensure_future(anext(events))
        try:
            while True:
                done, _ = await asyncio.wait({step}, timeout=DISCONNECT_CHECK_S)
                if done:
                    return step.result()
                if await request.is_disconnected():
                    raise ApiError(499, "the client went away", "client_closed")
        except StopAsyncIteration:  # a backend stream ends with a Done: never here
            raise ApiError(500, "the generation ended without an answer", "internal_error") \
                from None
        except ServiceUnavailable as exc:
            raise backend_down_error(exc) from None
        except BaseException:
            step.cancel()  # its generator ends in the cancellation, cancelling the generation
            with contextlib.suppress(BaseException):
                await step
            await events.aclose()  # type: ignore[attr-defined]
            raise

    async def collect_and_close(self, first: GenerationEvent, events: Events,
                                clock: RequestClock, request: Request, gen: GenerationRequest,
                                ) -> tuple[GenerationDone, list[TokenLogprob] | None]:
        """One generation collected whole (``collect``), its events closed after."""
        try:
            done, logprobs, _ = await self.collect(first, events, clock, request, gen)
        finally:
            await close_all([events])
        return done, logprobs

    async def collect(self, first: GenerationEvent, events: Events, clock: RequestClock,
                      request: Request, gen: GenerationRequest,
                      ) -> tuple[GenerationDone, list[TokenLogprob] | None, list[TokenLogprob]]:
        """One generation's end, its tokens' logprobs (if asked for) and its prompt's (if
        asked for: an echo's)."""
        logprobs: list[TokenLogprob] | None = [] if gen.logprobs else None
        prompt: list[TokenLogprob] = []
        msg, looked = first, time.monotonic()
        while True:
            now = time.monotonic()
            if isinstance(msg, GenerationDone):
                if msg.error:
                    raise engine_error(msg)
                clock.done(msg, now)
                return msg, logprobs, prompt
            clock.tokens(len(msg.tokens), now)
            prompt = msg.prompt_logprobs or prompt
            if logprobs is not None:
                logprobs += msg.logprobs
            if now - looked >= DISCONNECT_CHECK_S:  # tokens keep coming: look anyway
                looked = now
                if await request.is_disconnected():
                    raise ApiError(499, "the client went away", "client_closed")
            msg = await self.next_event(events, request)
