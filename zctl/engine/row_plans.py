"""How the plans of a row group's sessions become one step (pure).

A row group steps all its members in one inference per stage. On stateful stages its
rows share one token count: ``padded_rows`` pads the shorter plans (a plain one-token row
beside a speculative one) with slots the next step rewinds. On paged stages every row is
a sequence of its own, so ``ragged_rows`` lays the rows' tokens one after the other: a
decoding row's token and a prompt's prefill chunk ride in the same inference (split-fuse),
and nothing is padded. Either way a ``RowsPlan`` holds the group's ``Step`` and says
which of the reply's answers each row takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from zctl.engine.executor import Step
from zctl.engine.payloads import merge_wants


@dataclass(frozen=True)
class RowsPlan:
    """One step of a row group: the group's ``step`` (its ``row_tokens`` each row's token
    count when the rows are ragged; None: they share one), each row's slice of the reply's
    answers (lo, hi), and the padding each row's step leaves (rewound with its next step)."""

    step: Step
    answers: list[tuple[int, int]]
    pads: list[int]

    def shapes(self) -> list[tuple[int, int]]:
        """Each row's (tokens, past: the KV it holds before the step), for the prefill cost
        model of a step that carries a prompt's chunk."""
        positions, row_tokens = self.step.positions, self.step.row_tokens
        if row_tokens is None:
            tokens = positions.shape[-1]
            return [(tokens - pad, int(p)) for pad, p in zip(
                self.pads, positions.reshape(len(self.pads), -1)[:, 0], strict=True)]
        flat = positions.reshape(-1)
        starts = np.cumsum([0, *row_tokens[:-1]])
        return [(int(n), int(flat[start])) for n, start in zip(row_tokens, starts, strict=True)]


def padded_rows(group_id: int, plans: Sequence[Step], pads_before: Sequence[int]) -> RowsPlan:
    """Row group ``group_id``'s step: its rows' steps ``plans`` padded to the longest;
    ``pads_before``: each row's padding from its last step, rewound now with the row's own
    rewind. Every position is answered when a row feeds several tokens (a row takes its
    real ones), else the last."""
    lens = [len(p.token_ids) for p in plans]
    tokens = max(lens)
    ids = np.empty((len(plans), tokens), dtype=np.int64)
    positions = np.empty((len(plans), tokens), dtype=np.int64)
    rewinds = np.empty(len(plans), dtype=np.int64)
    for row, (plan, n, pad) in enumerate(zip(plans, lens, pads_before, strict=True)):
        ids[row, :n] = plan.token_ids
        ids[row, n:] = plan.token_ids[-1]  # padding: masked by the next step's rewind
        positions[row] = plan.positions[0] + np.arange(tokens)
        rewinds[row] = int(plan.mask_tail) + pad
    per_row = tokens if tokens > 1 else 1
    answers = [(row * per_row, row * per_row + (n if per_row > 1 else 1))
               for row, n in enumerate(lens)]
    step = Step(group_id, ids, positions, np.arange(tokens) if tokens > 1 else None,
                merge_wants(p.want_logits for p in plans), rewinds,
                one_query=one_query_rows(plans))
    return RowsPlan(step, answers, [tokens - n for n in lens])


def ragged_rows(group_id: int, plans: Sequence[Step]) -> RowsPlan:
    """Row group ``group_id``'s step: its rows' tokens one after the other, each row
    answered where its step asks (its last token by default): ``logits_idx`` indexes the
    whole step, or is None when every row asks only for its last token."""
    lens = [len(p.token_ids) for p in plans]
    starts = np.cumsum([0, *lens[:-1]])
    wanted = [start + (np.asarray(p.logits_idx, dtype=np.int64) if p.logits_idx is not None
                       else np.array([n - 1], dtype=np.int64))
              for p, n, start in zip(plans, lens, starts, strict=True)]
    every_last = all(p.logits_idx is None for p in plans)
    bounds = np.cumsum([0, *(w.size for w in wanted)])
    answers = [(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    step = Step(group_id,
                np.concatenate([np.asarray(p.token_ids, dtype=np.int64) for p in plans]),
                np.concatenate([np.asarray(p.positions, dtype=np.int64) for p in plans]),
                None if every_last else np.concatenate(wanted),
                merge_wants(p.want_logits for p in plans),
                np.array([int(p.mask_tail) for p in plans], dtype=np.int64),
                np.array(lens, dtype=np.int64), one_query=one_query_rows(plans))
    return RowsPlan(step, answers, [0] * len(plans))


def one_query_rows(plans: Sequence[Step]) -> bool:
    """Whether the rows' step is a one-query step: one of them is, and none feeds several
    tokens to be computed together (a prompt's piece); ValueError if one does (the
    scheduler keeps such rows to one token a step beside a prompt's piece)."""
    if not any(p.one_query for p in plans):
        return False
    together = [i for i, p in enumerate(plans) if not p.one_query and len(p.token_ids) > 1]
    if together:
        raise ValueError(f"rows {together} feed several tokens computed together: they cannot "
                         "share a one-query step")
    return True
