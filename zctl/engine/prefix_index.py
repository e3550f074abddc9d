"""The prefix cache's index (pure: no executor): which token prefixes the stages hold KV for.

A finished stream's KV (its prompt and answer) is kept on every stage as a *prefix entry*;
a running stream's prompt is a *live* source. A new prompt that starts with tokens of
either reuses their KV and prefills only the rest. Entries are found by chained hashes of
``block``-token blocks (as vLLM's prefix caching does), the match is then extended token
by token, bounded by a budget of tokens (the stages' memory budget over the KV bytes a
token takes on the fullest stage) and evicted least recently used. The engine's
scheduler applies what this index decides to the stages (``Executor.save_prefix`` ...).
An entry keeps the LongRoPE set its keys were turned with (``long_rope``: those of a
sequence long throughout, zctl.engine.long_rope): a prompt of the other set finds no hit
there (it prefills those tokens itself), so keys turned one way never serve the other.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from zctl.engine.prefill_pieces import ANYWHERE, PieceRule

BLOCK_TOKENS = 16
MIN_HIT_TOKENS = 16  # a shorter match is not worth the frames and the copy


def block_hashes(tokens: Sequence[int] | np.ndarray, block: int = BLOCK_TOKENS) -> list[int]:
    """One hash per full ``block`` of tokens, each chained to the blocks before it."""
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
    hashes, parent = [], 0
    for start in range(0, ids.size - block + 1, block):
        parent = hash((parent, ids[start:start + block].tobytes()))
        hashes.append(parent)
    return hashes


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two id arrays share."""
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


@dataclass(eq=False)  # entries are compared by identity: their tokens are arrays
class CachedPrefix:
    """An entry of the index: tokens whose KV the stages hold, as their prefix entry
    ``entry_id`` (``stream_id`` None), or as a running stream's own KV (``stream_id``: a
    live source, not charged to the budget); ``long_rope``: its keys were turned with
    LongRoPE's long set throughout (its sequence's prompt passed the threshold)."""

    entry_id: int
    tokens: np.ndarray
    stream_id: int | None = None
    hashes: list[int] = field(default_factory=list)
    long_rope: bool = False

    @property
    def live(self) -> bool:
        return self.stream_id is not None


@dataclass(frozen=True)
class PrefixHit:
    """A new prompt's first ``length`` tokens are ``entry``'s."""

    entry: CachedPrefix
    length: int


@dataclass
class PrefixIndexStats:
    """Cumulative figures of the prefix cache's index (shown in the metrics)."""

    lookups: int = 0
    hits: int = 0
    tokens_saved: int = 0  # prompt tokens not prefilled thanks to a hit
    evictions: int = 0
    saved: int = 0  # entries stored


