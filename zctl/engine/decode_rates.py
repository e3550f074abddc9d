"""Aggregate decode speed as served, by how many streams were decoding together: the measured
side of the running placement's predicted tok/s at N streams (``zctl_predicted_tok_s``
beside ``zctl_measured_aggregate_tok_s`` in ``/metrics``).

The engine tells the meter, after each poll, the decode tokens its streams produced since
the last poll (each stream's first token is its prefill's, not counted) and how many
streams decode now. The time between two polls, and the tokens that came in it, are counted
for the number of streams that were decoding when it began; time with none decoding (idle,
or held while the pipeline is down) is not counted. A new executor (a re-plan, a heal)
starts the figures again: they measure the placement that runs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

MIN_SECONDS = 1.0  # a stream count's figure is reported once this much time was spent at it


@dataclass(frozen=True)
class DecodeRate:
    """Decode tokens produced, and the seconds it took, while ``streams`` streams decoded."""

    streams: int
    tokens: int
    seconds: float

    @property
    def tok_s(self) -> float:
        """All the streams' tokens together per second (0 before any time was counted)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class DecodeRateMeter:
    """Tokens and seconds by the number of streams decoding, since the last ``reset``."""

    def __init__(self) -> None:
        self._tokens: Counter[int] = Counter()
        self._seconds: Counter[int] = Counter()
        self._last: float | None = None  # the last observation's time
        self._streams = 0  # streams decoding since then

    def reset(self) -> None:
        """Start again (a new placement); the interval running now is not counted."""
        self._tokens.clear()
        self._seconds.clear()
        self._last, self._streams = None, 0

    def observe(self, now: float, tokens: int, streams: int) -> None:
        """``tokens`` decode tokens came since the last observation; ``streams`` decode
        from ``now`` on."""
        if tokens < 0 or streams < 0:
            raise ValueError("tokens and streams must be >= 0")
        if self._last is not None and self._streams > 0 and now > self._last:
            self._seconds[self._streams] += now - self._last
            self._tokens[self._streams] += tokens
        self._last, self._streams = now, streams

    def rates(self, min_seconds: float = MIN_SECONDS) -> list[DecodeRate]:
        """Each stream count's figures with at least ``min_seconds`` counted, fewest first."""
        return [DecodeRate(streams, self._tokens[streams], seconds)
                for streams, seconds in sorted(self._seconds.items()) if seconds >= min_seconds]
