"""The generation service's wire schema (client <-> coordinator): request, cancel, chunks,
done.

The fields are the engine's own (engine.requests); these classes put them in the control
plane's envelope, registry and validation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from controlplane.checks import need
from controlplane.messages import Message, register
from engine.requests import GenerationChunk, GenerationDone, GenerationRequest


@register
@dataclass(frozen=True)
class GenerateRequest(GenerationRequest, Message):
    """Client -> coordinator: generate for this prompt, streaming tokens back."""

    TYPE: ClassVar[str] = "generate_request"

    def check(self) -> None:
        problem = self.problem()
        need(problem is None, f"generate_request.{problem}")


@register
@dataclass(frozen=True)
class GenerateChunk(GenerationChunk, Message):
    """Coordinator -> client: newly generated tokens and text, with running figures."""

    TYPE: ClassVar[str] = "generate_chunk"


@register
@dataclass(frozen=True)
class GenerateDone(GenerationDone, Message):
    """Coordinator -> client: the generation ended (error is empty on success)."""

    TYPE: ClassVar[str] = "generate_done"


@register
@dataclass(frozen=True)
class GenerateCancel(Message):
    """Client -> coordinator: stop my generation ``request_id`` (it ends with the tokens it
    has, stop_reason "cancelled", and its KV slots are freed on every stage)."""

    TYPE: ClassVar[str] = "generate_cancel"
    request_id: str

    def check(self) -> None:
        need(0 < len(self.request_id) <= 64, "generate_cancel.request_id must be 1..64 chars")
