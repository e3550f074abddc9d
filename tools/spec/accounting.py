"""The accounting behind tools/spec/speedup.py: output comparison, theoretical speedup,
per-step instrumentation, and the calibration of step, drafting and rewind costs.

Pure helpers first, then wrappers that time a pipeline's steps and a drafter's proposals,
then the measurements (see tools.spec.speedup's docstring for what is measured and why).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.stateful import StageRunner
from tools.harness.greedy import start_stream
from tools.harness.order import rotated
from tools.harness.stats import median, paired_ratio
from zctl.engine.drafting import LookupDrafter, StepCost, expected_tokens, fit_step_cost
from zctl.engine.executor import StepReply

CALIBRATION_STREAM, REWIND_STREAM, DRAFT_CALIBRATION_STREAM = 1001, 1002, 1003


# -- pure helpers ------------------------------------------------------------------------


def first_mismatch(reference: Sequence[int], candidate: Sequence[int]) -> int | None:
    """Index of the first token where candidate differs from reference (a length difference
    counts at the shorter length); None when they are identical."""
    for i, (a, b) in enumerate(zip(reference, candidate, strict=False)):
        if int(a) != int(b):
            return i
    if len(reference) != len(candidate):
        return min(len(reference), len(candidate))
    return None


def all_identical(pairs: Iterable[tuple[Sequence[int], Sequence[int]]]) -> bool:
    """True only if every (greedy, speculative) pair matches token for token (and there is
    at least one pair)."""
    seen = False
    for reference, candidate in pairs:
        seen = True
        if first_mismatch(reference, candidate) is not None:
            return False
    return seen


def theoretical_speedup(decoded: int, fed: Sequence[int], proposals: Sequence[int],
                        verify_ms: Callable[[int], float], draft_ms: Callable[[int], float],
                        step_ms: Callable[[Sequence[int]], list[float]] | None = None
                        ) -> float:
    """``decoded * c(1) / (sum c(fed_i) + sum d(n_j))``: see the module docstring.
    ``step_ms`` (default: ``verify_ms`` of each) models the steps of a log together."""
    if decoded < 1:
        return 1.0
    steps = step_ms(fed) if step_ms is not None else [verify_ms(f) for f in fed]
    cost = sum(steps) + sum(draft_ms(n) for n in proposals)
    return decoded * verify_ms(1) / cost if cost > 0 else math.inf


def theoretical_iid(acceptance: float, k: int, verify_ms: Callable[[int], float],
                    draft_ms: Callable[[int], float]) -> float:
    """``E(a, K) * c(1) / (c(K+1) + d(K))`` (independent per-token acceptance, full drafts)."""
    if k < 1:
        return 1.0
    return expected_tokens(acceptance, k) * verify_ms(1) / (verify_ms(k + 1) + draft_ms(k))


# -- instrumentation ---------------------------------------------------------------------


@dataclass
class StepRecord:
    first_position: int
    fed: int
    ms: float


@dataclass
class Generation:
    """One timed generation: its tokens and decode figures, the logged decode steps and
    (speculative) the drafter's proposals (tokens, ms) and acceptance counts."""

    tokens: list[int]
    tok_s: float
    decode_ms: float
    steps: list[StepRecord]
    proposals: list[tuple[int, float]] = field(default_factory=list)
    accepted: int = 0
    proposed: int = 0


