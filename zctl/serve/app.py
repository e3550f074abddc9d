"""The FastAPI application: OpenAI's APIs (zctl.serve.openai: chat completions,
completions, responses, models, and vLLM's ``/tokenize`` and ``/detokenize``) and
Anthropic's messages (zctl.serve.anthropic), each an adapter over one ``ServingContext``
(zctl.serve.context) on the application's state, with ``/health`` and ``/metrics``, over an
``AsyncServiceClient`` (and CORS for the web origins ``ServeSettings`` names), and the web
page at ``/`` with its live cluster view (zctl.serve.web).

Every request is checked before anything runs: a bad field, an unknown model, a prompt
and ``max_tokens`` beyond the context are 400s, a wrong key a 401, a full queue a 429, a
pipeline that cannot serve a 503, each in its API's error shape, and none of them touches
the generations already running. A body over MAX_BODY_BYTES is a 413 before it is read
whole (by its Content-Length, or as its bytes arrive). A streamed reply is SSE; a client
that disconnects (or closes its stream) has its generation cancelled. Every reply is a
pydantic model, and ``/openapi.json`` describes them (zctl.serve.openapi).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from zctl.serve.anthropic import routes as anthropic_routes
from zctl.serve.anthropic.messages import Messages
from zctl.serve.anthropic.replies import error_body
from zctl.serve.context import Health, ServiceDown, ServingContext
from zctl.serve.encoding import json_reply
from zctl.serve.errors import ApiError, validation_error
from zctl.serve.limits import BodyLimit
from zctl.serve.openai import routes as openai_routes
from zctl.serve.openai.chat import ChatCompletions
from zctl.serve.openai.completions import Completions
from zctl.serve.openai.models import Models
from zctl.serve.openai.responses import Responses
from zctl.serve.openai.tokenization import Tokenization
from zctl.serve.openapi import openapi_document
from zctl.serve.settings import ServeSettings
from zctl.serve.web import routes as web_routes
from zctl.serve.web.feed import ClusterFeed
from zctl.service.async_client import AsyncServiceClient
from zctl.service.messages import ServiceStats

# The largest body a request the engine accepts needs: MAX_PROMPT_CHARS characters at up
# to 12 bytes of JSON each (an escaped surrogate pair), with room for the other fields.
MAX_BODY_BYTES = 16 << 20


def create_app(backend: AsyncServiceClient, settings: ServeSettings | None = None) -> FastAPI:
    """The application serving ``backend``'s model."""
    context = ServingContext(backend, settings or ServeSettings())
    app = FastAPI(title="zctl", docs_url=None, redoc_url=None)
    state = app.state
    state.context = context
    state.chat, state.completions = ChatCompletions(context), Completions(context)
    state.responses, state.models = Responses(context), Models(context)
    state.tokenization, state.messages = Tokenization(context), Messages(context)
    state.cluster_feed = ClusterFeed(lambda: _named_stats(context))
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES,
                       on_refused=lambda: context.metrics.errors.labels("413").inc())
    if context.settings.cors_origins:  # outermost: a preflight never reaches the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(context.settings.cors_origins),
                           allow_methods=["GET", "POST", "DELETE"], allow_headers=["*"])

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        context.metrics.errors.labels(str(exc.status)).inc()
        anthropic = request.url.path.startswith(anthropic_routes.PATH)  # its clients' shape
        return json_reply(error_body(exc) if anthropic else exc.body(), exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await _api_error(request, validation_error(exc))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return await _api_error(request, ApiError(exc.status_code, str(exc.detail),
                                                  "invalid_request_error"))

    app.include_router(openai_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(web_routes.router)
    app.openapi = lambda: openapi_document(  # type: ignore[method-assign]
        app, {**openai_routes.STREAMS, **anthropic_routes.STREAMS})

    @app.get("/health", response_model=Health,
             responses={503: {"model": Health | ServiceDown, "description": "Not serving"}})
    async def health() -> JSONResponse:
        return await context.health()

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return await context.render_metrics()

    @app.on_event("shutdown")
    async def _close() -> None:
        await backend.close()

    return app


async def _named_stats(context: ServingContext) -> ServiceStats:
    """The service's stats now, the model under the name replies carry."""
    return context.with_reply_name(await context.backend.stats())
