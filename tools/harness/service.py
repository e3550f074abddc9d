"""Requests through a local cluster's generation service (zctl.service), as ``zctl run``
sends them: a chat-templated request for an exact token count, one request's closing
message, and several sent at once with the span from the first answer to the last."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zctl.engine.requests import GenerationDone, GenerationRequest


def bench_request(prompt: str, tokens: int, **fields: Any) -> GenerationRequest:
    """A chat-templated request for exactly ``tokens`` tokens (EOS ignored), greedy unless
    ``fields`` say otherwise (the model's default sampling would make runs differ)."""
    from zctl.engine.requests import GenerationRequest

    return GenerationRequest(uuid.uuid4().hex[:16], prompt, tokens, True, ignore_eos=True,
                           **{"temperature": 0.0, **fields})


def generate_done(serve: str, prompt: str, tokens: int, **fields: Any) -> GenerationDone:
    """One request through the service at ``serve``: its closing message (an error the
    service reports is raised)."""
    from zctl.engine.requests import GenerationDone
    from zctl.service.client import generate_stream

    stream = generate_stream(serve, bench_request(prompt, tokens, **fields))
    done = [m for m in stream if isinstance(m, GenerationDone)][-1]
    if done.error:
        raise RuntimeError(done.error)
    return done


def generate_together(serve: str, requests: Sequence[GenerationRequest],
                      first_timeout: float = 120.0) -> tuple[list[GenerationDone], float]:
    """Send ``requests`` at once through the service at ``serve``: each one's closing
    message, in the requests' order, and the seconds from the first answer to the last
    (an error the service reports is raised)."""
    from zctl.engine.requests import GenerationDone
    from zctl.service.client import generate_many

    first: float | None = None
    dones: dict[str, GenerationDone] = {}
    for msg in generate_many(serve, list(requests), first_timeout=first_timeout):
        first = time.monotonic() if first is None else first
        if isinstance(msg, GenerationDone):
            if msg.error:
                raise RuntimeError(msg.error)
            dones[msg.request_id] = msg
    span = time.monotonic() - first if first is not None else 0.0
    return [dones[r.request_id] for r in requests], span
