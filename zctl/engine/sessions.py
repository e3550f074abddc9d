"""Generation as per-stream state machines (pure: no executor, no sockets).

A ``DecodeSession`` is one stream's generation: it says what the stream feeds next (a
prefill chunk, or the last token plus K draft tokens at contiguous logical positions)
and what a reply emits; it never touches an executor. Greedy decoding is the K = 0 case.
``zctl.engine.scheduler`` steps sessions on an executor. Where a session is, is its
``SessionState``; it moves by named transitions only (see ``DecodeSession``).

Speculative steps (paper §5): the reply's top-1 at each of the K+1 fed positions checks
the drafts; ``accept_prefix`` of them are emitted plus the target's own next token, so
the output equals greedy decoding. Where the executor computes one-query steps (paged
stages: ``one_query``, set by the scheduler), a decode step that feeds several tokens
(drafts, grammar-forced tokens) is one, and so is a replay's run of emitted tokens: each
token is computed as a single decode step would compute it, so the output is greedy
decoding's bit for bit, logits and all, under the default numerics too. When sampling
(temperature > 0) the reply carries the logits and drafts are checked by rejection
sampling (``zctl.engine.sampling``), which keeps the target's distribution. The K - n
rejected slots are rewound *with the next step* (``mask_tail``): no extra round trip.
With ``auto_k``, K is re-chosen every step (``DraftLength``) under a step-cost model
fitted to this session's own steps (and the drafter's measured time per token): for a
drafter that can be replayed (prompt lookup) as the fixed K that would have been fastest
over the recent tokens (``zctl.engine.hindsight``), else by ``adapt_k`` from the
acceptance measured so far.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Sequence

import numpy as np

from zctl.engine.constraints import TokenConstraint
from zctl.engine.drafting import (
    Drafter,
    LookupDrafter,
    StepCost,
    accept_prefix,
    adapt_k,
    estimate_acceptance,
    fit_step_cost,
    width_changes,
)
from zctl.engine.executor import Step, StepReply
from zctl.engine.hindsight import DraftHindsight, best_fixed_k
from zctl.engine.payloads import Want, payload_for
from zctl.engine.prefill import MAX_CHUNK
from zctl.engine.prefill_pieces import ANYWHERE, PieceRule
from zctl.engine.requests import PAYLOAD_POLICIES, TokenLogprob
from zctl.engine.sampling import (
    SamplingParams,
    adjust_logits,
    draw,
    speculative_sample,
    target_probs,
    token_logprobs,
)
from zctl.engine.stats import GenerationStats, SpeculativeStats

COST_WINDOW = 64  # decode steps the online cost model is fitted to
PROBE_EVERY = 16  # with adaptive K at 0, draft one token this often to keep measuring
PROBE_MAX = 256  # ... and back off to this gap while the probes keep being rejected
MAX_FORCED = 32  # the most grammar-forced tokens one step feeds (zctl.engine.constraints)
AUTO_K_START = 4  # adaptive K's first draft length, until a cost model is fitted
MEASURE_STEPS = 2  # ... drafted for this many steps, then 1-token steps give the other size
HOPS_DOMINATE = 2.0  # hindsight K once a step takes this many times the stages' compute


def last_row(reply: StepReply) -> StepReply:
    """A reply's answer for the step's last position only (a padded row group answers
    every position of a row that fed several tokens)."""
    logits = None if reply.logits is None else reply.logits.reshape(-1, reply.logits.shape[-1])[-1:]
    return StepReply(np.asarray(reply.tokens).reshape(-1)[-1:], logits, reply.stage_ms,
                     reply.request_id, reply.logprob_rows)


def should_stop(token: int, produced: int, max_new_tokens: int, stop_ids: frozenset[int]) -> bool:
    return token in stop_ids or produced >= max_new_tokens


class SessionState(enum.Enum):
    """Where a ``DecodeSession`` is. Its transitions:

    - PREFILLING -> DECODING: its prompt's last chunk is answered (the first token);
    - REPLAYING -> DECODING: the last chunk of what it replays is answered;
    - PREFILLING or DECODING -> FINISHED: a stop token, the token budget, a complete
      grammar (``advance``), or the caller's ``finish`` (a cancel, a stop string);
    - any -> FAILED: ``fail`` (an error: the stream's own, or its executor's);
    - FAILED -> HELD: ``clear_failure`` (the failure was the executor's);
    - any -> PREFILLING or REPLAYING: ``restart`` onto fresh KV (REPLAYING once it has
      emitted tokens).
    """

    PREFILLING = "prefilling"  # feeding its prompt (from its cached prefix on)
    REPLAYING = "replaying"  # after a restart: feeding its prompt and emitted tokens again
    DECODING = "decoding"  # a token a step (and the drafts of it when speculating)
    FINISHED = "finished"
    FAILED = "failed"  # ``error`` says why
    HELD = "held"  # its executor failed under it: it waits to be restarted


class PrefillProgress:
    """How far a session's prefill (its prompt, or after a restart the tokens it replays)
    has been planned into steps, and answered, from ``start`` (a cached prefix) on."""

    def __init__(self, tokens: np.ndarray, start: int = 0) -> None:
        self.tokens = tokens
        self.planned = self.answered = start
        self._chunk_ends: deque[int] = deque()  # ends of the steps planned, not answered

    @property
    def left(self) -> int:
        """Tokens not yet planned."""
        return self.tokens.size - self.planned

    @property
    def all_answered(self) -> bool:
        return self.answered >= self.tokens.size

    def plan(self, chunk: int, pieces: PieceRule = ANYWHERE, prompt_size: int | None = None,
             one_query: bool = False) -> tuple[int, int]:
        """The next step's [lo, hi): up to ``chunk`` tokens after the ones planned, cut
        where ``pieces`` allows within the first ``prompt_size`` tokens (None: all of
        them); past those (a replay's emitted tokens), when ``pieces`` is on, one token a
        step, or up to ``chunk`` with ``one_query`` (a one-query step computes them as
        the decode steps that emitted them did)."""
        lo = self.planned
        size = prompt_size if prompt_size is not None and pieces.on else self.tokens.size
        if lo >= size:
            hi = lo + (chunk if one_query or not pieces.on else 1)
        else:
            hi = pieces.cut(lo, lo + chunk, size)
        hi = self.planned = min(hi, self.tokens.size)
        self._chunk_ends.append(hi)
        return lo, hi

    def answer(self) -> int:
        """The oldest step planned is answered; where it started."""
        lo, self.answered = self.answered, self._chunk_ends.popleft()
        return lo


class DraftLength:
    """A session's draft length K, each decode step: ``k``, or with ``auto`` re-chosen
    under a step-cost model (``cost``, else one fitted to the session's recent decode steps
    plus the drafter's time per token ``draft_ms``): where hops dominate the step and the
    drafter is replayable, the K that would have been fastest over the recent tokens
    (``hindsight``); else ``adapt_k``'s from the acceptance measured so far, probing
    now and then while that K is 0. ``stats`` and ``spec`` are the session's figures."""

    def __init__(self, k: int, auto: bool, cost: StepCost | None, drafter: Drafter,
                 stats: GenerationStats, spec: SpeculativeStats) -> None:
        self.k, self.auto, self.cost = k, auto, cost
        self.draft_ms: list[float] = []  # drafter time per proposed token
        self._stats, self._spec = stats, spec
        self._probe_gap = PROBE_EVERY  # steps between probes at K = 0 (see choose)
        self._next_probe = PROBE_EVERY - 1
        self._probing = False
        # over a drafter that can be replayed: measured match lengths at every position
        # (zctl.engine.hindsight), and no probes
        self.hindsight = (DraftHindsight(drafter, k)
                          if auto and k > 0 and drafter.replayable else None)
        self._last_cost: StepCost | None = None  # the latest cost fit the steps identified

    def choose(self, tokens_left: int, cap: int | None = None) -> int:
        """This step's draft length: ``k``, or under the cost model the hindsight K (or
        ``adapt_k``'s), at most ``cap`` when one is set; ``tokens_left`` the tokens the
        session may still emit."""
        if not self.auto or self.k == 0:
            return self.k
        k_max = self.k if cap is None else min(self.k, cap)
        if k_max == 0:
            return 0
        spec = self._spec
        # Measuring (the alternation below, a probe) costs more than its tokens on a CPU (two
        # shape changes): not worth it with too few tokens left to use what it learns.
        measuring = tokens_left > PROBE_EVERY
        cost = self.cost or self.fit_cost()
        # hindsight where hops dominate the step: its optimism tries drafts at two width
        # changes each, cheap behind WAN hops; on a LAN it cost chat prompts 10-15%
        # against plain decoding, so there the per-token estimate and its probes decide
        hindsight = (self.hindsight if self.hindsight and self.hindsight.ready()
                     and self._hops_dominate() else None)
        if cost is None:  # not enough distinct step sizes yet
            wide = (sum(1 for fed in spec.fed if fed > 1) if hindsight is not None
                    else spec.steps)  # behind hops: until drafts were really fed
            promising = hindsight is None or any(m > 0 for m in hindsight.recent)
            if measuring and wide < MEASURE_STEPS and promising:
                return min(k_max, AUTO_K_START)  # drafts of one width: one shape change
            k_now, hindsight = 0, None  # 1-token steps are the other size; probes go on
        elif hindsight is not None:  # the K that was fastest over the recent tokens
            k_now = best_fixed_k(hindsight.recent, cost, k_max,
                                 width=spec.fed[-1] if spec.fed else 1, horizon=tokens_left)
        else:
            acceptance = estimate_acceptance(spec.accepted, spec.rejections)
            prev_fed = spec.fed[-1] if spec.fed else None
            k_now = adapt_k(acceptance, cost, k_max=k_max, prev_fed=prev_fed)
        if (k_now == 0 and measuring and hindsight is None
                and spec.steps >= self._next_probe):
            # K = 0 learns nothing: probe now and then. A probe costs more than its token
            # (two shape changes on a CPU), so rejected probes double the gap to the next.
            k_now, self._probing = 1, True
            self._next_probe = spec.steps + self._probe_gap
        return k_now

    def _hops_dominate(self) -> bool:
        """Whether the recent steps took ``HOPS_DOMINATE`` times the stages' compute (the
        rest is hops and queues), over the decode steps measured so far."""
        steps, stages = self._stats.step_ms[-COST_WINDOW:], self._stats.stage_ms[-COST_WINDOW:]
        if not steps:
            return False
        compute = float(np.median([sum(ms) for ms in stages])) if stages else 0.0
        return float(np.median(steps)) >= HOPS_DOMINATE * compute

    def fit_cost(self) -> StepCost | None:
        """``fit_step_cost`` over the session's recent decode steps, plus draft time."""
        log = self._spec.fed[-COST_WINDOW - 1:]
        changed = width_changes(log)[len(log) - min(len(log), COST_WINDOW):]
        fed, ms = log[-COST_WINDOW:], self._stats.step_ms[-COST_WINDOW:]
        cost = fit_step_cost(fed, ms[-len(fed):], changed) if fed else None
        if cost is None:  # the window holds one step size now: keep the last fit
            return self._last_cost
        draft_ms = float(np.median(self.draft_ms[-COST_WINDOW:])) if self.draft_ms else 0.0
        self._last_cost = StepCost(cost.step_ms, cost.token_ms, draft_ms, cost.switch_ms)
        return self._last_cost

    def judge_probe(self, drafted: bool, accepted: int) -> None:
        """A step was answered: if it was a probe (see ``choose``), its answer sets the
        gap to the next one."""
        if self._probing and drafted:
            if accepted:  # drafts pay again, maybe: probe at the usual rate from here
                self._probe_gap = PROBE_EVERY
                self._next_probe = min(self._next_probe, self._spec.steps + PROBE_EVERY)
            else:
                self._probe_gap = min(2 * self._probe_gap, PROBE_MAX)
        self._probing = False

    def restart(self) -> None:
        """The session goes on from fresh KV: no probe is in flight, the replay starts over."""
        self._probing = False
        if self.hindsight is not None:
            self.hindsight.reset()


class DecodeSession:
    """One stream's generation, greedy (``k=0``) or speculative, as a state machine.

    Call ``plan()`` for the next step, run it on an executor, hand the reply to
    ``advance()``, which returns the tokens it emits; ``done`` tells when to stop, and
    ``state`` where it is (``SessionState``). The
    executor's stream must be reset before the first step (the drivers do it).
    ``k`` is the draft length (the maximum when ``auto_k``); ``cost`` fixes the cost
    model for ``auto_k`` instead of fitting it online. ``sampling`` with a temperature
    > 0 samples (drafts are then checked by rejection sampling, so the output keeps the
    target's distribution); otherwise decoding is greedy. ``logits_payload`` says what the
    last stage sends when logits are read (zctl.engine.payloads: auto, fp16, fp32).
    """

    def __init__(self, stream_id: int, prompt_ids: Sequence[int], max_new_tokens: int,
                 stop_ids: Sequence[int] = (), *, drafter: Drafter | None = None, k: int = 0,
                 auto_k: bool = False, cost: StepCost | None = None,
                 prefill_chunk: int | None = None,
                 stats: GenerationStats | None = None,
                 sampling: SamplingParams | None = None,
                 top_logprobs: int | None = None, logits_payload: str = "auto",
                 constraint: TokenConstraint | None = None, prompt_logprobs: bool = False
                 ) -> None:
        if len(prompt_ids) == 0:
            raise ValueError("the prompt has no tokens")
        if k < 0:
            raise ValueError(f"draft length k must be >= 0, got {k}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        self.stream_id = stream_id
        self.prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        self.max_new_tokens = max_new_tokens
        self.stops = frozenset(int(t) for t in stop_ids)
        self.drafter = drafter if drafter is not None else LookupDrafter()
        # None: plain greedy, read from the reply's best tokens; else the logits are read
        # (to sample, or for greedy decoding over penalised or biased logits)
        self.sampling = sampling if sampling is not None and (
            not sampling.greedy or sampling.adjusts_logits) else None
        # the grammar the output is held to (zctl.engine.constraints): the logits are read
        self.constraint = constraint
        self._free_sampling = self.sampling  # ... and when it lets go (released)
        if constraint is not None:
            self.sampling = self.sampling or sampling or SamplingParams()
        self._rng = self.sampling.rng() if self.sampling is not None else None
        self.top_logprobs = top_logprobs  # None: no logprobs; else the alternatives per token
        if logits_payload not in PAYLOAD_POLICIES:
            raise ValueError(f"logits_payload must be one of {', '.join(PAYLOAD_POLICIES)}, "
                             f"got {logits_payload!r}")
        self.logits_payload = logits_payload
        self.logprobs: list[TokenLogprob] = []  # one per emitted token, when asked
        self.stats = stats if stats is not None else SpeculativeStats()
        self.spec = self.stats if isinstance(self.stats, SpeculativeStats) else SpeculativeStats()
        self.stats.prompt_tokens = self.prompt.size
        self.history = [int(t) for t in self.prompt]
        self.emitted: list[int] = []
        self.k_used: list[int] = []  # draft length asked for, per decode step
        self.draft_length = DraftLength(k, auto_k or cost is not None, cost, self.drafter,
                                        self.stats, self.spec)
        self.k_cap: int | None = None  # adaptive K's ceiling, set by the scheduler under load
        self.error: Exception | None = None
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError("prefill chunk must be at least 1")
        # the most tokens a prefill step may feed, and what the next one feeds (the
        # scheduler sets it from the stages' costs, up to the most)
        self.max_prefill_chunk = prefill_chunk or MAX_CHUNK
        self.prefill_chunk = self.max_prefill_chunk
        # where its prefill (and a replay) may be cut (zctl.engine.prefill_pieces); the
        # scheduler sets it before the first step
        self.pieces = ANYWHERE
        # whether its decode steps that feed several tokens (drafts, grammar-forced tokens)
        # and a replay's emitted tokens are one-query steps (``Step.one_query``: computed as
        # single decode steps would); the scheduler sets it where the executor computes them
        self.one_query = False
        # the next step feeds one decode token: no drafts nor forced tokens, a replay's
        # emitted tokens one a step (the scheduler's, for a row group's step that carries a
        # prompt's piece, whose tokens are computed together: a step is one-query or not)
        self.one_token = False
        # its sequence turns with LongRoPE's long set throughout (zctl.engine.long_rope):
        # the scheduler sets it from the prompt and the executor's threshold, and resets
        # the stream so
        self.long_rope = False
        self._prefill = PrefillProgress(self.prompt)
        # with prompt_logprobs: token i's (i >= 1) under the tokens before it, once the
        # chunk holding position i - 1 is answered; its chunks answer every position
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] * (self.prompt.size - 1) if prompt_logprobs else None)
        self.cached_tokens = 0  # prompt tokens whose KV came from the prefix cache (the
        # prefill starts there)
        self.restarts = 0
        # the decode step planned: its drafts, the tokens the grammar forces after the last
        # one, and the rejected slots of the step before, rewound with it
        self._position = self.prompt.size  # logical position of the last emitted token
        self._draft: list[int] = []
        self._forced: list[int] = []
        self.forced_fed = 0  # forced tokens so far: emitted without a step of their own
        self._rewind = 0
        self._planned_at = 0.0
        self._started_at = 0.0
        self._decode_start: float | None = None
        self.state = SessionState.FINISHED if max_new_tokens == 0 else SessionState.PREFILLING

    # -- state -----------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """Whether the generation is over (finished, or failed)."""
        return self.state is SessionState.FINISHED or self.state is SessionState.FAILED

    @property
    def prefilling(self) -> bool:
        """Whether its next steps feed its prompt (or, after a restart, a replay)."""
        return self.state is SessionState.PREFILLING or self.state is SessionState.REPLAYING

    @property
    def k(self) -> int:
        """The draft length (the most, when adaptive)."""
        return self.draft_length.k

    @property
    def auto_k(self) -> bool:
        return self.draft_length.auto

    @property
    def can_plan_ahead(self) -> bool:
        """Whether another prefill step may be planned before the last one is answered
        (pipelined prefill: chunk k+1 enters stage 0 while chunk k is on later stages)."""
        return self.prefilling and self._prefill.left > 0

    @property
    def prefill_left(self) -> int:
        """Prefill tokens not yet planned."""
        return self._prefill.left

    @property
    def kv_tokens(self) -> int:
        """The most KV slots the stream can hold: its prompt plus every new token."""
        return self.prompt.size + self.max_new_tokens

    @property
    def prefill_position(self) -> int:
        """The position the next prefill step starts at."""
        return self._prefill.planned

    @property
    def feeds_prompt(self) -> bool:
        """Whether its next step feeds prompt tokens (a prefill piece, computed together)."""
        return self.prefilling and self._prefill.planned < self.prompt.size

    @property
    def kv_history(self) -> list[int]:
        """The tokens whose KV the stream holds for certain (rejected drafts not counted):
        the prompt and every emitted token but the last, which has not been fed yet."""
        return self.history[:self._position] if self.emitted else []

    @property
    def wants_logits(self) -> Want:
        """Sampling draws from the logits, logprobs are read from them: the smallest reply
        that answers them exactly, or the one ``logits_payload`` asks for."""
        sampling = self.sampling
        top_k = (None if sampling is None else
                 0 if sampling.adjusts_logits or self.constraint is not None else sampling.top_k)
        return payload_for(self.logits_payload, top_logprobs=self.top_logprobs,
                           sampling_top_k=top_k)  # 0: every logit (a penalty may lift any)

    @property
    def last_k(self) -> int:
        return self.k_used[-1] if self.k_used else 0

    # -- transitions -----------------------------------------------------------------
    def skip_prefix(self, length: int) -> None:
        """Start the prefill at position ``length``: the stream's KV already holds the
        prompt's first ``length`` tokens (a prefix-cache hit loaded them)."""
        if (self._prefill.planned or self.state is SessionState.REPLAYING
                or not 0 <= length < self.prompt.size):
            raise ValueError(f"cannot skip {length} tokens of a {self.prompt.size}-token "
                             "prompt once its prefill has started")
        self.cached_tokens = length
        self._prefill = PrefillProgress(self.prompt, length)

    def finish(self) -> None:
        """End the generation where it is (the caller's stop: a cancel, a stop string)."""
        self.state = SessionState.FINISHED

    def fail(self, error: Exception) -> None:
        self.error, self.state = error, SessionState.FAILED

    def clear_failure(self) -> None:
        """Undo ``fail`` for a failure that was the executor's, not the stream's (it went
        down under the step): held, the session waits for ``restart``, which replays the
        stream onto fresh KV. (A stream that had ended would not have failed.)"""
        self.error, self.state = None, SessionState.HELD

    def restart(self) -> None:
        """Go on from fresh KV (the stages lost this stream's: a node went down, the
        executor was rewired): the next steps prefill the prompt and every emitted token
        but the last again, then decoding continues where it stopped, with the same
        drafter, sampler and figures. Reset the executor's stream first."""
        self._rewind, self._draft, self._forced = 0, [], []  # the rejected slots went with
        # the old KV, the forced tokens with the step in flight
        del self.k_used[self.spec.steps:]  # a decode step planned but never answered
        self.draft_length.restart()
        self.restarts += 1
        self.cached_tokens = 0
        if self.emitted:  # replay what its KV held, then decode on
            self._prefill = PrefillProgress(np.asarray(self.history[:self._position],
                                                       dtype=np.int64))
            self.state = SessionState.REPLAYING
        else:  # still in the prompt: prefill it from the start
            self._prefill = PrefillProgress(self.prompt)
            self.state = SessionState.PREFILLING

    # -- planning --------------------------------------------------------------------
    def plan(self) -> Step:
        """The next step to run (prefill chunk, or last token + drafts; its ``mask_tail``
        the previous step's rejected slots)."""
        if self.done:
            raise RuntimeError(f"stream {self.stream_id}'s generation is over")
        now = time.perf_counter()
        self._planned_at = now
        if self.prefilling:
            return self._plan_prefill(now)
        if self._decode_start is None:
            self._decode_start = now
        k_now = min(self.choose_k(), self.max_new_tokens - self.stats.new_tokens - 1)
        self._forced = [] if self.one_token else self._forced_tokens()
        if self._forced or self.one_token:  # the grammar's forced tokens ride instead of drafts
            k_now = 0
        self.k_used.append(k_now)
        draft = self._propose(self.history, k_now)
        if draft and self.constraint is not None:
            draft = self.constraint.usable_drafts(draft)
        self._draft = draft
        self._planned_at = time.perf_counter()  # the step's cost excludes drafting
        fed = len(draft) + 1 + len(self._forced)
        token = self.emitted[-1]
        return Step(self.stream_id, np.array([token, *draft, *self._forced], dtype=np.int64),
                    np.arange(self._position, self._position + fed),
                    np.arange(fed) if draft else None, self.wants_logits, self._rewind,
                    one_query=self.one_query and fed > 1)

    def _propose(self, history: list[int], size: int) -> list[int]:
        """Up to ``size`` drafted tokens after ``history``, the drafter's time recorded."""
        if size < 1:
            return []
        start = time.perf_counter()
        tokens = [int(t) for t in self.drafter.propose(history, size)][:size]
        if tokens:
            self.draft_length.draft_ms.append((time.perf_counter() - start) * 1e3 / len(tokens))
        return tokens

    def _forced_tokens(self) -> list[int]:
        """The tokens the grammar allows alone after the last one (jump-forward: they are
        fed in this step instead of one step each), leaving room for the token the step
        answers; none when logprobs are asked (a forced token's position is not read)."""
        room = min(MAX_FORCED, self.max_new_tokens - self.stats.new_tokens - 1)
        if self.constraint is None or self.top_logprobs is not None or room <= 0:
            return []
        return self.constraint.forced()[:room]

    def _plan_prefill(self, now: float) -> Step:
        """The next ``prefill_chunk`` tokens of the prompt (or of the replay)."""
        if not self.can_plan_ahead:
            raise RuntimeError(f"stream {self.stream_id}'s prefill is planned to its end: "
                               "its next step waits for the last chunk's answer")
        lo, hi = self._prefill.plan(max(1, min(self.prefill_chunk, self.max_prefill_chunk)),
                                    self.pieces, self.prompt.size,
                                    one_query=self.one_query and not self.one_token)
        tokens = self._prefill.tokens
        if self.state is SessionState.REPLAYING:  # the answer is known already
            emitted = lo >= self.prompt.size and hi - lo > 1  # decode steps computed them
            return Step(self.stream_id, tokens[lo:hi], np.arange(lo, hi),
                        one_query=self.one_query and emitted)
        if lo == self.cached_tokens:
            self._started_at = now
        if self.prompt_logprobs is not None:  # every position's logits, exactly
            return Step(self.stream_id, tokens[lo:hi], np.arange(lo, hi), np.arange(hi - lo),
                        True)
        return Step(self.stream_id, tokens[lo:hi], np.arange(lo, hi), None,
                    hi == tokens.size and self.wants_logits)

    def choose_k(self) -> int:
        """This step's draft length (``DraftLength.choose``), at most ``k_cap`` when the
        scheduler sets one."""
        return self.draft_length.choose(self.max_new_tokens - self.stats.new_tokens, self.k_cap)

    # -- replies ---------------------------------------------------------------------
    def advance(self, reply: StepReply) -> list[int]:
        """Take the reply to the planned step; returns the tokens it emits."""
        now = time.perf_counter()
        if self.prefilling:
            return self._advance_prefill(reply, now)
        draft, forced = self._draft, self._forced
        self.stats.step_ms.append((now - self._planned_at) * 1e3)
        self.stats.stage_ms.append(reply.stage_ms)
        if forced:  # emitted first (the grammar follows them); the step's last row answers
            self._forced, reply = [], last_row(reply)
            out = self._emit(forced, now)
            self.forced_fed += len(forced)
            self._position += len(forced)
            if self.done:  # they completed the grammar
                return out
        else:
            out = []
        n, following = self._check(draft, reply)
        self.draft_length.judge_probe(bool(draft), n)
        self.drafter.accept(n)
        self._rewind = len(draft) - n
        self._position += n + 1
        spec = self.spec
        spec.steps += 1
        spec.proposed += len(draft)
        spec.accepted += n
        spec.rejections += int(self._rewind > 0)
        spec.fed.append(len(draft) + 1)
        return out + self._with_logprobs(reply, self._emit([*draft[:n], following], now))

    def _advance_prefill(self, reply: StepReply, now: float) -> list[int]:
        """A prefill step's reply: the prompt's logprobs when asked; the first token after
        its last chunk (none after a replay's: the last emitted token is fed next)."""
        lo = self._prefill.answer()
        replaying = self.state is SessionState.REPLAYING
        if self.prompt_logprobs is not None and not replaying:
            self._note_prompt_logprobs(reply, lo)
        if not self._prefill.all_answered:
            return []
        self.state = SessionState.DECODING
        if replaying:
            return []
        self.stats.ttft_ms = (now - self._started_at) * 1e3
        return self._with_logprobs(reply, self._emit([self._first_token(reply)], now), last=True)

    def _with_logprobs(self, reply: StepReply, tokens: list[int], last: bool = False) -> list[int]:
        """Record the emitted tokens' logprobs (when asked) from the reply's logits: the
        last row after a prefill, else one row per fed position."""
        if self.top_logprobs is not None and tokens:
            if reply.logits is None:
                raise RuntimeError("the executor returned no logits for a logprobs request")
            rows = reply.logits.reshape(-1, reply.logits.shape[-1])
            self.logprobs += token_logprobs(rows[-1:] if last else rows, tokens, self.top_logprobs,
                                            normalised=reply.logprob_rows)
        return tokens

    def _note_prompt_logprobs(self, reply: StepReply, lo: int) -> None:
        """The prompt's tokens after positions ``lo``.. of a prefill chunk's reply (row i
        answers position lo + i, so it gives token lo + i + 1's logprob)."""
        if reply.logits is None:
            raise RuntimeError("the executor returned no logits for a prompt's logprobs")
        assert self.prompt_logprobs is not None
        rows = reply.logits.reshape(-1, reply.logits.shape[-1])
        lps = token_logprobs(rows, self.prompt[lo + 1:lo + 1 + rows.shape[0]].tolist(),
                             self.top_logprobs or 0, normalised=reply.logprob_rows)
        self.prompt_logprobs[lo:lo + len(lps)] = lps

    def _first_token(self, reply: StepReply) -> int:
        if self.sampling is None:
            return int(reply.tokens[-1])
        assert self._rng is not None and reply.logits is not None
        row = self._mask_to_grammar(adjust_logits(last_row(reply).logits, self.sampling,
                                                  self.emitted, prompt=self.prompt))
        if self.sampling.greedy:
            return int(row[0].argmax())
        return draw(target_probs(row[0], self.sampling), self._rng)

    def _check(self, draft: list[int], reply: StepReply) -> tuple[int, int]:
        """How many drafts the target accepts, and the token that follows them."""
        if self.sampling is None:
            target = np.asarray(reply.tokens).tolist()  # Python ints, in one call
        else:
            assert self._rng is not None and reply.logits is not None
            rows = self._mask_to_grammar(adjust_logits(reply.logits, self.sampling,
                                                       self.emitted, draft, self.prompt), draft)
            if not self.sampling.greedy:
                return speculative_sample(draft, target_probs(rows, self.sampling), self._rng)
            target = rows.argmax(axis=-1).tolist()  # greedy over penalised or biased logits
        n = accept_prefix(draft, target)
        return n, target[n]

    def _mask_to_grammar(self, rows: np.ndarray, draft: Sequence[int] = ()) -> np.ndarray:
        """A step's adjusted logits masked to the tokens the grammar allows: row i after
        the drafts before it."""
        if self.constraint is not None:
            rows = self.constraint.mask_rows(rows, draft)
        return rows

    @property
    def grammar_complete(self) -> bool:
        """The output is a whole match of the stream's grammar (it ended there)."""
        return self.constraint is not None and self.constraint.complete

    def _emit(self, tokens: list[int], now: float) -> list[int]:
        out = []
        for token in tokens:
            if self.constraint is not None:
                self.constraint.accept(token)
                if self.constraint.released:  # free text from here: no mask, no logits
                    self.constraint, self.sampling = None, self._free_sampling
            self.history.append(token)
            self.emitted.append(token)
            self.stats.new_tokens += 1
            out.append(token)
            if should_stop(token, self.stats.new_tokens, self.max_new_tokens,
                           self.stops) or self.grammar_complete:
                self.state = SessionState.FINISHED
                break
        if self._decode_start is not None:
            self.stats.decode_ms = (now - self._decode_start) * 1e3
        hindsight = self.draft_length.hindsight
        if hindsight is not None and out:
            hindsight.observe(self.history)
        return out