class PrefixIndex:
    """Entries by id, least recently used first, within ``budget_tokens`` (stored entries
    only: a live source's KV is its stream's)."""

    def __init__(self, budget_tokens: int, block: int = BLOCK_TOKENS,
                 min_hit: int = MIN_HIT_TOKENS, stats: PrefixIndexStats | None = None) -> None:
        if budget_tokens < 0 or block < 1:
            raise ValueError("the prefix cache needs budget_tokens >= 0 and block >= 1")
        self.budget_tokens, self.block, self.min_hit = budget_tokens, block, max(1, min_hit)
        self._entries: OrderedDict[int, CachedPrefix] = OrderedDict()  # LRU first
        self._by_hash: dict[int, set[int]] = {}
        self._live: dict[int, int] = {}  # stream id -> its live entry id
        self._next_id = 1
        self.stats = stats if stats is not None else PrefixIndexStats()  # may outlive the index

    @property
    def tokens(self) -> int:
        """Tokens held by stored entries (what the budget bounds)."""
        return sum(e.tokens.size for e in self._entries.values() if not e.live)

    def entries(self) -> list[CachedPrefix]:
        return list(self._entries.values())

    def lookup(self, prompt: Sequence[int] | np.ndarray, min_hit: int | None = None,
               pieces: PieceRule = ANYWHERE, long_rope: bool = False) -> PrefixHit | None:
        """The longest cached start of ``prompt`` (at most all but its last token, whose
        logits the prefill must compute; with ``pieces`` on, up to where they may cut) among
        the entries of its LongRoPE set (``long_rope``), or None below ``min_hit`` tokens
        (None: the cache's own)."""
        ids = np.asarray(prompt, dtype=np.int64).reshape(-1)
        self.stats.lookups += 1
        best: PrefixHit | None = None
        candidates: set[int] = set()
        for h in block_hashes(ids[:max(0, ids.size - 1)], self.block):
            found = self._by_hash.get(h)
            if not found:
                break
            candidates = found
        for entry_id in candidates:
            entry = self._entries[entry_id]
            if entry.long_rope != long_rope:  # keys turned with the other set
                continue
            length = pieces.usable_prefix(common_prefix(entry.tokens, ids), ids.size)
            if best is None or length > best.length or (
                    length == best.length and best.entry.live and not entry.live):
                best = PrefixHit(entry, length)
        if best is None or best.length < max(self.min_hit, min_hit or 0):
            return None
        self._entries.move_to_end(best.entry.entry_id)
        self.stats.hits += 1
        self.stats.tokens_saved += best.length
        return best

    def store(self, tokens: Sequence[int] | np.ndarray, long_rope: bool = False
              ) -> tuple[CachedPrefix, list[CachedPrefix]]:
        """Record a stored entry of ``tokens`` whose keys turned with LongRoPE's long set
        throughout or not (``long_rope``; most recently used); returns it and the entries to
        drop from the stages: those of its set it covers (a prefix of its tokens) and the
        least recently used beyond the budget. An entry larger than the budget is dropped
        itself (returned in the list)."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1).copy()
        entry = self._add(CachedPrefix(self.new_id(), ids, long_rope=long_rope))
        self.stats.saved += 1
        dropped = [e for e in self.entries() if not e.live and e is not entry
                   and e.long_rope == long_rope
                   and e.tokens.size <= ids.size and common_prefix(e.tokens, ids) == e.tokens.size]
        for old in dropped:
            self.remove(old.entry_id)
        return entry, dropped + self.evict(0)

    def track_live(self, stream_id: int, tokens: Sequence[int] | np.ndarray,
                   long_rope: bool = False) -> CachedPrefix:
        """A running stream's KV holds ``tokens`` (turned with LongRoPE's long set
        throughout: ``long_rope``): offer them as a source."""
        self.untrack_live(stream_id)
        entry = self._add(CachedPrefix(self.new_id(), np.asarray(tokens, dtype=np.int64)
                                      .reshape(-1).copy(), stream_id=stream_id,
                                      long_rope=long_rope))
        self._live[stream_id] = entry.entry_id
        return entry

    def untrack_live(self, stream_id: int) -> None:
        entry_id = self._live.pop(stream_id, None)
        if entry_id is not None:
            self.remove(entry_id)

    def evict(self, room: int) -> list[CachedPrefix]:
        """Drop least recently used stored entries until ``room`` more tokens fit the
        budget; returns them (for the stages to free)."""
        dropped = []
        held = self.tokens
        for entry in self.entries():
            if held + room <= self.budget_tokens:
                break
            if entry.live:
                continue
            self.remove(entry.entry_id)
            held -= entry.tokens.size
            dropped.append(entry)
            self.stats.evictions += 1
        return dropped

    def remove(self, entry_id: int) -> CachedPrefix | None:
        entry = self._entries.pop(entry_id, None)
        if entry is None:
            return None
        for h in entry.hashes:
            ids = self._by_hash.get(h)
            if ids is not None:
                ids.discard(entry_id)
                if not ids:
                    del self._by_hash[h]
        if entry.live and self._live.get(entry.stream_id) == entry_id:  # type: ignore[arg-type]
            del self._live[entry.stream_id]  # type: ignore[arg-type]
        return entry

    def clear(self) -> list[CachedPrefix]:
        """Forget every entry (the stages lost them); returns the stored ones."""
        stored = [e for e in self.entries() if not e.live]
        self._entries.clear()
        self._by_hash.clear()
        self._live.clear()
        return stored

    def new_id(self) -> int:
        """An entry id never handed out before (for a scratch entry too)."""
        entry_id, self._next_id = self._next_id, self._next_id + 1
        return entry_id

    def _add(self, entry: CachedPrefix) -> CachedPrefix:
        entry.hashes = block_hashes(entry.tokens, self.block)
        self._entries[entry.entry_id] = entry
        for h in entry.hashes:
            self._by_hash.setdefault(h, set()).add(entry.entry_id)
        return entry
