"""Step padding for paged stages: keep a step's token count where the CPU plugin charges
more for a change of shape than the padding tokens cost.

On some CPUs (measured on an Intel Xeon with AMX) the CPU plugin re-plans a paged stage's
graph whenever the step's token count changes: a step of 8 rows right after a step of 1
took 8.7 ms against 5.5 ms after another step of 8, and the 1-row step after the 8-row one
5.0 ms against 2.7. Serving steps change size all the time, for a moment: a stream
finishes and the next one joins a step later, a prompt found in the prefix cache steps
once alone between two steps of its group, two row groups of 4 and 3 rows alternate. A
stage therefore pads a step up to the largest token count of its last few steps that is
at most ``limit`` tokens more, with padding tokens on a scratch sequence whose outputs are
dropped. The limit is measured per stage when it warms up (the cost of a
change against the cost of a token, at most a full row group's 8 tokens). Where a change
costs under 15% of a step the limit is 0 and no step is padded: an AMD EPYC (AVX2)
measured no cost for a change on these graphs, and a padded token costs real compute
there.

Steps over 64 tokens (a prompt's chunk, alone or beside decoding rows) are also padded
up to a bucket, on every CPU: a multiple of 8 tokens up to 128, of 16 above (at most 11%
more tokens). The plugin keeps state for each token count a stage has run (compiled
kernels and their buffers, about 0.5-0.8 MB per count on SmolLM2's stages), so prompts
of every length would otherwise grow a stage's memory with every new length; in buckets
there are 8 counts up to 128 and one per 16 tokens above.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

WINDOW = 4  # steps a token count is kept after the last step that needed it
SMALL, LARGE = 1, 8  # the token counts the warm-up alternates (a lone row, a row group)
MIN_CHANGE = 0.15  # a change costing less than this share of a step is not worth padding for
# A step of over ``tokens`` tokens runs padded to a multiple of ``bucket`` (the last that
# applies); none of 64 tokens or fewer.
BUCKETS = ((64, 8), (128, 16))
BUCKET = max(bucket for _, bucket in BUCKETS)  # the most padding a step takes, plus one


def bucket_pad(tokens: int, buckets: tuple[tuple[int, int], ...] = BUCKETS,
               most: int = BUCKET) -> int:
    """Padding tokens that bring a step of ``tokens`` to its bucket (``buckets`` as
    BUCKETS; each bucket at most ``most`` tokens: a scratch block's size)."""
    bucket = next((min(b, most) for start, b in reversed(buckets) if tokens > start), 1)
    return (-tokens) % bucket


class ShapeKeeper:
    """Which padding a step of ``tokens`` tokens takes: up to the largest token count of
    the last ``window`` steps that is at most ``limit`` tokens more (0: never pad)."""

    def __init__(self, limit: int = 0, window: int = WINDOW) -> None:
        if limit < 0 or window < 1:
            raise ValueError(f"a padding limit >= 0 and a window >= 1, not {limit}, {window}")
        self.limit = limit
        self._recent: deque[int] = deque(maxlen=window)

    def pad(self, tokens: int) -> int:
        """Padding tokens for the next step of ``tokens`` real ones (the step is noted)."""
        extra = max((c - tokens for c in self._recent if c - tokens <= self.limit), default=0)
        self._recent.append(tokens)
        return max(extra, 0)


def padding_limit(same_ms: float, changed_ms: float, token_ms: float, cap: int) -> int:
    """Padding tokens worth one change of shape: the change's cost (``changed_ms`` less
    ``same_ms``, the quickest steps right after a change and after a step of the same size)
    over one token's (``token_ms``), at most ``cap``; 0 when a change costs under
    ``MIN_CHANGE`` of a step (timing noise on a busy machine stays under it) or the figures
    say nothing."""
    change = changed_ms - same_ms
    if change <= MIN_CHANGE * same_ms or token_ms <= 0:
        return 0
    return max(0, min(cap, int(change / token_ms + 1e-9)))


def measure_padding_limit(step: Callable[[int], None], cap: int, rounds: int = 6,
                          clock: Callable[[], float] = time.perf_counter,
                          small: int = SMALL) -> int:
    """The padding limit of a stage, from steps of ``small`` and LARGE tokens taken through
    ``step(tokens)`` and timed by ``clock`` (seconds): each size in turn twice (one right
    after a change, one after a step of its own size), ``rounds`` times, after one of each
    to warm both shapes; the quickest step of each kind counts. (A stage whose one-token
    steps run on a graph of their own measures with 2 tokens: the dynamic graph's changes.)"""
    if not SMALL <= small < LARGE:
        raise ValueError(f"the small step takes {SMALL} to {LARGE - 1} tokens, not {small}")
    for tokens in (small, LARGE):
        step(tokens)
    same: dict[int, list[float]] = {small: [], LARGE: []}
    changed: dict[int, list[float]] = {small: [], LARGE: []}
    for _ in range(rounds):
        for tokens in (small, LARGE):
            for times in (changed, same):
                start = clock()
                step(tokens)
                times[tokens].append((clock() - start) * 1e3)
    # The least of each: another process sharing the cores (a second stage warming up at
    # the same time) only ever adds time to a step.
    least = {k: (min(same[k]), min(changed[k])) for k in same}
    token_ms = (least[LARGE][0] - least[small][0]) / (LARGE - small)
    same_ms = (least[small][0] + least[LARGE][0]) / 2
    changed_ms = (least[small][1] + least[LARGE][1]) / 2
    return padding_limit(same_ms, changed_ms, token_ms, cap)
