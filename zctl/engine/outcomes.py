"""What a generation's chunks and end report (pure): why it stopped, how a failure is
told, its speculation summary, and its draft and forced token tallies."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from zctl.engine.pipelined import PipelinedSession
from zctl.engine.requests import INTERNAL, UNAVAILABLE, GenerationRequest
from zctl.engine.sessions import DecodeSession


class PipelineDown(RuntimeError):
    """A stage's node is dead, gone or failed: steps through it cannot complete."""


def spec_summary(session: DecodeSession) -> dict[str, float]:
    """Acceptance, the current K and tokens per verify step of a speculative session."""
    spec = session.spec
    pipelined = isinstance(session, PipelinedSession)
    if (session.k == 0 and not pipelined) or not spec.steps:
        return {}
    recent = session.k_used[-16:]
    summary = {"acceptance": round(spec.acceptance_rate, 4), "k": float(session.last_k),
               "k_mean": round(sum(recent) / len(recent), 2),
               "tokens_per_step": round(spec.tokens_per_step, 3), "steps": float(spec.steps)}
    if pipelined:  # runs in flight at most now, and runs cancelled on a wrong guess
        summary.update(depth=float(session.depth()), cancelled=float(session.cancelled))
    return summary


def session_tokens(session: DecodeSession) -> Counter[str]:
    """A generation's draft tokens proposed and accepted, grammar-forced tokens, and the
    tokens it generated."""
    return Counter(proposed=session.spec.proposed, accepted=session.spec.accepted,
                   forced=session.forced_fed, generated=len(session.emitted))


def stop_reason(produced: Sequence[int], request: GenerationRequest, stop_ids: Sequence[int],
                error: Exception | None, cancelled: bool, stopped: bool = False) -> str:
    if error is not None:
        return "error"
    if cancelled:
        return "cancelled"
    if stopped or (produced and produced[-1] in request.stop_token_ids):
        return "stop"
    if produced and not request.ignore_eos and produced[-1] in stop_ids:
        return "eos"
    return "max_tokens"


def error_kind(error: Exception) -> str:
    """How a front door should report a generation's failure."""
    return UNAVAILABLE if isinstance(error, PipelineDown) else INTERNAL
