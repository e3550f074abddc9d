"""Generation-service message schemas (client <-> coordinator): request, streamed chunks, done.

Schemas only; they share the control plane's envelope, registry and validation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from controlplane.checks import need
from controlplane.messages import Message, register

MAX_PROMPT_CHARS = 1 << 20
MAX_NEW_TOKENS = 1 << 16
MAX_DRAFT_TOKENS = 32
SPECULATIVE_MODES = ("", "lookup")  # or "draft:PATH" (a 1-stage export on the coordinator)


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
    speculative: str = ""  # "", "lookup" or "draft:PATH"
    k: int = 0  # draft tokens per step; 0 = adaptive (up to MAX_DRAFT_TOKENS // 2)
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k truncation
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh seed per request

    def check(self) -> None:
        need(0.0 <= self.temperature <= 100.0, "generate_request.temperature must be in 0..100")
        need(0 <= self.top_k <= 1 << 20, "generate_request.top_k must be >= 0")
        need(0.0 < self.top_p <= 1.0, "generate_request.top_p must be in (0, 1]")
        need(self.seed is None or 0 <= self.seed < 1 << 63, "generate_request.seed must be >= 0")
        need(self.speculative in SPECULATIVE_MODES or (
            self.speculative.startswith("draft:") and len(self.speculative) > 6),
            f"generate_request.speculative must be '', 'lookup' or 'draft:PATH', "
            f"got {self.speculative!r}")
        need(0 <= self.k <= MAX_DRAFT_TOKENS,
              f"generate_request.k must be in 0..{MAX_DRAFT_TOKENS} (0 = adaptive)")
        need(0 < len(self.prompt) <= MAX_PROMPT_CHARS,
              f"generate_request.prompt must have 1..{MAX_PROMPT_CHARS} characters")
        need(0 < self.max_tokens <= MAX_NEW_TOKENS,
              f"generate_request.max_tokens must be in 1..{MAX_NEW_TOKENS}")
        need(0 < len(self.request_id) <= 64, "generate_request.request_id must be 1..64 chars")


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
    spec: dict[str, float] = field(default_factory=dict)  # acceptance, k, tokens_per_step
    note: str = ""  # what happened to the generation (paused: a stage is down; resumed)


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
    spec: dict[str, float] = field(default_factory=dict)
