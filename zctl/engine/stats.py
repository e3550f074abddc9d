"""What a generation measured: token counts, time to first token, step and stage times."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_ms: float = 0.0
    decode_ms: float = 0.0
    step_ms: list[float] = field(default_factory=list)
    stage_ms: list[list[float]] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        """Decode throughput: tokens after the first over the time they took."""
        return (self.new_tokens - 1) / (self.decode_ms / 1e3) if self.new_tokens > 1 else 0.0


@dataclass
class SpeculativeStats(GenerationStats):
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    rejections: int = 0  # steps where a draft token was rejected
    fed: list[int] = field(default_factory=list)  # tokens fed per decode step

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        return (self.new_tokens - 1) / self.steps if self.steps else 0.0
