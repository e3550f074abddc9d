"""Generation-service message schemas (client <-> coordinator): request, streamed chunks, done.

Schemas only; they share the control plane's envelope, registry and validation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from controlplane.messages import Message, _need, register

MAX_PROMPT_CHARS = 1 << 20
MAX_NEW_TOKENS = 1 << 16


@register
@dataclass(frozen=True)
class GenerateRequest(Message):
    """Client -> coordinator: generate for this prompt, streaming tokens back."""

    TYPE: ClassVar[str] = "generate_request"
    request_id: str
    prompt: str
    max_tokens: int = 128
    chat: bool = True
    ignore_eos: bool = False

    def check(self) -> None:
        _need(0 < len(self.prompt) <= MAX_PROMPT_CHARS,
              f"generate_request.prompt must have 1..{MAX_PROMPT_CHARS} characters")
        _need(0 < self.max_tokens <= MAX_NEW_TOKENS,
              f"generate_request.max_tokens must be in 1..{MAX_NEW_TOKENS}")
        _need(0 < len(self.request_id) <= 64, "generate_request.request_id must be 1..64 chars")


@register
@dataclass(frozen=True)
class GenerateChunk(Message):
    """Coordinator -> client: newly generated tokens and text, with running figures."""

    TYPE: ClassVar[str] = "generate_chunk"
    request_id: str
    tokens: list[int]
    text: str
    produced: int
    ttft_ms: float | None = None
    tok_s: float | None = None
    timing: dict[str, dict[str, float]] = field(default_factory=dict)


@register
@dataclass(frozen=True)
class GenerateDone(Message):
    """Coordinator -> client: the generation ended (error is empty on success)."""

    TYPE: ClassVar[str] = "generate_done"
    request_id: str
    tokens: list[int]
    text: str
    prompt_tokens: int
    ttft_ms: float
    tok_s: float
    timing: dict[str, dict[str, float]] = field(default_factory=dict)
    stop_reason: str = ""
    error: str = ""
