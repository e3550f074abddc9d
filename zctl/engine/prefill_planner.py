"""The scheduler's prefill decisions and bookkeeping: what each step carried, what its
answer measured, and from both the next chunk of a prompt (the rules of
``zctl.engine.prefill``) and how many of a lone prompt's chunks go in flight at once.

A ``PrefillPlanner`` notes the rows (tokens, past) of every step that carries a prompt's
chunk when it is submitted, and feeds each answer's busiest-stage compute back: to the
prefill cost fit for such steps, to the decode figure (``decode_ms``) for the others, and
to the allowance of prompt tokens of each decoding group whose step carried prompts. It
knows the executor's shape (its stages, whether their steps overlap, whether they share
cores), but holds no executor and no sessions: the scheduler asks it for chunks, telling
it whether streams are decoding beside the prompt, and tells it what happened.
"""

from __future__ import annotations

from collections.abc import Sequence

from zctl.engine.prefill import (
    MODELLED_PROMPT,
    FusedChunkBudget,
    PrefillCost,
    StepCostModel,
    fair_chunk,
    lone_chunk,
)
from zctl.engine.sessions import DecodeSession

DECODE_MS_PRIOR = 10.0  # a decode step's busiest-stage ms until one is measured
DECODE_EWMA = 0.2  # weight of the newest decode step in ``decode_ms``


class PrefillPlanner:
    """Chunks for prompts, from the steps' measured costs (see the module docstring), on
    ``num_stages`` stages whose steps overlap (``overlaps``: a stage computes a step while
    the next computes the one before) on cores of their own (unless ``shared_cores``)."""

    def __init__(self, prior: StepCostModel, num_stages: int = 1, overlaps: bool = False,
                 shared_cores: bool = False) -> None:
        self.cost = PrefillCost(prior)
        self.num_stages, self.overlaps = num_stages, overlaps
        # stages a lone prompt's chunks go through one after another (1: they take turns)
        self._pipelined_stages = num_stages if overlaps and not shared_cores else 1
        self.decode_ms = 0.0  # recent decode steps' busiest-stage compute (EWMA)
        self._steps: dict[int, list[tuple[int, int]]] = {}  # request id -> rows (tokens, past)
        self._fused: dict[int, tuple[int, int]] = {}  # request id -> (group id, prompt
        # tokens) of a group step that carried prompts
        self._budgets: dict[int, FusedChunkBudget] = {}  # group id -> its steps' allowance

    def depth(self, beside_decoders: bool) -> int:
        """Prefill steps of one prompt in flight at once: enough to keep every stage busy
        (where steps overlap), one beside streams that are decoding."""
        return self.num_stages if self.overlaps and not beside_decoders else 1

    def chunk(self, session: DecodeSession, beside_decoders: bool) -> int:
        """The next chunk of ``session``'s prompt stepped on its own: beside streams that
        are decoding, one that costs about one of their steps; alone, the chunking that
        gets its first token soonest through the stages (pipelined where they overlap on
        cores of their own; else they take turns)."""
        cost, past = self.cost.model, session.prefill_position
        if beside_decoders:
            chunk = fair_chunk(self.decode_ms or DECODE_MS_PRIOR, past, cost,
                               left=session.prefill_left)
        else:
            chunk = lone_chunk(session.prefill_left, past, self._pipelined_stages, cost)
        return min(chunk, session.max_prefill_chunk)

    def fused_chunks(self, group_id: int, sessions: Sequence[DecodeSession]) -> list[int]:
        """The chunks of the prompts ``sessions`` in one step of decoding group
        ``group_id``. A prompt of at most ``MODELLED_PROMPT`` tokens: the cost model's chunk
        (at most ``SHORT_PREFILL`` goes whole), whose rows it prices well enough. A longer
        one, whose rows over a long past it under-prices: the group's measured allowance
        of prompt tokens, first come first served (each prompt at least one token)."""
        allowance = self._budgets.setdefault(group_id, FusedChunkBudget()).tokens
        decode_ms = self.decode_ms or DECODE_MS_PRIOR
        chunks = []
        for session in sessions:
            past, left = session.prefill_position, session.prefill_left
            if past + left <= MODELLED_PROMPT:
                chunk = fair_chunk(decode_ms, past, self.cost.model, left=left, fused=True)
            else:
                chunk = max(1, min(allowance, left))
                allowance = max(0, allowance - chunk)
            chunks.append(min(chunk, session.max_prefill_chunk))
        return chunks

    def note_step(self, request_id: int, rows: list[tuple[int, int]],
                  group: tuple[int, int] | None = None) -> None:
        """A step carrying a prompt's chunk went out: its rows' (tokens, past), and for a
        decoding group's step (group id, the prompt tokens it carried)."""
        self._steps[request_id] = rows
        if group is not None:
            self._fused[request_id] = group

    def note_answer(self, request_id: int, stage_ms: Sequence[float]) -> None:
        """A step's answer came back, with each stage's compute."""
        busiest = max(stage_ms, default=0.0)
        rows = self._steps.pop(request_id, None)
        group_id, tokens = self._fused.pop(request_id, (None, 0))
        budget = self._budgets.get(group_id) if group_id is not None else None
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

    @property
    def notes(self) -> int:
        """Steps it holds figures for (none once every step is answered or forgotten)."""
        return len(self._steps) + len(self._fused)
