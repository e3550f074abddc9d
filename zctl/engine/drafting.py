"""Speculative decoding with mask-based rewind (paper §5), token-identical to greedy.

Each decode step feeds ``[last, d1..dK]`` (the last emitted token and K draft tokens) at
contiguous logical positions and asks the last stage for the top-1 at all K+1 positions.
The target's token after ``last`` checks ``d1``, the one after ``d1`` checks ``d2``, and
so on: ``n = accept_prefix(draft, target)`` drafts are accepted and ``target[n]`` (the
correction at the first mismatch, or the bonus token after all K) is emitted after them.
Every emitted token is the one greedy decoding would have produced, so the output is
identical; only the number of steps changes.

The KV state now holds ``K - n`` rejected slots. They are rewound *with the next step*
(``step(..., mask_tail=K - n)``): on a ``ClusterHead`` the rewind travels in that
step's frame, so it costs no extra round trip; ``LocalChain`` applies it before stepping
(mask, or trim for comparison). Logical positions count accepted tokens only, physical
slots keep growing until compacted (``LocalChain`` and ``ClusterHead`` compact a stream
once more than a threshold of its slots are masked; on the cluster a COMPACT frame
travels ahead of the next step).

The helpers here are small pure functions, in the style of gpt-fast's generate.py, plus
the prompt-lookup drafter (a model drafter: dataplane.runtime.draft_model) and ``StageLoad``,
which tells when the stages are too busy for drafts to pay; the loop that uses them is
``zctl.engine.sessions.DecodeSession``. Exactness
needs the same numbers from a 1-token and a K+1-token step: keep the KV cache in f32
(the cluster's default); a quantised (u8) cache can flip a near-tie between them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

# -- pure helpers ------------------------------------------------------------------------


def accept_prefix(draft: Sequence[int], target_argmax: Sequence[int]) -> int:
    """How many leading draft tokens the target agrees with.

    ``target_argmax[i]`` is the target's token after the i-th fed token (the last emitted
    token is fed first), so it checks ``draft[i]``; ``target_argmax[n]`` is the next token.
    """
    if len(target_argmax) < len(draft):
        raise ValueError(f"{len(draft)} draft tokens need at least as many target tokens, "
                         f"got {len(target_argmax)}")
    n = 0
    for proposed, verified in zip(draft, target_argmax, strict=False):
        if int(proposed) != int(verified):
            break
        n += 1
    return n


def lookup_draft(history: Sequence[int], k: int, max_ngram: int = 3,
                 min_ngram: int = 1) -> list[int]:
    """Prompt-lookup drafting: continue the history as it went on after its suffix last time.

    For n from ``max_ngram`` down to ``min_ngram``, find the most recent earlier occurrence
    of the last n tokens and propose the (up to k) tokens that followed it. Where that
    continuation runs into the end of the history it is extended with the same period
    (``a b a b`` proposes ``a b a ...``). Returns [] when no suffix n-gram occurred before.
    """
    if k < 1 or min_ngram < 1:
        return []
    seq = np.asarray(history, dtype=np.int64)
    period = next(suffix_periods(seq, max_ngram, min_ngram), None)
    return [] if period is None else periodic_continuation(seq, period, k)


def suffix_periods(history: Sequence[int], max_ngram: int = 3, min_ngram: int = 1
                   ) -> Iterator[int]:
    """Where the history's last n tokens occurred before, as periods (how far back each
    occurrence is): n from ``max_ngram`` down to ``min_ngram``, and for each n the most
    recent occurrence first."""
    seq = np.asarray(history, dtype=np.int64)
    length = len(seq)
    for n in range(min(max_ngram, length - 1), max(min_ngram, 1) - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # starts < length - n
        for hit in np.flatnonzero((windows == seq[length - n:]).all(axis=1))[::-1]:
            yield length - n - int(hit)


def periodic_continuation(history: Sequence[int], period: int, k: int) -> list[int]:
    """The ``k`` tokens after ``history`` that repeat its last ``period`` tokens: each the
    token ``period`` places before it (what follows an earlier occurrence ``period``
    tokens back, extended with that period where it runs into the end)."""
    if not 1 <= period <= len(history):
        raise ValueError(f"period must be in 1..{len(history)}, got {period}")
    tail = [int(t) for t in history[len(history) - period:]]
    return [tail[i % period] for i in range(k)]


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verify step yields when each draft is accepted with prob ``acceptance``
    (independently, until the first rejection): 1 + a + ... + a^k."""
    a = min(max(acceptance, 0.0), 1.0)
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass(frozen=True)
class StepCost:
    """Cost model of one verification step of K drafts, in ms.

    ``step_ms``: a 1-token step (every stage's compute for one token, every hop, the
    coordinator's overhead); ``token_ms``: each extra position fed in the same step
    (marginal compute: small where decode is memory-bound, as on an iGPU); ``draft_ms``:
    the drafter's time per draft token (about 0 for lookup drafting); ``switch_ms``: what
    a step costs more when its token count differs from the previous step's (the CPU
    plugin re-plans every node for the new shape: 5 ms on an 8.5 ms step, measured).
    """

    step_ms: float
    token_ms: float
    draft_ms: float = 0.0
    switch_ms: float = 0.0

    def verify_ms(self, k: int) -> float:
        return self.step_ms + k * (self.token_ms + self.draft_ms)