class TimedPipeline:
    """A LocalChain that logs every step (first position, tokens fed, ms incl. rewind)."""

    def __init__(self, chain: LocalChain) -> None:
        self.chain, self.num_stages = chain, chain.num_stages
        self.log: list[StepRecord] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.chain, name)

    def open(self, stream_id: int) -> None:
        self.chain.open(stream_id)

    def reset(self, stream_id: int, long_rope: bool = False) -> None:
        self.chain.reset(stream_id, long_rope)

    def close_stream(self, stream_id: int) -> None:
        self.chain.close_stream(stream_id)

    def rewind(self, stream_id: int, count: int) -> None:
        self.chain.rewind(stream_id, count)

    def step(self, stream_id: int, token_ids: np.ndarray, positions: np.ndarray,
             logits_idx: np.ndarray | None = None, want_logits: bool = False, *,
             mask_tail: int = 0, **kwargs: Any) -> StepReply:
        start = time.perf_counter()
        if mask_tail or kwargs:
            reply = self.chain.step(stream_id, token_ids, positions, logits_idx, want_logits,
                                    mask_tail=mask_tail, **kwargs)
        else:
            reply = self.chain.step(stream_id, token_ids, positions, logits_idx, want_logits)
        ms = (time.perf_counter() - start) * 1e3
        self.log.append(StepRecord(int(np.asarray(positions).reshape(-1)[0]), len(token_ids), ms))
        return reply

    def decode_steps(self, prompt_len: int) -> list[StepRecord]:
        """The logged steps after prefill (their first position is past the prompt)."""
        return [r for r in self.log if r.first_position >= prompt_len]


class TimedDrafter:
    """Logs every proposal of a drafter: (tokens proposed, ms). Not replayable: a replay
    would log proposals nobody asked for."""

    replayable = False

    def __init__(self, drafter: Any) -> None:
        self.drafter = drafter
        self.log: list[tuple[int, float]] = []

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        start = time.perf_counter()
        out = self.drafter.propose(history, k)
        self.log.append((len(out), (time.perf_counter() - start) * 1e3))
        return out

    def accept(self, n: int) -> None:
        self.drafter.accept(n)


# -- measurements ------------------------------------------------------------------------


def filler_ids(prompts: Sequence[Sequence[int]], length: int) -> np.ndarray:
    """``length`` real token ids (the prompts concatenated and cycled)."""
    pool = [int(t) for p in prompts for t in p] or [1]
    return np.resize(np.asarray(pool, dtype=np.int64), length)


@dataclass
class Calibration:
    """Step costs of one calibration. Everything is measured interleaved rep by rep (each
    rep: one target step of every fed count, one draft-model step, one lookup call), and
    the model uses the median *ratio* of each cost to the same rep's 1-token step, scaled
    by the median 1-token step: with other processes on the cores, ratios taken a few ms
    apart hold while absolute times drift."""

    c1_ms: float  # median 1-token target step
    verify_ratio: dict[int, float]  # fed -> median c(fed) / c(1)
    lookup_ratio: float  # one LookupDrafter.propose call / c(1)
    draft_ratio: float  # one 1-token draft-model step / c(1) (0 without a draft model)
    samples: dict[int, list[float]] = field(default_factory=dict)  # fed -> ms
    lookup_ms: float = 0.0
    draft_token_ms: float = 0.0
    switch_ratio: float = 1.0  # a verify step right after draft-model steps / one without
    switched_ratio: dict[int, float] = field(default_factory=dict)  # fed -> c'(fed) / c(1)
    switched_raw: dict[int, float] = field(default_factory=dict)

    def switched_ms(self, fed: int) -> float:
        """A step whose token count differs from the previous step's (the plugin re-plans
        for the new shape): c'(fed)."""
        if fed in self.switched_ratio:
            return self.c1_ms * self.switched_ratio[fed]
        return self.verify_ms(fed)

    def step_ms(self, fed: Sequence[int]) -> list[float]:
        """Modelled cost of each step of a log: c'(f) when the count changed, else c(f)
        (the first decode step follows the prefill, another shape)."""
        return [self.switched_ms(f) if i == 0 or f != fed[i - 1] else self.verify_ms(f)
                for i, f in enumerate(fed)]

    def verify_ms(self, fed: int) -> float:
        if fed in self.verify_ratio:
            return self.c1_ms * self.verify_ratio[fed]
        fit = self.fit()  # outside the measured range: the straight line through it
        return fit.step_ms + fit.token_ms * (fed - 1)

    def fit(self) -> StepCost:
        """``fit_step_cost`` through the modelled c(fed) (for adapt_k)."""
        fed = sorted(self.verify_ratio)
        cost = fit_step_cost(fed, [self.c1_ms * self.verify_ratio[f] for f in fed])
        return cost if cost is not None else StepCost(self.c1_ms, 0.0)

    def draft_ms(self, drafter: str) -> Callable[[int], float]:
        if drafter == "lookup":
            return lambda n: self.c1_ms * self.lookup_ratio
        # n draft steps, plus what the verify step after them loses to the model switch
        return lambda n: (n * self.c1_ms * self.draft_ratio
                          + (max(self.switch_ratio - 1.0, 0.0) * self.verify_ms(n + 1) if n else 0.0))

    def as_json(self) -> dict[str, Any]:
        fit = self.fit()
        return {
            "verify_step_ms": {str(f): round(self.verify_ms(f), 3) for f in sorted(self.verify_ratio)},
            "verify_step_ms_raw_median": {str(f): round(median(v), 3)
                                          for f, v in sorted(self.samples.items())},
            "fit_step_ms": round(fit.step_ms, 3), "fit_token_ms": round(fit.token_ms, 3),
            "lookup_propose_ms": round(self.c1_ms * self.lookup_ratio, 4),
            "draft_token_ms": round(self.c1_ms * self.draft_ratio, 3),
            "draft_token_ms_raw_median": round(self.draft_token_ms, 3),
            "verify_after_draft_ratio": round(self.switch_ratio, 3),
            "verify_step_ms_count_changed": {str(f): round(self.switched_ms(f), 3)
                                             for f in sorted(self.switched_ratio)},
        }


