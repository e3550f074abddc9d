"""What a stream's KV costs against the stages' KV budget (pure).

The budget is counted in tokens of the fullest stage: a token's keys and values over the
most layers a stage has (``zctl.service.server.kv_tokens``). A stream of T tokens costs T
of them where every layer keeps every token. Where a stage's sliding-window layers keep
only their window and a margin (paged stages: ``dataplane.runtime.kv.blocks.SlidingWindow``;
stateful ones, with a slack, where the export lets them: ``kv.sliding_states.SlidingStates``),
those layers hold at most ``sliding_tokens`` of it, and the stream costs the most that any
stage holds for it: (global layers x T + sliding layers x min(T, sliding_tokens)) over the
fullest stage's layers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KvCost:
    """``stages``: each stage's (global layers, sliding layers); ``sliding_tokens``: the
    most tokens a sliding layer keeps of a stream (None: every layer keeps every token)."""

    stages: tuple[tuple[int, int], ...] = ()
    sliding_tokens: int | None = None

    def __post_init__(self) -> None:
        if any(g < 0 or s < 0 or g + s == 0 for g, s in self.stages):
            raise ValueError(f"every stage has layers, none a negative count: {self.stages}")
        if self.sliding_tokens is not None and self.sliding_tokens < 1:
            raise ValueError(f"a sliding layer keeps at least 1 token, not {self.sliding_tokens}")

    def tokens(self, stream_tokens: int) -> int:
        """The budget's tokens a stream of ``stream_tokens`` tokens holds."""
        if self.sliding_tokens is None or not self.stages:
            return stream_tokens
        most = max(g + s for g, s in self.stages)
        kept = min(stream_tokens, self.sliding_tokens)
        return max(-(-(g * stream_tokens + s * kept) // most) for g, s in self.stages)


EVERY_TOKEN = KvCost()  # every layer keeps every token: a stream costs its tokens
