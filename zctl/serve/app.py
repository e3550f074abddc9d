"""The FastAPI application: OpenAI's completions, chat completions, responses
(zctl.serve.responses_route) and models routes, Anthropic's messages (zctl.serve.anthropic_route),
``/tokenize`` and ``/detokenize`` (vLLM's), ``/health`` and ``/metrics``, over a
``AsyncServiceClient`` (and CORS for the web origins ``ServeSettings`` names).

Every request is checked before anything runs: a bad field, an unknown model, a prompt
and ``max_tokens`` beyond the context are 400s, a wrong key a 401, a full queue a 429, a
pipeline that cannot serve a 503, each in OpenAI's error shape, and none of them touches
the generations already running. A body over MAX_BODY_BYTES is a 413 before it is read
whole (by its Content-Length, or as its bytes arrive). A streamed reply is SSE ending
``data: [DONE]``; a client that disconnects (or closes its stream) has its generation
cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from zctl.engine.requests import GenerationChunk, GenerationDone, GenerationRequest, TokenLogprob
from zctl.serve.anthropic import error_body
from zctl.serve.anthropic_route import PATH as MESSAGES_PATH
from zctl.serve.anthropic_route import add_messages_routes
from zctl.serve.choices import close_all, merged, together
from zctl.serve.errors import checked, raise_failed, unknown_model, validation_error
from zctl.serve.limits import BodyLimit
from zctl.serve.metrics import RequestClock, ServeMetrics
from zctl.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    ResponseShape,
    TokenizeBody,
    engine_error,
    finish_reason,
    to_generations,
)
from zctl.serve.responses_route import add_responses_routes
from zctl.serve.settings import ServeSettings, model_card
from zctl.serve.sse import event_stream, sse
from zctl.service.async_client import AsyncServiceClient
from zctl.service.errors import ServiceUnavailable
from zctl.service.messages import (
    DetokenizeRequest,
    ServiceStats,
    TokenizeRequest,
    TokensReply,
)

DISCONNECT_CHECK_S = 0.5  # how often a non-streamed request looks for its client
# The largest body a request the engine accepts needs: MAX_PROMPT_CHARS characters at up
# to 12 bytes of JSON each (an escaped surrogate pair), with room for the other fields.
MAX_BODY_BYTES = 16 << 20
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class ZctlApi:
    """The routes' state: the backend, the settings, the metrics, what is in flight."""

    def __init__(self, backend: AsyncServiceClient, settings: ServeSettings) -> None:
        self.backend, self.settings = backend, settings
        self.metrics = ServeMetrics()
        self.in_flight = 0
        self._model: ServiceStats | None = None

    # -- what is served -----------------------------------------------------------------
    async def served(self) -> ServiceStats:
        """The model and stages served (asked once; 503 while the service is away)."""
        if self._model is None:
            try:
                self._model = self.named(await self.backend.stats())
            except ServiceUnavailable as exc:
                raise ApiError(503, str(exc), "service_unavailable", code="backend_down") from None
        return self._model

    def names(self, stats: ServiceStats) -> tuple[str, ...]:
        """The names requests may give the model, the first the one replies carry."""
        return self.settings.model_names or (stats.model,)

    def named(self, stats: ServiceStats) -> ServiceStats:
        """``stats`` with the model under the name replies carry."""
        return replace(stats, model=self.names(stats)[0])

    async def models(self) -> dict[str, Any]:
        info = await self._now()
        return {"object": "list", "data": [model_card(name, info) for name in self.names(info)]}

    async def model(self, model_id: str) -> dict[str, Any]:
        """The served model's object under ``model_id``, one of its names (else a 404)."""
        return model_card(model_id, self.check_model(await self._now(), model_id, 404))

    async def _now(self) -> ServiceStats:
        """The stages as they are now (as last seen while the service is away; 503 if
        never)."""
        try:
            return self.named(await self.backend.stats())
        except ServiceUnavailable:
            return await self.served()

    async def health(self) -> JSONResponse:
        try:
            stats = await self.backend.stats()
        except ServiceUnavailable as exc:
            return JSONResponse({"status": "down", "reason": str(exc)}, 503)
        down = [s for s in stats.stages if not s.up]
        reason = stats.health or (f"stage {down[0].index} on node {down[0].node_id} is down"
                                  if down else "")
        body = {"status": "down" if reason else "ok", "reason": reason or None,
                "model": self.names(stats)[0], "running": stats.running, "waiting": stats.waiting,
                "stages": [{"index": s.index, "node": s.node_id, "up": s.up}
                           for s in stats.stages]}
        return JSONResponse(body, 503 if reason else 200)

    async def render_metrics(self) -> Response:
        try:
            stats: ServiceStats | None = await self.backend.stats()
        except ServiceUnavailable:
            stats = None  # the request figures still count
        model = self.names(stats)[0] if stats is not None else \
            (self._model.model if self._model else "")
        body = self.metrics.render(stats, model, self.in_flight, self.settings.max_queue)
        return Response(body, media_type=PROMETHEUS_TEXT)

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

    async def served_model(self, request: Request, model: str | None, status: int = 400,
                           x_api_key: bool = False) -> ServiceStats:
        """The key checked and the model served, which ``model`` must name if given (else
        ``status``: OpenAI answers a body naming another model with a 400, Anthropic with
        a 404)."""
        self.check_key(request, x_api_key)
        return self.check_model(await self.served(), model, status)

    def check_model(self, info: ServiceStats, model: str | None, status: int) -> ServiceStats:
        """``info``, if ``model`` (when given) is one of the names it is served as."""
        if model is not None and model not in self.names(info):
            raise unknown_model(status, model, info.model)
        return info

    def failure(self, done: GenerationDone) -> ApiError:
        """The API error of a generation that failed after its reply started, counted."""
        error = engine_error(done)
        self.metrics.errors.labels(str(error.status)).inc()
        return error

    # -- tokens ---------------------------------------------------------------------------
    async def tokenize(self, body: TokenizeBody, request: Request) -> dict[str, Any]:
        """The ids a generation of the same prompt (or chat, with its tools) would see."""
        info = await self.served_model(request, body.model)
        reply = await self.prompt_tokens(body.generation(uuid.uuid4().hex[:24]))
        return {"count": len(reply.tokens), "max_model_len": info.max_context,
                "tokens": reply.tokens,
                "token_strs": reply.pieces if body.return_token_strs else None}

    async def prompt_tokens(self, gen: GenerationRequest) -> TokensReply:
        """The ids ``gen`` would be prompted with (nothing is generated)."""
        return await self.tokens(TokenizeRequest(checked(gen)))

    async def detokenize(self, body: DetokenizeBody, request: Request) -> dict[str, Any]:
        await self.served_model(request, body.model)
        reply = await self.tokens(DetokenizeRequest(uuid.uuid4().hex[:24], body.tokens))
        return {"prompt": reply.text}

    async def _echoed(self, body: CompletionRequest) -> list[str]:
        """The texts an echoing completion's prompts are answered with (token ids
        detokenized as a reader sees them: special tokens left out)."""
        return [prompt if isinstance(prompt, str) else (await self.tokens(DetokenizeRequest(
            uuid.uuid4().hex[:24], prompt, skip_special_tokens=True), counted=False)).text
                for prompt in body.prompts()]

    async def tokens(self, msg: TokenizeRequest | DetokenizeRequest,
                      counted: bool = True) -> TokensReply:
        """The service's answer; ``counted``, in flight meanwhile (the generation thread
        tokenizes, so --max-queue bounds these as it bounds generations; a completion's
        own detokenizing is its request's)."""
        if counted:
            self.check_room(1)
        self.in_flight += counted
        try:
            reply = await self.backend.tokens(msg)
        except ServiceUnavailable as exc:
            raise ApiError(503, str(exc), "service_unavailable", code="backend_down") from None
        finally:
            self.in_flight -= counted
        if reply.error:
            raise ApiError(400, reply.error)
        return reply

    # -- completions --------------------------------------------------------------------
    async def complete(self, body: ChatCompletionRequest | CompletionRequest,
                       request: Request) -> Response:
        info = await self.served_model(request, body.model)
        request_id = uuid.uuid4().hex[:24]
        gens = [checked(gen) for gen in to_generations(body, request_id,
                                                       self.settings.speculation)]
        self.check_room(len(gens))
        return await self._answer(body, request_id, gens, request, info.model)

    def check_room(self, wanted: int) -> None:
        """429 unless ``wanted`` more requests fit under --max-queue."""
        if self.in_flight + wanted > self.settings.max_queue:
            raise ApiError(429, f"the server has {self.in_flight} requests in flight (its "
                           f"limit, --max-queue, is {self.settings.max_queue}; each of n "
                           "choices counts): retry later", "rate_limit_exceeded",
                           code="queue_full")

    def _admit(self, gen: GenerationRequest) -> tuple[AsyncIterator[Any], Callable[[], None]]:
        """Count ``gen`` in flight now, before anything awaits (requests arriving together
        would otherwise all pass the --max-queue check), and return its events (the
        backend's, uncounted when they end or are left) and the release (idempotent: for a
        request that ends before its events are first asked for)."""
        self.in_flight += 1
        held = [True]

        def release() -> None:
            if held[0]:
                held[0] = False
                self.in_flight -= 1

        async def events() -> AsyncIterator[Any]:
            inner = self.backend.generate(gen)
            try:
                async for msg in inner:
                    yield msg
            finally:
                release()
                await inner.aclose()

        return events(), release

    async def _answer(self, body: ChatCompletionRequest | CompletionRequest, request_id: str,
                      gens: list[GenerationRequest], request: Request, model: str) -> Response:
        """Run a generation per choice: their first answers decide between an error and a
        reply."""
        start = time.monotonic()
        echo = await self._echoed(body) if isinstance(body, CompletionRequest) and body.echo \
            else None  # (before any generation starts: a failure here leaves none running)
        firsts, events, clocks = await self.start(gens, request, model, start, body.n)
        shape = ResponseShape(isinstance(body, ChatCompletionRequest), request_id, model, body.n,
                              tools=body.tool_plan(), echo=echo)
        if body.stream:
            return event_stream(self._sse(shape, firsts, events, clocks, body.include_usage))
        try:
            return JSONResponse(await self._collect_all(shape, firsts, events, clocks, request,
                                                        gens))
        finally:
            await close_all(events)

    async def start_chat(self, chat: ChatCompletionRequest, request: Request, model: str,
                         start: float
                         ) -> tuple[GenerationRequest, Any, AsyncIterator[Any], RequestClock]:
        """Start the one generation another API's request reads as ``chat`` (its request,
        first event, events and clock), as a chat completion's starts."""
        (gen,) = to_generations(chat, uuid.uuid4().hex[:24], self.settings.speculation)
        checked(gen)
        self.check_room(1)
        (first,), (events,), (clock,) = await self.start([gen], request, model, start)
        return gen, first, events, clock

    async def start(self, gens: list[GenerationRequest], request: Request, model: str,
                    start: float, per_prompt: int = 1,
                    ) -> tuple[list[Any], list[AsyncIterator[Any]], list[RequestClock]]:
        """Start the generations of a request's choices (``per_prompt`` for each prompt):
        each one's first event, its events, and its clock from ``start``. Raises the API
        error of the first that failed, with none left running."""
        clocks = [RequestClock(self.metrics, model, start, counts_prompt=i % per_prompt == 0)
                  for i in range(len(gens))]
        admitted = [self._admit(gen) for gen in gens]
        events = [e for e, _ in admitted]
        try:
            firsts = await self._firsts(events, request, per_prompt)
        except BaseException:
            for _, release in admitted:
                release()  # (a choice's events may never have started)
            await close_all(events)
            raise
        return firsts, events, clocks

    async def _firsts(self, events: list[AsyncIterator[Any]], request: Request,
                      per_prompt: int = 1) -> list[Any]:
        """Each choice's first event, or the API error of the first that failed; the
        choices are ``per_prompt`` (``n``) for each prompt in turn. A prompt's first choice
        starts first (the prompts' together): once it answers, its prompt is in the prefix
        cache (a running stream's prompt is a source), so the prompt's other choices,
        started together then, prefill only its last token rather than all of it (and
        none starts if a first choice failed)."""
        leads = range(0, len(events), per_prompt)
        answers = dict(zip(leads, await together([self._next(events[i], request)
                                                  for i in leads]), strict=True))
        raise_failed(list(answers.values()))
        rest = [i for i in range(len(events)) if i not in answers]
        if rest:
            more = await together([self._next(events[i], request) for i in rest])
            raise_failed(more)
            answers.update(zip(rest, more, strict=True))
        return [answers[i] for i in range(len(events))]

    async def _next(self, events: AsyncIterator[Any], request: Request) -> Any:
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
            raise ApiError(503, str(exc), "service_unavailable", code="backend_down") from None
        except BaseException:
            step.cancel()  # its generator ends in the cancellation, cancelling the generation
            with contextlib.suppress(BaseException):
                await step
            await events.aclose()  # type: ignore[attr-defined]
            raise

    async def _collect_all(self, shape: ResponseShape, firsts: list[Any],
                           events: list[AsyncIterator[Any]], clocks: list[RequestClock],
                           request: Request, gens: list[GenerationRequest]) -> dict[str, Any]:
        """The whole reply: every choice's tokens collected (together), then its end."""
        ends = await together([self.collect(f, e, c, request, g)
                               for f, e, c, g in zip(firsts, events, clocks, gens, strict=True)])
        return shape.reply([done for done, _, _ in ends], [lps for _, lps, _ in ends],
                           [prompt for _, _, prompt in ends])

    async def collect_one(self, first: Any, events: AsyncIterator[Any], clock: RequestClock,
                          request: Request, gen: GenerationRequest,
                          ) -> tuple[GenerationDone, list[TokenLogprob] | None]:
        """One choice collected whole (``collect``), its events closed after."""
        try:
            done, logprobs, _ = await self.collect(first, events, clock, request, gen)
        finally:
            await close_all([events])
        return done, logprobs

    async def collect(self, first: Any, events: AsyncIterator[Any], clock: RequestClock,
                       request: Request, gen: GenerationRequest,
                       ) -> tuple[GenerationDone, list[TokenLogprob] | None, list[TokenLogprob]]:
        """One choice's end, its tokens' logprobs (if asked for) and its prompt's (if
        asked for: an echo's)."""
        logprobs: list[TokenLogprob] | None = [] if gen.logprobs else None
        prompt: list[TokenLogprob] = []
        msg, checked = first, time.monotonic()
        while True:
            now = time.monotonic()
            if isinstance(msg, GenerationChunk):
                clock.tokens(len(msg.tokens), now)
                prompt = msg.prompt_logprobs or prompt
                if logprobs is not None:
                    logprobs += msg.logprobs
            else:
                if msg.error:
                    raise engine_error(msg)
                clock.done(msg.prompt_tokens, len(msg.tokens), finish_reason(msg), now)
                return msg, logprobs, prompt
            if now - checked >= DISCONNECT_CHECK_S:  # tokens keep coming: look anyway
                checked = now
                if await request.is_disconnected():
                    raise ApiError(499, "the client went away", "client_closed")
            msg = await self._next(events, request)

    async def _sse(self, shape: ResponseShape, firsts: list[Any],
                   events: list[AsyncIterator[Any]], clocks: list[RequestClock],
                   include_usage: bool) -> AsyncIterator[str]:
        """SSE events until [DONE]; leaving early (a disconnect) cancels the generations."""
        try:
            if shape.chat:
                for index in range(len(events)):
                    yield sse(_with_usage(shape.chunk("", None, role=True, index=index),
                                          include_usage))
            dones: dict[int, GenerationDone] = {}
            async with contextlib.aclosing(merged(firsts, events)) as stream:
                async for index, msg in stream:
                    if echo := shape.echo_chunk(index, getattr(msg, "prompt_logprobs", None)):
                        yield sse(_with_usage(echo, include_usage))  # before its first text
                    if isinstance(msg, GenerationChunk):
                        clocks[index].tokens(len(msg.tokens), time.monotonic())
                        if (msg.text or msg.logprobs) and not shape.holds(index, msg.text):
                            yield sse(_with_usage(shape.chunk(msg.text, msg.logprobs or None,
                                                              index=index), include_usage))
                        continue
                    if msg.error:
                        yield sse(self.failure(msg).body()) + sse("[DONE]")
                        return
                    dones[index] = msg
                    calls, reason = shape.ending(msg)
                    if shape.holds(index):  # a call at its end (or the text it was cut to)
                        yield sse(_with_usage(shape.tool_chunk(index, calls) if calls else
                                              shape.chunk(msg.text, None, index=index),
                                              include_usage))
                    clocks[index].done(msg.prompt_tokens, len(msg.tokens), finish_reason(msg),
                                       time.monotonic())  # stop / length, as whole replies
                    yield sse(_with_usage(shape.chunk("", None, reason, index=index),
                                          include_usage))
            if include_usage:
                yield sse(shape.usage_chunk([dones[i] for i in sorted(dones)]))
            yield sse("[DONE]")
        except ServiceUnavailable as exc:
            yield sse(ApiError(503, str(exc), "service_unavailable").body()) + sse("[DONE]")
        finally:
            await close_all(events)