def draft_burst_ms(chain: LocalChain, sid: int, draft_runner: StageRunner, dsid: int,
                   context: np.ndarray, burst: int) -> float:
    """ms per draft-model step of a burst of ``burst`` right after a verify step, as in the
    loop (the target's stream ``sid`` and the draft's ``dsid`` rewound after)."""
    pos = len(context)
    chain.step(sid, context[:burst + 1], np.arange(pos, pos + burst + 1), np.arange(burst + 1))
    chain.rewind(sid, burst + 1)
    # as ModelDrafter after a fully accepted draft: 2 tokens fed, then 1 at a time
    start = time.perf_counter()
    draft_runner.step(dsid, context[None, :2], np.arange(pos, pos + 2))
    for i in range(2, burst + 1):
        draft_runner.step(dsid, context[i:i + 1][None], np.arange(pos + i, pos + i + 1))
    ms = (time.perf_counter() - start) * 1e3 / burst
    draft_runner.mask_tail(dsid, burst + 1)
    return ms


def calibrate(chain: LocalChain, context: np.ndarray, max_fed: int, reps: int,
              draft_runner: StageRunner | None, lookup_k: int, draft_burst: int = 4
              ) -> Calibration:
    """Step cost of every fed count 1..max_fed (top-1 at every position, rewound by mask
    after each step), a lookup proposal and a 1-token draft-model step (the mean of a burst
    of ``draft_burst`` after a verify step, as the drafter runs in the loop), interleaved
    rep by rep, on streams of ``len(context)`` slots."""
    sid, dsid = CALIBRATION_STREAM, DRAFT_CALIBRATION_STREAM
    start_stream(chain, sid, context)
    pos = len(context)
    if draft_runner is not None:
        draft_runner.open_stream(dsid)
        draft_runner.reset_stream(dsid)
        draft_runner.step(dsid, context[None], np.arange(pos))
    history = context.tolist()
    lookup = LookupDrafter()
    samples: dict[int, list[float]] = {f: [] for f in range(1, max_fed + 1)}
    lookup_ms: list[float] = []
    draft_ms: list[float] = []
    # a verify step right after a draft-model burst, and the same rep's step of that count
    after_draft_ms: list[float] = []
    after_draft_bases: list[float] = []
    switched: dict[int, list[float]] = {f: [] for f in samples}
    feds = list(samples)

    def timed_step(fed: int) -> float:
        idx = np.arange(fed) if fed > 1 else None
        start = time.perf_counter()
        chain.step(sid, context[:fed], np.arange(pos, pos + fed), idx)
        ms = (time.perf_counter() - start) * 1e3
        chain.rewind(sid, fed)
        return ms

    for rep in range(reps):
        row, row_switched = {}, {}
        for fed in rotated(feds, rep):
            timed_step(2 if fed == 1 else 1)  # untimed: a step of another size first
            row_switched[fed] = timed_step(fed)  # the token count changed
            row[fed] = timed_step(fed)  # the same count again
        for fed, ms in row_switched.items():
            switched[fed].append(ms)
        start = time.perf_counter()
        lookup.propose(history, lookup_k)
        lookup_ms.append((time.perf_counter() - start) * 1e3)
        if draft_runner is not None:
            draft_ms.append(draft_burst_ms(chain, sid, draft_runner, dsid, context, draft_burst))
            # the verify step after a burst runs on caches the draft model just evicted
            after = timed_step(draft_burst + 1)
            if draft_burst + 1 in row:
                after_draft_ms.append(after)
                after_draft_bases.append(row[draft_burst + 1])
        for fed, ms in row.items():
            samples[fed].append(ms)
    for runner in chain.runners:
        runner.close_stream(sid)
    if draft_runner is not None:
        draft_runner.close_stream(dsid)

    def over(values: list[float], bases: list[float], none: float = 0.0) -> float:
        """``values`` over ``bases``, paired rep by rep (``paired_ratio``); ``none`` when
        nothing was measured."""
        ratio = paired_ratio(values, bases)
        return none if ratio is None else ratio

    one = samples[1]  # every rep's 1-token step
    verify_ratio = {f: over(v, one) for f, v in samples.items()}
    verify_ratio[1] = 1.0
    switched_ratio = {f: over(v, one) for f, v in switched.items()}
    return Calibration(median(one), verify_ratio, over(lookup_ms, one),
                       over(draft_ms, one), samples, median(lookup_ms),
                       median(draft_ms) if draft_ms else 0.0,
                       over(after_draft_ms, after_draft_bases, none=1.0), switched_ratio,
                       {f: median(v) for f, v in switched.items()})


