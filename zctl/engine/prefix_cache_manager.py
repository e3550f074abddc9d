"""The prefix cache as the scheduler runs it: what ``zctl.engine.prefix_index`` decides,
applied to the stages through the ``Executor``.

A new session loads the KV of the longest cached start of its prompt (a stored entry,
moved when the new stream covers all of it, else copied; or a running stream's prompt,
copied out); a finished one leaves its KV as an entry; entries are evicted to the budget
or for streams' room. The index starts empty whenever the executor was rewired.
"""

from __future__ import annotations

import logging

from zctl.engine.executor import Executor
from zctl.engine.prefill import SHORT_PREFILL
from zctl.engine.prefill_pieces import ANYWHERE, PieceRule
from zctl.engine.prefix_index import PrefixIndex, PrefixIndexStats
from zctl.engine.sessions import DecodeSession

log = logging.getLogger("zctl.engine.scheduler")


class PrefixCacheManager:
    """The prefix entries the stages hold for one scheduler, and the index of them
    (``index``; None when the cache is off: no ``budget_tokens``, or stages that keep no
    prefix entries, and then every call does nothing)."""

    def __init__(self, executor: Executor, budget_tokens: int,
                 stats: PrefixIndexStats | None = None, pieces: PieceRule = ANYWHERE) -> None:
        self.executor = executor
        # where prefills are cut (zctl.engine.prefill_pieces): hits end where a cold
        # prefill may cut, and (when on) an entry keeps only what a prefill computed
        self.pieces = pieces
        self.index: PrefixIndex | None = None
        self._wirings = executor.wirings  # the executor's count when the index was started
        if budget_tokens > 0 and executor.prefix_cache_supported:
            self.index = PrefixIndex(budget_tokens, stats=stats)
            self.clear()  # a fresh index: what the stages hold is nobody's

    @property
    def cached_tokens(self) -> int:
        """Tokens of KV the stored entries hold (what the budget bounds)."""
        return self.index.tokens if self.index is not None else 0

    def clear(self) -> None:
        """Forget every cached prefix, here and on the stages."""
        if self.index is not None:
            self.index.clear()
        try:
            self.executor.drop_all_prefixes()
        except Exception as exc:  # noqa: BLE001 - the stages are down: nothing to free
            log.debug("could not clear the stages' prefix entries: %s", exc)

    def load(self, session: DecodeSession, fused: bool) -> None:
        """Give a new session the KV of the longest cached start of its prompt. ``fused``:
        the prompt would ride in decoding streams' steps from its first chunk (ragged rows
        beside streams that are decoding), but one that loads a cached prefix takes its
        first step alone (a stage without the entry then fails that step, not the group's),
        which costs the decoding streams a step: a prefix of under ``SHORT_PREFILL``
        tokens saves less, and is not loaded."""
        index = self.index
        if index is None or session.restarts or session.prefill_position or \
                session.prompt_logprobs is not None:  # (its prompt is scored: all of it runs)
            return
        wirings = self.executor.wirings
        if wirings != self._wirings:  # rewired or abandoned: later stages lost their entries
            self._wirings = wirings
            self.clear()
        hit = index.lookup(session.prompt, SHORT_PREFILL if fused else None, self.pieces,
                           session.long_rope)
        if hit is None:
            return
        entry, executor, sid = hit.entry, self.executor, session.stream_id
        try:
            if entry.live:  # copied out of the running stream, then moved in
                assert entry.stream_id is not None
                scratch = index.new_id()
                executor.save_prefix(entry.stream_id, scratch, hit.length)
                executor.load_prefix(sid, scratch, hit.length, take=True)
            else:  # the new stream will cover the whole entry: take it, else copy
                take = hit.length == entry.tokens.size
                executor.load_prefix(sid, entry.entry_id, hit.length, take=take)
                if take:
                    index.remove(entry.entry_id)
        except Exception as exc:  # noqa: BLE001 - prefill it all instead
            log.warning("stream %s: the cached prefix could not be loaded (%s); "
                        "prefilling the whole prompt", sid, exc)
            index.remove(entry.entry_id)
            index.stats.hits -= 1
            index.stats.tokens_saved -= hit.length
            executor.reset(sid, session.long_rope)
            return
        session.skip_prefix(hit.length)

    def track(self, session: DecodeSession) -> None:
        """The session's prompt is in its KV now: offer it as a live source."""
        if self.index is not None:
            self.index.track_live(session.stream_id, session.prompt, session.long_rope)

    def untrack(self, stream_id: int) -> None:
        """The stream's KV is no source any more (it ended, or was cancelled)."""
        if self.index is not None:
            self.index.untrack_live(stream_id)

    def evict(self, limit: int) -> None:
        """Free cached prefixes, least recently used first, until they hold at most
        ``limit`` tokens of KV (room for streams' KV: admission)."""
        index = self.index
        if index is None or index.tokens <= limit:
            return
        for entry in index.evict(index.budget_tokens - max(0, limit)):
            try:
                self.executor.drop_prefix(entry.entry_id)
            except Exception as exc:  # noqa: BLE001 - a broken executor frees them anyway
                log.debug("could not drop prefix entry %s: %s", entry.entry_id, exc)

    def save(self, session: DecodeSession, alone: bool) -> None:
        """Keep a finished session's KV on the stages as a prefix entry (``alone``: it
        steps outside the row groups, so its own KV becomes the entry, without a copy)."""
        index = self.index
        if index is None:
            return
        index.untrack_live(session.stream_id)
        tokens = session.kv_history
        if self.pieces.on:  # decode steps wrote the rest one token at a time
            tokens = tokens[:session.prompt.size]
        if session.error is not None or len(tokens) < index.min_hit:
            return
        entry, dropped = index.store(tokens, session.long_rope)
        executor = self.executor
        try:
            for old in dropped:
                if old is not entry:
                    executor.drop_prefix(old.entry_id)
            if entry not in dropped:
                executor.save_prefix(session.stream_id, entry.entry_id, len(tokens), take=alone)
        except Exception as exc:  # noqa: BLE001 - the executor broke: the next reset starts over
            log.debug("stream %s: its prefix was not kept: %s", session.stream_id, exc)
            index.remove(entry.entry_id)
