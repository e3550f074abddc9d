"""How a prompt is cut into prefill steps, from what the stages' steps cost (pure).

A prefill step of ``t`` tokens over ``p`` tokens already in the KV costs a stage about
``fixed + per_token * t + per_past * t * p + per_self * t * t`` ms: attention over the
past, and among the step's own tokens. With a stateful KV on the CPU plugin the past term
dominates: a step with a past runs the plugin's one-query-at-a-time attention kernel (a
256-token chunk over a 1,792-token past cost ~17x the same chunk with no past, measured on
SmolLM2), so a lone prompt is prefilled best in one step. On PagedAttention a past costs
what the step's own tokens do, so a long prompt is best cut and pipelined. ``PrefillCost``
fits the four terms to the steps the stages report; ``lone_chunk`` picks the chunk that
gets a lone prompt's first token soonest when its chunks are pipelined through the
stages; ``fair_chunk`` the chunk that costs about one decode step, so a prompt shares the
stages with streams that are decoding (chunked prefill) without more than doubling their
inter-token latency. A chunk that rides in the decoding rows' step (split-fuse) is then
held to ``FUSED_BUDGET`` times their step by ``FusedChunkBudget``, which measures instead
of modelling: on the CPU plugin's PagedAttention a row over a long past costs a step far
more than its share of the terms above (one token over 2,048 past ones made four rows'
18 ms step 27 ms), however few tokens it carries.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

MIN_CHUNK = 16  # a lone prompt's chunks are no smaller
FAIR_MIN_CHUNK = 4  # nor a shared prefill's (with a costly past a token costs the same either way)
SHORT_PREFILL = 64  # a prefill this short goes in one step, even beside decoding streams
MAX_CHUNK = 4096  # one step's mask is [T, past + T] floats: 64 MB at 4,096 tokens
FUSED_SHARE = 0.75  # a chunk riding in a decode step adds at most this share of its cost,
MODELLED_PROMPT = 512  # ... by the cost model, for a prompt this short; a longer one's are
FUSED_BUDGET = 1.4  # held so that the step they ride in measures at most this many decode steps
FUSED_GROW_BELOW = 0.8  # a step under this share of the budget lets the next allowance grow
FIT_WINDOW = 64
MIN_FIT = 6  # prefill steps observed before the fit replaces the prior


@dataclass(frozen=True)
class StepCostModel:
    """One stage's prefill step cost in ms: fixed + per_token * t + per_past * t * p +
    per_self * t * t."""

    fixed_ms: float = 2.0
    per_token_ms: float = 0.17
    per_past_ms: float = 1.6e-3
    per_self_ms: float = 6e-5

    def ms(self, tokens: int, past: int) -> float:
        return self.fixed_ms + tokens * (self.per_token_ms + self.per_past_ms * past
                                         + self.per_self_ms * tokens)

    def terms(self) -> np.ndarray:
        return np.array([self.fixed_ms, self.per_token_ms, self.per_past_ms, self.per_self_ms])


# Priors, until a stage's own steps are fitted (SmolLM2 stage 0, 2 threads, Intel Xeon,
# 2026-12-01): 256 tokens with no past ~45 ms on both; over a 1,792-token past 796 ms with
# the stateful KV's fused attention, 96 ms on PagedAttention; 2,048 tokens in one step
# ~600 ms.
STATEFUL_PRIOR = StepCostModel(2.0, 0.17, 1.6e-3, 6e-5)
PAGED_PRIOR = StepCostModel(2.0, 0.17, 1.1e-4, 5.5e-5)


def prefill_chunks(num_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """Split a prompt of num_tokens into [start, end) chunks of at most ``chunk`` tokens."""
    if chunk < 1:
        raise ValueError("prefill chunk must be at least 1")
    return [(s, min(s + chunk, num_tokens)) for s in range(0, num_tokens, chunk)]


def step_features(rows: list[tuple[int, int]]) -> tuple[float, float, float, float]:
    """The cost model's terms of one step whose rows (sequences) feed (tokens, past)
    each: the fixed cost once, the others summed over the rows."""
    return (1.0, float(sum(t for t, _ in rows)), float(sum(t * p for t, p in rows)),
            float(sum(t * t for t, _ in rows)))


class PrefillCost:
    """``StepCostModel`` of the busiest stage, fitted by least squares to the last
    ``FIT_WINDOW`` prefill steps observed (terms the samples cannot tell apart keep the
    prior's value, and none is negative); the prior until ``MIN_FIT`` are."""

    def __init__(self, prior: StepCostModel | None = None) -> None:
        self.prior = prior or STATEFUL_PRIOR
        self._samples: deque[tuple[tuple[float, ...], float]] = deque(maxlen=FIT_WINDOW)
        self._model: StepCostModel | None = None

    def observe(self, tokens: int, past: int, stage_ms: float) -> None:
        """A step of one sequence: ``tokens`` over ``past``, costing ``stage_ms``."""
        self.observe_rows([(tokens, past)], stage_ms)

    def observe_rows(self, rows: list[tuple[int, int]], stage_ms: float) -> None:
        """A step of several sequences (a prompt's chunk beside decoding rows)."""
        if sum(t for t, _ in rows) > 1 and stage_ms > 0:
            self._samples.append((step_features(rows), stage_ms))
            self._model = None

    @property
    def model(self) -> StepCostModel:
        if self._model is None:
            self._model = self._fit()
        return self._model

    def _fit(self) -> StepCostModel:
        if len(self._samples) < MIN_FIT:
            return self.prior
        design = np.array([f for f, _ in self._samples], dtype=np.float64)
        ms = np.array([m for _, m in self._samples], dtype=np.float64)
        scale = np.abs(design).max(axis=0)
        scale[scale == 0] = 1.0
        design = design / scale  # columns of one size, for the rank test
        prior = self.prior.terms() * scale
        fitted: list[int] = []
        for column in range(design.shape[1]):  # keep the columns that add information
            trial = [*fitted, column]
            if np.linalg.matrix_rank(design[:, trial], tol=1e-6) == len(trial):
                fitted = trial
        terms = prior.copy()
        while fitted:  # least squares, a term that comes out negative pinned at 0 (NNLS-like)
            fixed = [c for c in range(design.shape[1]) if c not in fitted]
            coef, *_ = np.linalg.lstsq(design[:, fitted], ms - design[:, fixed] @ terms[fixed],
                                       rcond=None)
            if (coef >= 0).all():
                terms[fitted] = coef
                break
            worst = fitted[int(np.argmin(coef))]
            terms[worst] = 0.0
            fitted.remove(worst)
        return StepCostModel(*(float(v) for v in terms / scale))


def pipelined_ms(chunks: list[int], past: int, stages: int, cost: StepCostModel) -> float:
    """When the last of ``chunks`` (token counts, prefilled in order from ``past``) leaves
    the last of ``stages`` equal stages, its chunks following each other without waiting."""
    done = [0.0] * stages
    for tokens in chunks:
        step = cost.ms(tokens, past)
        for stage in range(stages):
            done[stage] = max(done[stage], done[stage - 1] if stage else 0.0) + step
        past += tokens
    return done[-1]


def split(tokens: int, chunk: int) -> list[int]:
    return [min(chunk, tokens - s) for s in range(0, tokens, chunk)]


def lone_chunk(tokens: int, past: int, stages: int, cost: StepCostModel,
               cap: int = MAX_CHUNK) -> int:
    """The chunk size that gets a lone prompt of ``tokens`` (from ``past``) through the
    pipeline soonest: the whole prompt, or an even split into 2, 4, ... chunks. With one
    stage (or stages that take turns) nothing overlaps: a token attends to the same tokens
    whichever step it is in, so cutting only adds steps: the whole prompt, up to ``cap``."""
    if stages <= 1:
        return max(1, min(tokens, cap))
    best, best_ms = min(tokens, cap), float("inf")
    parts = 1
    while True:
        chunk = min(cap, -(-tokens // parts))
        if chunk < MIN_CHUNK and parts > 1:
            break
        ms = pipelined_ms(split(tokens, chunk), past, stages, cost)
        if ms < best_ms:
            best, best_ms = chunk, ms
        if chunk <= MIN_CHUNK:
            break
        parts *= 2
    return max(1, best)


def fair_chunk(decode_ms: float, past: int, cost: StepCostModel, cap: int = MAX_CHUNK,
               left: int | None = None, fused: bool = False) -> int:
    """The largest chunk that costs a stage about one decode step (``decode_ms``), at least
    ``FAIR_MIN_CHUNK`` tokens: a prompt's prefill interleaved with decode steps at most
    about doubles their inter-token time. ``fused``: the chunk rides in a decode step (a
    ragged row), whose fixed cost is paid already: it may add ``FUSED_SHARE`` of that
    step. A prefill with at most ``SHORT_PREFILL`` tokens ``left`` goes whole (it costs
    about a decode step; cutting it only adds steps)."""
    if left is not None and left <= SHORT_PREFILL:
        return max(1, min(cap, left))
    per, quad = cost.per_token_ms + cost.per_past_ms * past, cost.per_self_ms
    room = FUSED_SHARE * decode_ms if fused else decode_ms - cost.fixed_ms
    if room <= 0 or (per <= 0 and quad <= 0):
        tokens = FAIR_MIN_CHUNK if room <= 0 else cap
    elif quad > 0:  # the largest t with quad t^2 + per t <= room
        tokens = int((-per + np.sqrt(per * per + 4 * quad * room)) / (2 * quad))
    else:
        tokens = int(room / per)
    return int(min(cap, max(FAIR_MIN_CHUNK, tokens)))


@dataclass
class FusedChunkBudget:
    """How many prompt tokens a decoding group's step may carry (split-fuse), held by
    feedback to ``budget`` times the step without them: after each such step the allowance
    is halved if the step cost more than the budget, kept if near it, and grown by a
    quarter if under ``FUSED_GROW_BELOW`` of it. It belongs to the group, not to a prompt,
    so the next prompt starts where the last one left it."""

    budget: float = FUSED_BUDGET
    tokens: int = FAIR_MIN_CHUNK  # the allowance of the next step

    def observe(self, tokens: int, step_ms: float, decode_ms: float) -> None:
        """A step that carried ``tokens`` prompt tokens cost ``step_ms`` (busiest stage),
        against ``decode_ms`` for the decoding rows' step alone. A step that carried more
        than the allowance (prompts chunked by the cost model) says nothing of it."""
        if tokens < 1 or tokens > self.tokens or step_ms <= 0 or decode_ms <= 0:
            return
        ratio = step_ms / decode_ms
        if ratio > self.budget:
            self.tokens = max(1, tokens // 2)
        elif ratio < FUSED_GROW_BELOW * self.budget:
            self.tokens = min(MAX_CHUNK, max(self.tokens, tokens + max(1, tokens // 4)))
        # near the budget: the allowance stays (a step that carried less, a prompt's last
        # chunk, leaves it as it was)
