"""API errors (``ApiError``, answered in OpenAI's error shape, ``ErrorReply``; Anthropic's
front door reshapes them) and how failures become them: a request pydantic refused, a
model this server does not serve, a generation the engine would refuse, one that
failed."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from zctl.engine.requests import BAD_REQUEST, UNAVAILABLE, GenerationDone, GenerationRequest
from zctl.service.messages import GenerationEvent


class ErrorObject(BaseModel):
    """What went wrong: OpenAI's error object."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorReply(BaseModel):
    """An error reply's body in OpenAI's shape (also a stream's last event)."""

    error: ErrorObject


class ApiError(Exception):
    """An error reply: HTTP ``status`` and the OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)

    def body(self) -> ErrorReply:
        return ErrorReply(error=ErrorObject(message=self.message, type=self.type,
                                            param=self.param, code=self.code))


def backend_down_error(exc: Exception) -> ApiError:
    """The 503 of a generation service that does not answer or went away."""
    return ApiError(503, str(exc), "service_unavailable", code="backend_down")


def engine_error(done: GenerationDone) -> ApiError:
    """The API error for a generation the engine refused or could not finish."""
    if done.error_kind == BAD_REQUEST:
        return ApiError(400, done.error.removeprefix("bad request: "))
    if done.error_kind == UNAVAILABLE:
        return ApiError(503, done.error, "service_unavailable", code="pipeline_down")
    return ApiError(500, done.error or "the generation failed", "internal_error")


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


def validate_generation(gen: GenerationRequest) -> GenerationRequest:
    """``gen``, unless the engine would refuse it (a 400 saying why)."""
    problem = gen.problem()
    if problem is not None:
        raise ApiError(400, problem)
    return gen


def raise_first_failure(answers: list[GenerationEvent]) -> None:
    """Raise the API error of the first generation among ``answers`` that ended failed."""
    failed = next((a for a in answers if isinstance(a, GenerationDone) and a.error), None)
    if failed is not None:
        raise engine_error(failed)