def switch_penalty(k: int, prev_fed: int | None, switch_ms: float) -> float:
    """The shape changes a step of ``k`` drafts commits to, after a step that fed
    ``prev_fed`` tokens. From 1-token steps, any draft costs two (out now, back later);
    from a draft width, staying or dropping back to 1 token costs what leaving later
    would (nothing extra), any other width one more."""
    if prev_fed is None or switch_ms <= 0:
        return 0.0
    if prev_fed == 1:
        return 2 * switch_ms if k > 0 else 0.0
    return 0.0 if k + 1 in (prev_fed, 1) else switch_ms


def adapt_k(acceptance: float, cost: StepCost, k_max: int = 16, k_min: int = 0,
            prev_fed: int | None = None) -> int:
    """The draft length K that maximises expected tokens per ms, E(K) / cost.verify_ms(K)
    (plus the shape changes it commits to after a step of ``prev_fed`` tokens, when the
    cost model has a ``switch_ms``: see ``switch_penalty``).

    With E(K) = (1 - a^(K+1)) / (1 - a), longer drafts pay off while the next draft token's
    chance a^(K+1) of being used buys more than its ``token_ms``: the larger the fixed
    ``step_ms`` (network hops), the longer K. With a = 0.8 and 2 ms per extra token this
    gives K = 6-7 for a 25 ms step (a LAN) and K = 12 for 125 ms (two 50 ms hops), as in
    the paper (§6.7). Ties go to the shorter K.
    """
    if k_max < k_min:
        raise ValueError(f"k_max {k_max} < k_min {k_min}")
    best, best_rate = k_min, -1.0
    for k in range(k_min, k_max + 1):
        ms = cost.verify_ms(k) + switch_penalty(k, prev_fed, cost.switch_ms)
        rate = expected_tokens(acceptance, k) / max(ms, 1e-9)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best


SATURATED = 0.8  # a stage computing this share of the time has no idle time to fill


def busiest_stage_share(busy_ms: Sequence[float], wall_ms: float,
                        shared_cores: bool = False) -> float:
    """The busiest stage's share of ``wall_ms`` spent computing (0.0 over no time); with
    ``shared_cores`` (every stage on one machine's cores) the stages' compute adds up.

    Drafts fill a pipeline's idle time; once a stage (or the cores the stages share)
    computes nearly all the time (several streams in flight) every verified draft token
    costs compute the other streams need.
    """
    busy = sum(busy_ms) if shared_cores else max(busy_ms, default=0.0)
    return busy / wall_ms if wall_ms > 0 else 0.0


def estimate_acceptance(accepted: int, rejections: int, prior: float = 0.5,
                        weight: float = 2.0) -> float:
    """Per-token acceptance rate: the truncated-geometric MLE accepted/(accepted+rejections),
    smoothed by ``weight`` pseudo-drafts at ``prior`` (so the first steps do not swing K)."""
    return (accepted + prior * weight) / (accepted + rejections + weight)