def _with_usage(chunk: dict[str, Any], include_usage: bool) -> dict[str, Any]:
    return {**chunk, "usage": None} if include_usage else chunk


def create_app(backend: AsyncServiceClient, settings: ServeSettings | None = None) -> FastAPI:
    """The application serving ``backend``'s model."""
    api = ZctlApi(backend, settings or ServeSettings())
    app = FastAPI(title="zctl", docs_url=None, redoc_url=None)
    app.state.api = api
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES,
                       on_refused=lambda: api.metrics.errors.labels("413").inc())
    if api.settings.cors_origins:  # outermost: a preflight never reaches the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(api.settings.cors_origins),
                           allow_methods=["GET", "POST", "DELETE"], allow_headers=["*"])

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        api.metrics.errors.labels(str(exc.status)).inc()
        anthropic = request.url.path.startswith(MESSAGES_PATH)  # its clients' error shape
        return JSONResponse(error_body(exc) if anthropic else exc.body(), exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await _api_error(request, validation_error(exc))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return await _api_error(request, ApiError(exc.status_code, str(exc.detail),
                                                  "invalid_request_error"))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await api.complete(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await api.complete(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody, request: Request) -> dict[str, Any]:
        return await api.tokenize(body, request)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody, request: Request) -> dict[str, Any]:
        return await api.detokenize(body, request)

    add_responses_routes(app, api)
    add_messages_routes(app, api)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        api.check_key(request)
        return await api.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        api.check_key(request)
        return await api.model(model_id)

    @app.get("/health")
    async def health() -> JSONResponse:
        return await api.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return await api.render_metrics()

    @app.on_event("shutdown")
    async def _close() -> None:
        await backend.close()

    return app