def time_rewinds(chain: LocalChain, context: np.ndarray, count: int, reps: int
                 ) -> dict[str, Any]:
    """mask_tail vs trim_tail per call on every stage, interleaved; the slots are restored
    (untimed) after each: the keep table for mask, a re-fed step for trim."""
    sid = REWIND_STREAM
    start_stream(chain, sid, context)
    tail = context[-count:]
    positions = np.arange(len(context) - count, len(context))
    mask = [[] for _ in chain.runners]
    trim = [[] for _ in chain.runners]
    for _ in range(reps):
        for i, runner in enumerate(chain.runners):
            keep = runner.streams[sid].keep
            start = time.perf_counter()
            runner.mask_tail(sid, count)
            mask[i].append((time.perf_counter() - start) * 1e3)
            runner.streams[sid].keep = keep
        for i, runner in enumerate(chain.runners):
            start = time.perf_counter()
            runner.trim_tail(sid, count)
            trim[i].append((time.perf_counter() - start) * 1e3)
        chain.step(sid, tail, positions)  # put the trimmed slots back on every stage
    for runner in chain.runners:
        runner.close_stream(sid)
    return {
        "mask_rewind_ms": round(median([m for s in mask for m in s]), 5),
        "trim_rewind_ms": round(median([t for s in trim for t in s]), 5),
        "mask_rewind_stage_ms": [round(median(s), 5) for s in mask],
        "trim_rewind_stage_ms": [round(median(s), 5) for s in trim],
        "rewind_slots": int(len(context)), "rewind_count": count, "rewind_reps": reps,
    }


