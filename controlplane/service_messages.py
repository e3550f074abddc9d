"""The generation service's wire schema (client <-> coordinator): request, chunks, done.

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
