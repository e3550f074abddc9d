"""ASGI middleware that bounds a request's body: over the limit, a 413 in OpenAI's error
shape before the body is read whole (by its Content-Length, or as its bytes arrive)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zctl.serve.encoding import json_reply
from zctl.serve.errors import ApiError


class BodyTooLarge(Exception):
    """A request's body passed the limit while it was being read."""


class BodyLimit:
    """ASGI middleware: a request whose body is over ``limit`` bytes gets a 413 in OpenAI's
    error shape, at once when its Content-Length says so, else once the bytes read pass
    the limit (a chunked body); ``on_refused`` counts it."""

    def __init__(self, app: Any, limit: int, on_refused: Callable[[], None]) -> None:
        self.app, self.limit, self.on_refused = app, limit, on_refused

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._refuse(send)
            return
        received, over, answered = 0, False, False

        async def counted_receive() -> dict[str, Any]:
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    over = True
                    raise BodyTooLarge
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            nonlocal answered
            if over and not answered:  # the app's answer to the cut-off body: ours instead
                answered = True
                await self._refuse(send)
            elif not over:
                answered = answered or message["type"] == "http.response.start"
                await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except BodyTooLarge:
            if not answered:
                await self._refuse(send)

    async def _refuse(self, send: Any) -> None:
        self.on_refused()
        error = ApiError(413, f"the request body is over {self.limit} bytes",
                         code="request_too_large")
        await json_reply(error.body(), 413)({"type": "http"}, None, send)
