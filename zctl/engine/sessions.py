"""Generation as per-stream state machines (pure: no executor, no sockets).

A ``DecodeSession`` is one stream's generation: it says what the stream feeds next (a
prefill chunk, or the last token plus K draft tokens at contiguous logical positions)
and what a reply emits; it never touches an executor. Greedy decoding is the K = 0 case.
``zctl.engine.scheduler`` steps sessions on an executor.

Speculative steps (paper §5): the reply's top-1 at each of the K+1 fed positions checks
the drafts; ``accept_prefix`` of them are emitted plus the target's own next token, so
the output equals greedy decoding. When sampling (temperature > 0) the reply carries the
logits and drafts are checked by rejection sampling (``zctl.engine.sampling``), which keeps
the target's distribution. The K - n rejected slots are rewound *with the next
step* (``mask_tail``): no extra round trip. With ``auto_k``, K is re-chosen every step
under a step-cost model fitted to this session's own steps (and the drafter's measured
time per token): for a drafter that can be replayed (prompt lookup) as the fixed K that
would have been fastest over the recent tokens (``zctl.engine.hindsight``), else by
``adapt_k`` from the acceptance measured so far.
"""

from __future__ import annotations

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



class DecodeSession:
    """One stream's generation, greedy (``k=0``) or speculative, as a state machine.

    Call ``plan()`` for the next step, run it on an executor, hand the reply to
    ``advance()``, which returns the tokens it emits; ``done`` tells when to stop. The
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
        self.k, self.auto_k, self.cost = k, auto_k or cost is not None, cost
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
        self.error: Exception | None = None
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError("prefill chunk must be at least 1")
        # the most tokens a prefill step may feed, and what the next one feeds (the
        # scheduler sets it from the stages' costs, up to the most)
        self.max_prefill_chunk = prefill_chunk or MAX_CHUNK
        self.prefill_chunk = self.max_prefill_chunk
        # with prompt_logprobs: token i's (i >= 1) under the tokens before it, once the
        # chunk holding position i - 1 is answered; its chunks answer every position
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] * (self.prompt.size - 1) if prompt_logprobs else None)
        self._replay: np.ndarray | None = None  # tokens to prefill again after a restart
        self._planned_to = 0  # prefill positions planned so far
        self._answered_to = 0  # ... and answered
        self._chunk_ends: deque[int] = deque()  # ends of prefill steps planned, not answered
        self.cached_tokens = 0  # prompt tokens whose KV came from the prefix cache (the
        # prefill starts there)
        self.restarts = 0
        self._position = self.prompt.size  # logical position of the last emitted token
        self._draft: list[int] = []
        self._forced: list[int] = []  # tokens the grammar forces, fed after the last one
        self.forced_fed = 0  # ... so far: emitted without a step of their own (jump-forward)
        self._rewind = 0
        self._draft_ms: list[float] = []  # drafter time per proposed token
        self.k_cap: int | None = None  # adaptive K's ceiling, set by the scheduler under load
        self._probe_gap = PROBE_EVERY  # steps between probes at K = 0 (see choose_k)
        self._next_probe = PROBE_EVERY - 1
        self._probing = False
        # adaptive K over a drafter that can be replayed: measured match lengths at every
        # position (zctl.engine.hindsight), and no probes
        self._hindsight = (DraftHindsight(self.drafter, k)
                           if self.auto_k and k > 0 and self.drafter.replayable
                           else None)
        self._last_cost: StepCost | None = None  # the latest cost fit the steps identified
        self._planned_at = 0.0
        self._started_at = 0.0
        self._decode_start: float | None = None
        self.done = max_new_tokens == 0

    # -- state -----------------------------------------------------------------------
    @property
    def prefilling(self) -> bool:
        return self._answered_to < self._prefill_tokens.size

    @property
    def can_plan_ahead(self) -> bool:
        """Whether another prefill step may be planned before the last one is answered
        (pipelined prefill: chunk k+1 enters stage 0 while chunk k is on later stages)."""
        return not self.done and self._planned_to < self._prefill_tokens.size

    @property
    def _prefill_tokens(self) -> np.ndarray:
        return self._replay if self._replay is not None else self.prompt

    @property
    def prefill_left(self) -> int:
        """Prefill tokens not yet planned."""
        return self._prefill_tokens.size - self._planned_to

    @property
    def kv_tokens(self) -> int:
        """The most KV slots the stream can hold: its prompt plus every new token."""
        return self.prompt.size + self.max_new_tokens

    @property
    def prefill_position(self) -> int:
        """The position the next prefill step starts at."""
        return self._planned_to

    @property
    def kv_history(self) -> list[int]:
        """The tokens whose KV the stream holds for certain (rejected drafts not counted):
        the prompt and every emitted token but the last, which has not been fed yet."""
        return self.history[:self._position] if self.emitted else []

    def skip_prefix(self, length: int) -> None:
        """Start the prefill at position ``length``: the stream's KV already holds the
        prompt's first ``length`` tokens (a prefix-cache hit loaded them)."""
        if self._planned_to or self._replay is not None or not 0 <= length < self.prompt.size:
            raise ValueError(f"cannot skip {length} tokens of a {self.prompt.size}-token "
                             "prompt once its prefill has started")
        self.cached_tokens = self._planned_to = self._answered_to = length

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

    def fail(self, error: Exception) -> None:
        self.error, self.done = error, True

    def clear_failure(self) -> None:
        """Undo ``fail`` for a failure that was the pipeline's, not the stream's (it went
        down under the step): ``restart`` then replays the stream onto fresh KV."""
        self.error, self.done = None, False  # (a stream that had ended would not have failed)

    def restart(self) -> None:
        """Go on from fresh KV (the stages lost this stream's: a node went down, the
        pipeline was rewired): the next steps prefill the prompt and every emitted token
        but the last again, then decoding continues where it stopped, with the same
        drafter, sampler and figures. Reset the executor's stream first."""
        self._rewind, self._draft, self._forced = 0, [], []  # the rejected slots went with
        # the old KV, the forced tokens with the step in flight
        del self.k_used[self.spec.steps:]  # a decode step planned but never answered
        self._probing = False
        if self._hindsight is not None:
            self._hindsight.reset()
        self.restarts += 1
        self.cached_tokens = self._planned_to = self._answered_to = 0
        self._chunk_ends.clear()
        if self.emitted:  # else still in the prompt: prefill it from the start
            self._replay = np.asarray(self.history[:self._position], dtype=np.int64)

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
        self._forced = self._forced_tokens()
        if self._forced:  # the grammar's forced tokens ride instead of drafts
            k_now = 0
        self.k_used.append(k_now)
        draft: list[int] = []
        if k_now > 0:
            start = time.perf_counter()
            draft = [int(t) for t in self.drafter.propose(self.history, k_now)][:k_now]
            if draft:
                self._draft_ms.append((time.perf_counter() - start) * 1e3 / len(draft))
            if self.constraint is not None:
                draft = self.constraint.usable_drafts(draft)
        self._draft = draft
        self._planned_at = time.perf_counter()  # the step's cost excludes drafting
        fed = len(draft) + 1 + len(self._forced)
        token = self.emitted[-1]
        return Step(self.stream_id, np.array([token, *draft, *self._forced], dtype=np.int64),
                    np.arange(self._position, self._position + fed),
                    np.arange(fed) if draft else None, self.wants_logits, self._rewind)

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
        tokens = self._prefill_tokens
        lo = self._planned_to
        hi = min(lo + max(1, min(self.prefill_chunk, self.max_prefill_chunk)), tokens.size)
        self._planned_to = hi
        self._chunk_ends.append(hi)
        if self._replay is not None:  # after a restart: the answer is known already
            return Step(self.stream_id, tokens[lo:hi], np.arange(lo, hi))
        if lo == self.cached_tokens:
            self._started_at = now
        if self.prompt_logprobs is not None:  # every position's logits, exactly
            return Step(self.stream_id, tokens[lo:hi], np.arange(lo, hi), np.arange(hi - lo),
                        True)
        return Step(self.stream_id, tokens[lo:hi], np.arange(lo, hi), None,
                    hi == tokens.size and self.wants_logits)

    def choose_k(self) -> int:
        """This step's draft length: ``k``, or under the cost model the hindsight K (or
        ``adapt_k``'s), at most ``k_cap`` when the scheduler sets one."""
        if not self.auto_k or self.k == 0:
            return self.k
        k_max = self.k if self.k_cap is None else min(self.k, self.k_cap)
        if k_max == 0:
            return 0
        # Measuring (the alternation below, a probe) costs more than its tokens on a CPU (two
        # shape changes): not worth it with too few tokens left to use what it learns.
        measuring = self.max_new_tokens - self.stats.new_tokens > PROBE_EVERY
        cost = self.cost or self.fitted_cost()
        # hindsight where hops dominate the step: its optimism tries drafts at two width
        # changes each, cheap behind WAN hops; on a LAN it cost chat prompts 10-15%
        # against plain decoding, so there the per-token estimate and its probes decide
        hindsight = (self._hindsight if self._hindsight and self._hindsight.ready()
                     and self._hops_dominate() else None)
        if cost is None:  # not enough distinct step sizes yet
            wide = (sum(1 for fed in self.spec.fed if fed > 1) if hindsight is not None
                    else self.spec.steps)  # behind hops: until drafts were really fed
            promising = hindsight is None or any(m > 0 for m in hindsight.recent)
            if measuring and wide < MEASURE_STEPS and promising:
                return min(k_max, AUTO_K_START)  # drafts of one width: one shape change
            k_now, hindsight = 0, None  # 1-token steps are the other size; probes go on
        elif hindsight is not None:  # the K that was fastest over the recent tokens
            k_now = best_fixed_k(hindsight.recent, cost, k_max,
                                 width=self.spec.fed[-1] if self.spec.fed else 1,
                                 horizon=self.max_new_tokens - self.stats.new_tokens)
        else:
            acceptance = estimate_acceptance(self.spec.accepted, self.spec.rejections)
            prev_fed = self.spec.fed[-1] if self.spec.fed else None
            k_now = adapt_k(acceptance, cost, k_max=k_max, prev_fed=prev_fed)
        if (k_now == 0 and measuring and hindsight is None
                and self.spec.steps >= self._next_probe):
            # K = 0 learns nothing: probe now and then. A probe costs more than its token
            # (two shape changes on a CPU), so rejected probes double the gap to the next.
            k_now, self._probing = 1, True
            self._next_probe = self.spec.steps + self._probe_gap
        return k_now

    def _hops_dominate(self) -> bool:
        """Whether the recent steps took ``HOPS_DOMINATE`` times the stages' compute (the
        rest is hops and queues), over the decode steps measured so far."""
        steps, stages = self.stats.step_ms[-COST_WINDOW:], self.stats.stage_ms[-COST_WINDOW:]
        if not steps:
            return False
        compute = float(np.median([sum(ms) for ms in stages])) if stages else 0.0
        return float(np.median(steps)) >= HOPS_DOMINATE * compute

    def fitted_cost(self) -> StepCost | None:
        """``fit_step_cost`` over this session's recent decode steps, plus draft time."""
        log = self.spec.fed[-COST_WINDOW - 1:]
        changed = width_changes(log)[len(log) - min(len(log), COST_WINDOW):]
        fed, ms = log[-COST_WINDOW:], self.stats.step_ms[-COST_WINDOW:]
        cost = fit_step_cost(fed, ms[-len(fed):], changed) if fed else None
        if cost is None:  # the window holds one step size now: keep the last fit
            return self._last_cost
        draft_ms = float(np.median(self._draft_ms[-COST_WINDOW:])) if self._draft_ms else 0.0
        self._last_cost = StepCost(cost.step_ms, cost.token_ms, draft_ms, cost.switch_ms)
        return self._last_cost

    # -- replies ---------------------------------------------------------------------
    def advance(self, reply: StepReply) -> list[int]:
        """Take the reply to the planned step; returns the tokens it emits."""
        now = time.perf_counter()
        if self.prefilling:
            lo, self._answered_to = self._answered_to, self._chunk_ends.popleft()
            if self.prompt_logprobs is not None and self._replay is None:
                self._note_prompt_logprobs(reply, lo)
            if self.prefilling:
                return []
            if self._replay is not None:  # caught up: the next step feeds emitted[-1]
                self._replay = None
                return []
            self.stats.ttft_ms = (now - self._started_at) * 1e3
            return self._with_logprobs(reply, self._emit([self._first_token(reply)], now), last=True)
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
        self._probe_answered(bool(draft), n)
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

    def _probe_answered(self, drafted: bool, accepted: int) -> None:
        """A probe's answer (see ``choose_k``) sets the gap to the next one."""
        if self._probing and drafted:
            if accepted:  # drafts pay again, maybe: probe at the usual rate from here
                self._probe_gap = PROBE_EVERY
                self._next_probe = min(self._next_probe, self.spec.steps + PROBE_EVERY)
            else:
                self._probe_gap = min(2 * self._probe_gap, PROBE_MAX)
        self._probing = False

    def _with_logprobs(self, reply: StepReply, tokens: list[int], last: bool = False) -> list[int]:
        """Record the emitted tokens' logprobs (when asked) from the reply's logits: the
        last row after a prefill, else one row per fed position."""
        if self.top_logprobs is not None and tokens:
            if reply.logits is None:
                raise RuntimeError("the pipeline returned no logits for a logprobs request")
            rows = reply.logits.reshape(-1, reply.logits.shape[-1])
            self.logprobs += token_logprobs(rows[-1:] if last else rows, tokens, self.top_logprobs,
                                            normalised=reply.logprob_rows)
        return tokens

    def _note_prompt_logprobs(self, reply: StepReply, lo: int) -> None:
        """The prompt's tokens after positions ``lo``.. of a prefill chunk's reply (row i
        answers position lo + i, so it gives token lo + i + 1's logprob)."""
        if reply.logits is None:
            raise RuntimeError("the pipeline returned no logits for a prompt's logprobs")
        assert self.prompt_logprobs is not None
        rows = reply.logits.reshape(-1, reply.logits.shape[-1])
        lps = token_logprobs(rows, self.prompt[lo + 1:lo + 1 + rows.shape[0]].tolist(),
                             self.top_logprobs or 0, normalised=reply.logprob_rows)
        self.prompt_logprobs[lo:lo + len(lps)] = lps

    def _first_token(self, reply: StepReply) -> int:
        if self.sampling is None:
            return int(reply.tokens[-1])
        assert self._rng is not None and reply.logits is not None
        row = self._constrained(adjust_logits(last_row(reply).logits, self.sampling,
                                              self.emitted, prompt=self.prompt))
        if self.sampling.greedy:
            return int(row[0].argmax())
        return draw(target_probs(row[0], self.sampling), self._rng)

    def _check(self, draft: list[int], reply: StepReply) -> tuple[int, int]:
        """How many drafts the target accepts, and the token that follows them."""
        if self.sampling is None:
            target = [int(t) for t in reply.tokens]
        else:
            assert self._rng is not None and reply.logits is not None
            rows = self._constrained(adjust_logits(reply.logits, self.sampling, self.emitted,
                                                   draft, self.prompt), draft)
            if not self.sampling.greedy:
                return speculative_sample(draft, target_probs(rows, self.sampling), self._rng)
            target = rows.argmax(axis=-1).tolist()  # greedy over penalised or biased logits
        n = accept_prefix(draft, target)
        return n, target[n]

    def _constrained(self, rows: np.ndarray, draft: Sequence[int] = ()) -> np.ndarray:
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
                self.done = True
                break
        if self._decode_start is not None:
            self.stats.decode_ms = (now - self._decode_start) * 1e3
        if self._hindsight is not None and out:
            self._hindsight.observe(self.history)
        return out
