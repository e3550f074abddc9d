"""The scheduler's prefill bookkeeping: what each step carried, what its answer measured,
and from both the next chunk of a prompt (the rules of ``engine.prefill``).

A ``PrefillPlanner`` notes the rows (tokens, past) of every step that carries a prompt's
chunk when it is submitted, and feeds each answer's busiest-stage compute back: to the
prefill cost fit for such steps, to the decode figure (``decode_ms``) for the others, and
to the budget of each prompt whose chunk rode in a decoding group's step. No pipeline, no
sessions of its own: the scheduler asks it for chunks and tells it what happened.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.prefill import (
    FusedChunkBudget,
    PrefillCost,
    StepCostModel,
    fair_chunk,
    lone_chunk,
)
from engine.sessions import DecodeSession

DECODE_MS_PRIOR = 10.0  # a decode step's busiest-stage ms until one is measured
DECODE_EWMA = 0.2  # weight of the newest decode step in ``decode_ms``


class PrefillPlanner:
    """Chunks for prompts, from the steps' measured costs (see the module docstring)."""

    def __init__(self, prior: StepCostModel) -> None:
        self.cost = PrefillCost(prior)
        self.decode_ms = 0.0  # recent decode steps' busiest-stage compute (EWMA)
        self._steps: dict[int, list[tuple[int, int]]] = {}  # request id -> rows (tokens, past)
        self._fused: dict[int, list[tuple[int, int]]] = {}  # request id -> (stream id,
        # tokens) of each prompt riding in that group step
        self._budgets: dict[int, FusedChunkBudget] = {}  # stream id -> its fused chunks'

    def chunk(self, session: DecodeSession, beside_decoders: bool, fused: bool,
              stages: int) -> int:
        """The next chunk of ``session``'s prompt: beside streams that are decoding, one
        that costs about one of their steps (``fused``: riding in their step, held to its
        measured budget); alone, the chunking that gets its first token soonest through
        ``stages`` overlapping stages (1: stages that take turns)."""
        cost, past = self.cost.model, session.prefill_position
        if beside_decoders:
            chunk = fair_chunk(self.decode_ms or DECODE_MS_PRIOR, past, cost,
                               left=session.prefill_left, fused=fused)
            if fused:
                chunk = self._budgets.setdefault(session.stream_id, FusedChunkBudget()).chunk(chunk)
        else:
            chunk = lone_chunk(session.prefill_left, past, stages, cost)
        return min(chunk, session.max_prefill_chunk)

    def submitted(self, request_id: int, rows: list[tuple[int, int]],
                  prompts: Sequence[tuple[int, int]] = ()) -> None:
        """A step carrying a prompt's chunk went out: its rows' (tokens, past), and the
        (stream id, tokens) of each prompt riding in a decoding group's step."""
        self._steps[request_id] = rows
        if prompts:
            self._fused[request_id] = list(prompts)

    def answered(self, request_id: int, stage_ms: Sequence[float]) -> None:
        """A step's answer came back, with each stage's compute."""
        busiest = max(stage_ms, default=0.0)
        rows = self._steps.pop(request_id, None)
        for stream_id, tokens in self._fused.pop(request_id, []):
            budget = self._budgets.get(stream_id)
            if budget is not None and self.decode_ms:
                budget.observe(tokens, busiest, self.decode_ms)
        if rows is not None:
            self.cost.observe_rows(rows, busiest)
        elif busiest > 0:
            self.decode_ms = (busiest if not self.decode_ms else
                              (1 - DECODE_EWMA) * self.decode_ms + DECODE_EWMA * busiest)

    def forget_step(self, request_id: int) -> None:
        """A step whose answer will never be taken (failed, cancelled, abandoned)."""
        self._steps.pop(request_id, None)
        self._fused.pop(request_id, None)

    def forget_stream(self, stream_id: int) -> None:
        """A stream whose prompt is in, or that left."""
        self._budgets.pop(stream_id, None)

    @property
    def notes(self) -> int:
        """Steps and streams it holds figures for (none once everything is answered)."""
        return len(self._steps) + len(self._fused) + len(self._budgets)
