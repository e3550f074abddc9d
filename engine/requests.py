"""The engine's API: a generation request, the chunks it streams back, and how it ended.

Plain frozen dataclasses with no transport: the ZeroMQ front door
(controlplane.service_messages) carries these same fields on the wire, and any other
front door (an HTTP server) builds them from its own requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_PROMPT_CHARS = 1 << 20
MAX_NEW_TOKENS = 1 << 16
MAX_DRAFT_TOKENS = 32
SPECULATIVE_MODES = ("", "lookup")  # or "draft:PATH" (a 1-stage export on the coordinator)


class RequestRefused(ValueError):
    """A well-formed request the engine cannot run (e.g. a missing draft model)."""


@dataclass(frozen=True)
class GenerationRequest:
    """Generate for this prompt, streaming tokens back."""

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

    def problem(self) -> str | None:
        """What is wrong with the request's values (the first thing found), or None."""
        checks = (
            (0.0 <= self.temperature <= 100.0, "temperature must be in 0..100"),
            (0 <= self.top_k <= 1 << 20, "top_k must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.seed is None or 0 <= self.seed < 1 << 63, "seed must be >= 0"),
            (self.speculative in SPECULATIVE_MODES or (
                self.speculative.startswith("draft:") and len(self.speculative) > 6),
             f"speculative must be '', 'lookup' or 'draft:PATH', got {self.speculative!r}"),
            (0 <= self.k <= MAX_DRAFT_TOKENS,
             f"k must be in 0..{MAX_DRAFT_TOKENS} (0 = adaptive)"),
            (0 < len(self.prompt) <= MAX_PROMPT_CHARS,
             f"prompt must have 1..{MAX_PROMPT_CHARS} characters"),
            (0 < self.max_tokens <= MAX_NEW_TOKENS, f"max_tokens must be in 1..{MAX_NEW_TOKENS}"),
            (0 < len(self.request_id) <= 64, "request_id must be 1..64 chars"),
        )
        return next((text for ok, text in checks if not ok), None)


@dataclass(frozen=True)
class GenerationChunk:
    """Newly generated tokens and text, with running figures (or only a ``note``)."""

    request_id: str
    tokens: list[int]
    text: str
    produced: int
    ttft_ms: float | None = None
    tok_s: float | None = None
    timing: dict[str, dict[str, float]] = field(default_factory=dict)
    spec: dict[str, float] = field(default_factory=dict)  # acceptance, k, tokens_per_step
    note: str = ""  # what happened to the generation (paused: a stage is down; resumed)


@dataclass(frozen=True)
class GenerationDone:
    """The generation ended: all its tokens and text (``error`` is empty on success).

    ``stop_reason``: "eos", "max_tokens", "cancelled" or "error"."""

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
