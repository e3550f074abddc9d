"""How failures become API errors (zctl.serve.protocol's ``ApiError``): a request pydantic
refused (or a chat completion another API's request was read as), a model this server does
not serve, a generation that failed."""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from zctl.engine.requests import GenerationDone, GenerationRequest
from zctl.serve.protocol import ApiError, ChatCompletionRequest, engine_error


def unknown_model(status: int, asked: str, served: str) -> ApiError:
    """A request named a model this server does not serve (OpenAI: 404 when the route
    names it, 400 when a completion's body does)."""
    return ApiError(status, f"the model {asked!r} is not served here; this server serves "
                    f"{served!r}", param="model", code="model_not_found")


def validation_error(exc: RequestValidationError | ValidationError) -> ApiError:
    """The first problem pydantic found, as OpenAI reports a bad parameter."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('msg')}")
    where = ".".join(loc)
    return ApiError(400, f"{where}: {first.get('msg')}" if where else str(first.get("msg")),
                    param=where or None)


def checked(gen: GenerationRequest) -> GenerationRequest:
    """``gen``, unless the engine would refuse it (a 400 saying why)."""
    problem = gen.problem()
    if problem is not None:
        raise ApiError(400, problem)
    return gen


def raise_failed(answers: list[Any]) -> None:
    """Raise the API error of the first generation among ``answers`` that ended failed."""
    failed = next((a for a in answers if isinstance(a, GenerationDone) and a.error), None)
    if failed is not None:
        raise engine_error(failed)


def chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """The chat completion another API's request reads as, checked (a 400 that names the
    first problem)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
