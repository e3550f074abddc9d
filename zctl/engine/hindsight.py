"""Adaptive K by hindsight: the fixed draft length that would have been fastest lately.

A drafter that is a cheap, deterministic function of the history (prompt lookup) can be
asked, after the fact, what it would have proposed at each position the stream passed,
and the stream's own tokens say how much of that draft was right. Every emitted token is
then a sample, whatever K the stream used there: K = 0 steps learn as much as drafted
ones, so no probe steps are needed and K cannot stay stuck at 0 after a few early misses.

``DraftHindsight`` records, per position, the match length of a ``k_max``-token draft
(``NO_DRAFT`` where the drafter had none; a draft not yet refuted counts in full).
``walk_ms_per_token`` replays the recent positions under "always draft K" with the
step-cost model (``zctl.engine.drafting.StepCost``: a step, each extra token fed, each change
of step width), and ``best_fixed_k`` picks the K whose replay was fastest. Lookup drafts
hit in runs (the output copies the prompt for a while, or it does not), which a per-token
geometric acceptance misjudges; a replay of the real runs does not, and it charges the
width changes where the runs really start and end.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from zctl.engine.drafting import Drafter, StepCost, accept_prefix

NO_DRAFT = -1  # a position where the drafter had nothing to propose
HINDSIGHT_WINDOW = 64  # positions the replay covers
MIN_SAMPLES = 4  # ... and how many it needs before adaptive K trusts it


def walk_ms_per_token(matches: Sequence[int], k: int, cost: StepCost) -> float:
    """Milliseconds per token of "draft ``k`` wherever there is a draft" over consecutive
    positions whose draft match lengths were ``matches``: each step yields one token plus
    the drafts accepted there (the last step all of its own, though they run past the
    window) and costs ``cost`` for its width, plus a width change when it differs from
    the step before (the first step counted from a 1-token step)."""
    if not matches:
        raise ValueError("no positions to replay")
    i, ms, prev_width = 0, 0.0, 1
    while i < len(matches):
        drafted = k > 0 and matches[i] != NO_DRAFT
        width = k + 1 if drafted else 1
        ms += cost.verify_ms(width - 1) + (cost.switch_ms if width != prev_width else 0.0)
        i += 1 + (min(k, matches[i]) if drafted else 0)
        prev_width = width
    return ms / i


def best_fixed_k(matches: Sequence[int], cost: StepCost, k_max: int, k_min: int = 0,
                 width: int = 1, horizon: int = HINDSIGHT_WINDOW) -> int:
    """The K in ``k_min..k_max`` whose replay over ``matches`` is fastest for the next
    ``horizon`` tokens, a width change now (against the last step's ``width``) counted
    once, so K holds unless a change pays for itself. Ties go to the shorter K."""
    if k_max < k_min:
        raise ValueError(f"k_max {k_max} < k_min {k_min}")
    best, best_ms = k_min, float("inf")
    for k in range(k_min, k_max + 1):
        switch = cost.switch_ms if k + 1 != width else 0.0  # K drafts: a step of K + 1
        ms = walk_ms_per_token(matches, k, cost) * max(horizon, 1) + switch
        if ms < best_ms * (1 - 1e-9):
            best, best_ms = k, ms
    return best


class DraftHindsight:
    """The match length a drafter's ``k_max``-token draft would have had at each position
    of a stream (``matches``: the resolved positions in order, the last ``window``)."""

    def __init__(self, drafter: Drafter, k_max: int, window: int = HINDSIGHT_WINDOW) -> None:
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        self.drafter, self.k_max = drafter, k_max
        self.matches: deque[int] = deque(maxlen=window)
        self._pending: deque[tuple[int, list[int]]] = deque()  # (position, draft), in order
        self._seen: int | None = None  # history length observed so far
        self._open: list[int] = []  # what the pending positions count as (see ``recent``)

    def observe(self, history: Sequence[int]) -> None:
        """Take the history after new tokens were emitted: draft at each new position and
        resolve, in order, the positions whose match is now known (the first call starts)."""
        length = len(history)
        first = length if self._seen is None else self._seen + 1
        for position in range(first, length + 1):
            draft = [int(t) for t in self.drafter.propose(history[:position], self.k_max)]
            self._pending.append((position, draft[:self.k_max]))
        self._seen = length
        lengths = []  # each pending draft's match so far (exact once resolved)
        for position, draft in self._pending:
            known = history[position:position + len(draft)]
            n = accept_prefix(draft[:len(known)], known)
            resolved = not draft or n < len(known) or len(known) == len(draft)
            lengths.append((n if draft else NO_DRAFT, resolved))
        done = 0  # resolved ones leave in order
        while done < len(lengths) and lengths[done][1]:
            self.matches.append(lengths[done][0])
            self._pending.popleft()
            done += 1
        self._open = [n if n == NO_DRAFT or resolved else self.k_max
                      for n, resolved in lengths[done:]]

    @property
    def recent(self) -> list[int]:
        """The window's match lengths, then the positions not yet resolved: one whose draft
        the stream has already refuted counts as far as it matched, one whose draft
        still holds (the current position's among them) as the whole draft. That
        optimism is what lets a copied run be drafted at full length as it starts,
        rather than K creeping up behind it as the run's tokens are confirmed."""
        return [*self.matches, *self._open][-self.matches.maxlen:]

    def ready(self) -> bool:
        return len(self.matches) + len(self._open) >= MIN_SAMPLES

    def reset(self) -> None:
        """Forget the pending drafts (the stream restarts; the samples stay true)."""
        self._pending.clear()
        self._open.clear()
        self._seen = None