def fit_step_cost(fed: Sequence[int], step_ms: Sequence[float],
                  changed: Sequence[bool] | None = None) -> StepCost | None:
    """Least-squares ``step_ms + token_ms * (fed - 1)`` over measured steps (None if the
    steps fed fewer than two different token counts); with ``changed`` (whether each
    step's token count differed from the step before), ``+ switch_ms * changed`` too,
    where the steps tell the three apart."""
    x = np.asarray(fed, dtype=np.float64) - 1.0
    y = np.asarray(step_ms, dtype=np.float64)
    if x.size < 2 or np.unique(x).size < 2:
        return None
    if changed is not None and len(changed) == x.size:
        design = np.column_stack([np.ones_like(x), x, np.asarray(changed, dtype=np.float64)])
        if np.linalg.matrix_rank(design) == 3:
            (intercept, slope, switch), *_ = np.linalg.lstsq(design, y, rcond=None)
            return StepCost(step_ms=max(float(intercept), 0.0), token_ms=max(float(slope), 0.0),
                            switch_ms=max(float(switch), 0.0))
    slope, intercept = np.polyfit(x, y, 1)
    return StepCost(step_ms=max(float(intercept), 0.0), token_ms=max(float(slope), 0.0))


def width_changes(fed: Sequence[int]) -> list[bool]:
    """Per step: whether it fed a different token count from the step before (the first
    decode step follows the prompt's, another shape)."""
    return [i == 0 or f != fed[i - 1] for i, f in enumerate(fed)]


# -- drafters ----------------------------------------------------------------------------


class Drafter(Protocol):
    """Proposes draft tokens. ``replayable``: its draft is a cheap function of the history
    alone, so it may be asked what it would have drafted anywhere (adaptive K by
    hindsight, ``zctl.engine.hindsight``) or ahead of the answers (pipelined speculation)."""

    replayable: bool

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to k tokens likely to follow ``history`` (prompt + every emitted token)."""
        ...

    def accept(self, n: int) -> None:
        """Feedback: n of the last proposal's tokens were accepted."""
        ...


@dataclass
class LookupDrafter:
    """Prompt-lookup (n-gram) drafting: free to run, good on repetitive text and code;
    replayable (its draft is a cheap function of the history alone)."""

    replayable = True  # a class attribute, not a field
    max_ngram: int = 3
    min_ngram: int = 1

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        return lookup_draft(history, k, self.max_ngram, self.min_ngram)

    def accept(self, n: int) -> None:
        pass


class StageLoad:
    """How busy the stages are: their compute over the wall time of the last ``window``
    replies (each reply's ``stage_ms``, arrival times from ``observe``). With
    ``shared_cores`` the stages run on one machine's cores (a local cluster whose nodes
    share them), so their compute adds up."""

    MIN_REPLIES = 4

    def __init__(self, window: int = 32, shared_cores: bool = False) -> None:
        self._replies: deque[tuple[float, Sequence[float]]] = deque(maxlen=window)
        self.shared_cores = shared_cores

    def observe(self, now_s: float, stage_ms: Sequence[float]) -> None:
        self._replies.append((now_s, stage_ms))

    def share(self) -> float:
        """The busiest stage's share of the time computing (0.0 until enough replies)."""
        if len(self._replies) < self.MIN_REPLIES:
            return 0.0
        replies = list(self._replies)
        wall_ms = (replies[-1][0] - replies[0][0]) * 1e3
        stages = max(len(ms) for _, ms in replies)
        # the first reply's compute ran before the window opened
        busy = [sum(ms[i] for _, ms in replies[1:] if i < len(ms)) for i in range(stages)]
        return busiest_stage_share(busy, wall_ms, self.shared_cores)

    def saturated(self) -> bool:
        """Whether the busiest stage computes >= SATURATED of the time; True until enough
        replies tell (several streams starting together: no drafts before the load is known)."""
        return len(self._replies) < self.MIN_REPLIES or self.share() >= SATURATED
