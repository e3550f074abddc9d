"""Pipelined speculation: one stream keeps every stage busy (pure: no executor, no sockets).

With one stream, a pipeline of N stages leaves each stage idle (N-1)/N of the time: stage 0
waits for the last stage's answer before it can feed the next token. A
``PipelinedSession`` does not wait: while its step ("run") is on the later stages, stage 0
starts the next run on a *guessed* continuation (a prompt-lookup draft of the token the
run in flight will answer), and the next after that, up to a depth that covers the round
trip. Each run feeds the guessed token (and, with ``width`` > 0, that many drafts after it,
verified as today's speculation verifies them).

When a run's answer comes, the target's token after it is known: the next run in flight
stands if it was fed exactly that token (and the answered run's drafts were all
accepted); otherwise it and every run after it were computed on a wrong guess, and the
session asks for them to be cancelled (``take_cancel``): the scheduler drops them on every
stage (``Executor.cancel``: a stage that has not computed one yet skips it) and rewinds
the stream to the tokens it keeps. Every emitted token is the target's own, so the output
is token-identical to greedy decoding; with sampling the answered run's token is drawn as
it would be without pipelining, so the target's distribution is kept.

A run that stands costs no more than the plain step it replaces (one-token runs keep the
step width fixed, which the CPU plugin needs to avoid re-planning); a wrong guess costs
stage compute nobody waits for on a later stage, and at most a run's compute on stage 0.
The depth in flight adapts (``pipeline_depth``): the stages' compute plus the hops over the
busiest stage's compute (more behind slow hops), on a LAN no deeper than the measured
guesses usually stand, and 1 (no guessing) while they rarely do, probing now and then.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from zctl.engine.drafting import Drafter, LookupDrafter
from zctl.engine.executor import Step, StepReply
from zctl.engine.sampling import SamplingParams
from zctl.engine.sessions import DecodeSession
from zctl.engine.stats import GenerationStats

DEPTH_MAX = 16  # runs of one stream in flight at most
DEPTH_START = 2  # ... until the stages' compute and the hops are measured
TIMING_WINDOW = 32  # runs the depth is measured over
GUESS_WINDOW = 32  # guesses whose outcome the depth rule weighs
GUESS_MIN = 8  # guesses judged before their rate limits the depth
HIT_FLOOR = 0.2  # below this rate of standing guesses, guess only to probe
GUESS_PROBE_EVERY = 16  # ... once every this many runs
WIDE = 16  # drafts the adaptive width replays to measure matches; K at most, one step at a time
HOPS_DOMINATE = 1.0  # hops that take this many times the stages' compute are slow hops
LONG = 8  # drafts a run carries while the drafter's recent drafts matched long
LONG_MATCH = 4  # ... at least this many tokens (the median of the recent positions)


@dataclass
class Run:
    """One step in flight: ``fed`` tokens at positions ``start``.. (the first is the last
    emitted token, or while ``guessed`` a guess of the token the run before answers;
    drafts follow)."""

    start: int
    fed: list[int]
    guessed: bool
    planned_at: float

    @property
    def drafts(self) -> list[int]:
        return self.fed[1:]

    @property
    def end(self) -> int:
        return self.start + len(self.fed)


@dataclass(frozen=True)
class Cancel:
    """Runs to cancel (the newest ``runs`` of the stream in flight) and the logical tokens
    the stream keeps on every stage."""

    runs: int
    keep: int


def stands(answered: Run, accepted: int, following: int, successor: Run) -> bool:
    """Whether the run after ``answered`` was fed the right tokens: every draft of the
    answered run accepted, and its guess is the token the target gave after them."""
    return accepted == len(answered.drafts) and successor.fed[0] == following


def round_trip(step_ms: Sequence[float], stage_ms: Sequence[Sequence[float]]
               ) -> tuple[float, float] | None:
    """The runs' median compute over all stages and the hops: the least gap between a run's
    round trip and its compute (queueing excluded); None before two runs are measured."""
    if len(step_ms) < 2 or not stage_ms:
        return None
    computes = [sum(ms) for ms in stage_ms]
    gap = min(max(0.0, s - c) for s, c in zip(step_ms, computes, strict=False))
    return float(np.median(computes)), gap


def pipeline_depth(step_ms: Sequence[float], stage_ms: Sequence[Sequence[float]],
                   hits: Sequence[int], cap: int = DEPTH_MAX) -> int:
    """Runs to keep in flight: enough to cover a run's round trip (the stages' compute
    plus the hops, the least gap measured: queueing excluded) with runs of the busiest
    stage's compute, at most ``cap``, and 1 while fewer than ``HIT_FLOOR`` of the guesses
    stand. Where the hops do not dominate, no more runs than the guesses usually stand in
    a row (a rate ``h`` of standing guesses stands h / (1 - h) in a row on average): there
    a wrong guess's compute on stage 0 delays the run that replaces it by a good part of
    a round trip. Behind slow hops it delays it by a small part, and every guess that
    stands saves a whole round trip, so the runs cover the round trip."""
    measured = round_trip(step_ms, stage_ms)
    busiest = float(np.median([max(ms, default=0.0) for ms in stage_ms])) if stage_ms else 0.0
    if measured is None or busiest <= 0:
        depth = DEPTH_START
    else:
        depth = math.ceil((measured[0] + measured[1]) / busiest)
    if len(hits) >= GUESS_MIN:
        rate = sum(hits) / len(hits)
        if rate < HIT_FLOOR:
            return 1
        if measured is None or measured[1] < HOPS_DOMINATE * measured[0]:
            depth = min(depth, 1 + (cap if rate >= 1 else math.ceil(rate / (1 - rate))))
    return max(1, min(depth, cap))


class PipelinedSession(DecodeSession):
    """A stream's generation by pipelined speculation (see the module docstring): a
    ``DecodeSession`` with its states and transitions, whose DECODING state keeps runs in
    flight (``runs``) and asks for the wrong ones to be cancelled (``take_cancel``).

    ``width`` drafts ride in every run after its first token (0: one-token runs, the step
    width of plain decoding; None: adaptive, one-token runs unless the recent drafts
    matched long, see ``run_width``); ``depth`` fixes the
    runs in flight (None: ``pipeline_depth``);
    ``depth_cap`` (set by the scheduler) bounds it: 1 turns the guessing off, and the
    stream speculates as today's adaptive speculation does. The drafter
    must be replayable (its draft a function of the history alone: prompt lookup), since
    runs ahead are drafted on histories that may never happen.
    """

    def __init__(self, stream_id: int, prompt_ids: Sequence[int], max_new_tokens: int,
                 stop_ids: Sequence[int] = (), *, drafter: Drafter | None = None,
                 width: int | None = None, depth: int | None = None, prefill_chunk: int | None = None,
                 stats: GenerationStats | None = None, sampling: SamplingParams | None = None,
                 top_logprobs: int | None = None, logits_payload: str = "auto") -> None:
        drafter = drafter if drafter is not None else LookupDrafter()
        if not drafter.replayable:
            raise ValueError("pipelined speculation drafts ahead of the answers: it needs a "
                             "drafter whose draft depends on the history alone (lookup)")
        if (width is not None and width < 0) or (depth is not None and not 1 <= depth <= DEPTH_MAX):
            raise ValueError(f"width must be >= 0 and depth in 1..{DEPTH_MAX}")
        super().__init__(stream_id, prompt_ids, max_new_tokens, stop_ids, drafter=drafter,
                         k=WIDE if width is None else width, auto_k=width is None,
                         prefill_chunk=prefill_chunk,
                         stats=stats, sampling=sampling, top_logprobs=top_logprobs,
                         logits_payload=logits_payload)
        self.width, self.fixed_depth = width, depth
        self.depth_cap: int | None = None
        self.runs: deque[Run] = deque()
        self.hits: deque[int] = deque(maxlen=GUESS_WINDOW)  # 1: a guess that stood
        self.cancelled = 0  # runs cancelled in flight
        self._cancel: Cancel | None = None
        self._ahead: list[int] | None = None  # the next run's tokens, drafted once
        self._since_probe = 0

    # -- how far ahead ---------------------------------------------------------------
    def depth(self) -> int:
        """Runs this stream may have in flight now."""
        depth = self.fixed_depth or pipeline_depth(
            self.stats.step_ms[-TIMING_WINDOW:], self.stats.stage_ms[-TIMING_WINDOW:],
            self.hits)
        if depth == 1 and self.fixed_depth is None and self._since_probe >= GUESS_PROBE_EVERY:
            depth = 2  # guesses rarely stand: try one now and then
        return depth if self.depth_cap is None else max(1, min(depth, self.depth_cap))

    @property
    def can_run_ahead(self) -> bool:
        """Whether another run may start before the ones in flight are answered."""
        if self.done or self.prefilling or not self.runs or len(self.runs) >= self.depth():
            return False
        if self.runs[-1].end - self._position >= self._tokens_left():
            return False  # the runs in flight already reach the token budget
        return bool(self._next_tokens())

    def run_width(self) -> int:
        """Drafts the next run may carry (see ``width``): one-token runs, or ``LONG``
        while the drafter's recent drafts matched ``LONG_MATCH`` tokens or more (median).
        Behind slow hops too: a wide run stands only if every draft in it does, while
        one-token runs deep enough to cover the round trip lose only the runs after
        the first wrong guess. While the scheduler keeps the stream to one step at a
        time (``depth_cap`` 1), the K today's adaptive speculation would draft."""
        if self.width is not None:
            return self.width
        if self.depth_cap == 1:
            return self.choose_k()
        matches = self.draft_length.hindsight
        long = matches is not None and matches.ready() and np.median(matches.recent) >= LONG_MATCH
        return LONG if long else 0

    def _tokens_left(self) -> int:
        return self.max_new_tokens - self.stats.new_tokens

    def _assumed_history(self) -> list[int]:
        """The history as the runs in flight assume it: every fed token accepted."""
        history = list(self.history)
        for run in self.runs:
            history += run.fed[0 if run.guessed else 1:]
        return history

    def _next_tokens(self) -> list[int]:
        """The next run's guess and drafts (drafted once per run: ``_ahead``), no
        more than the token budget has room for beyond the runs in flight."""
        if self._ahead is None:
            room = self._tokens_left() - (self.runs[-1].end - self._position)
            self._ahead = self._propose(self._assumed_history(),
                                        min(self.run_width() + 1, room))
        return self._ahead

    # -- planning --------------------------------------------------------------------
    def plan(self) -> Step:
        if self.done or self.prefilling:
            return super().plan()
        now = time.perf_counter()
        if self._decode_start is None:
            self._decode_start = now
        if self.runs:
            if not self.can_run_ahead:
                raise RuntimeError(f"stream {self.stream_id} cannot run further ahead now")
            fed, guessed, rewind = self._next_tokens(), True, 0
            start = self.runs[-1].end
        else:
            width = 0 if self.one_token else min(self.run_width(), self._tokens_left() - 1)
            drafts = self._propose(self.history, width)
            fed, guessed, rewind = [self.emitted[-1], *drafts], False, self._rewind
            start = self._position
        self._ahead, self._rewind = None, 0
        self._since_probe = 0 if guessed else self._since_probe + 1
        self.k_used.append(len(fed) - 1)
        self.runs.append(Run(start, list(fed), guessed, time.perf_counter()))
        # greedy: the last stage can check a guess against the answer it gave before
        check = guessed if self.sampling is None else None
        return Step(self.stream_id, np.array(fed, dtype=np.int64),
                    np.arange(start, start + len(fed)),
                    np.arange(len(fed)) if len(fed) > 1 else None, self.wants_logits,
                    mask_tail=rewind, guessed=check, one_query=self.one_query and len(fed) > 1)

    # -- replies ---------------------------------------------------------------------
    def advance(self, reply: StepReply) -> list[int]:
        if self.prefilling or not self.runs:
            return super().advance(reply)
        now = time.perf_counter()
        run = self.runs.popleft()
        self._ahead = None  # drafted on a history that just changed
        n, following = self._check(run.drafts, reply)
        self.draft_length.judge_probe(bool(run.drafts), n)
        spec = self.spec
        spec.steps += 1
        spec.proposed += len(run.drafts)
        spec.accepted += n
        spec.rejections += int(n < len(run.drafts))
        spec.fed.append(len(run.fed))
        self.stats.step_ms.append((now - run.planned_at) * 1e3)
        self.stats.stage_ms.append(reply.stage_ms)
        self._position = run.start + n + 1
        emitted = self._with_logprobs(reply, self._emit([*run.drafts[:n], following], now))
        if self.runs:
            standing = not self.done and stands(run, n, following, self.runs[0])
            self.hits.append(int(standing))
            spec.proposed += 1  # a guess is a one-token draft
            spec.accepted += int(standing)
            spec.rejections += int(not standing)
            if standing:  # its first token is emitted now: no guess any more
                self.runs[0].guessed = False
            else:
                self._cancel = Cancel(len(self.runs), self._position)
                self._forget_runs()
        else:
            self._rewind = len(run.drafts) - n
        return emitted

    def take_cancel(self) -> Cancel | None:
        """The runs the last answer showed to be wrong, once (the scheduler cancels them)."""
        cancel, self._cancel = self._cancel, None
        return cancel

    def _forget_runs(self) -> None:
        """The runs in flight will never be answered: they leave, and so do their widths
        in ``k_used`` (one entry per answered run, as ``restart`` expects)."""
        self.cancelled += len(self.runs)
        del self.k_used[len(self.k_used) - len(self.runs):]
        self.runs.clear()

    def restart(self) -> None:
        self._forget_runs()
        self._cancel, self._ahead = None, None
        super().restart()
