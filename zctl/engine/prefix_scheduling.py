"""The scheduler's use of the prefix cache (a mixin of ``zctl.engine.scheduler.StreamScheduler``):
what ``zctl.engine.prefix_index`` decides, applied to the stages through the ``Executor``.

A new session loads the KV of the longest cached start of its prompt (a stored entry,
moved when the new stream covers all of it, else copied; or a running stream's prompt,
copied out); a finished one leaves its KV as an entry; entries are evicted to the budget
or for streams' room. The index starts empty whenever the pipeline was rewired, and a
session whose cached prefix failed to load on a later stage is prefilled in full.
"""

from __future__ import annotations

import logging

from zctl.engine.executor import Executor
from zctl.engine.prefill_planner import PrefillPlanner
from zctl.engine.prefix_index import PrefixCache
from zctl.engine.sessions import DecodeSession

log = logging.getLogger("zctl.engine.scheduler")


class PrefixScheduling:
    """``StreamScheduler``'s prefix-cache steps (a mixin)."""

    pipeline: Executor
    cache: PrefixCache | None
    sessions: dict[int, DecodeSession]
    _in_flight: dict[int, list[DecodeSession]]
    prefill: PrefillPlanner
    _wirings: int

    def _clear_prefixes(self) -> None:
        """Forget every cached prefix, here and on the stages."""
        if self.cache is not None:
            self.cache.clear()
        try:
            self.pipeline.drop_all_prefixes()
        except Exception as exc:  # noqa: BLE001 - the stages are down: nothing to free
            log.debug("could not clear the stages' prefix entries: %s", exc)

    def _load_cached_prefix(self, session: DecodeSession, min_hit: int | None = None) -> None:
        """Give a new session the KV of the longest cached start of its prompt (of at least
        ``min_hit`` tokens; None: the cache's own least)."""
        cache = self.cache
        if cache is None or session.restarts or session.prefill_position or \
                session.prompt_logprobs is not None:  # (its prompt is scored: all of it runs)
            return
        wirings = self.pipeline.wirings
        if wirings != self._wirings:  # rewired or abandoned: later stages lost their entries
            self._wirings = wirings
            self._clear_prefixes()
        hit = cache.lookup(session.prompt, min_hit)
        if hit is None:
            return
        entry, pipe, sid = hit.entry, self.pipeline, session.stream_id
        try:
            if entry.live:  # copied out of the running stream, then moved in
                assert entry.stream_id is not None
                scratch = cache.new_id()
                pipe.save_prefix(entry.stream_id, scratch, hit.length)
                pipe.load_prefix(sid, scratch, hit.length, take=True)
            else:  # the new stream will cover the whole entry: take it, else copy
                take = hit.length == entry.tokens.size
                pipe.load_prefix(sid, entry.entry_id, hit.length, take=take)
                if take:
                    cache.remove(entry.entry_id)
        except Exception as exc:  # noqa: BLE001 - prefill it all instead
            log.warning("stream %s: the cached prefix could not be loaded (%s); "
                        "prefilling the whole prompt", sid, exc)
            cache.remove(entry.entry_id)
            cache.stats.hits -= 1
            cache.stats.tokens_saved -= hit.length
            pipe.reset(sid)
            return
        session.skip_prefix(hit.length)

    def _prefill_again(self, session: DecodeSession) -> bool:
        """Restart a session whose cached prefix may be what failed, from no cache."""
        if not session.cached_tokens or session.emitted or session.done:
            return False
        log.warning("stream %s: a step after loading its cached prefix failed; prefilling "
                    "its whole prompt (the prefix cache starts empty)", session.stream_id)
        for rid in [r for r, ss in self._in_flight.items() if session in ss]:
            del self._in_flight[rid]
            self.prefill.forget_step(rid)
        self._clear_prefixes()
        try:
            self.pipeline.reset(session.stream_id)
        except Exception:  # noqa: BLE001 - the pipeline is broken: fail it after all
            return False
        session.restart()
        return True

    def evict_prefixes(self, limit: int) -> None:
        """Free cached prefixes, least recently used first, until they hold at most
        ``limit`` tokens of KV (room for streams' KV: admission)."""
        if self.cache is None or self.cache.tokens <= limit:
            return
        for entry in self.cache.evict(self.cache.budget_tokens - max(0, limit)):
            try:
                self.pipeline.drop_prefix(entry.entry_id)
            except Exception as exc:  # noqa: BLE001 - a broken pipeline frees them anyway
                log.debug("could not drop prefix entry %s: %s", entry.entry_id, exc)

    def _save_prefix(self, session: DecodeSession, alone: bool) -> None:
        """Keep a finished session's KV on the stages as a prefix entry (``alone``: it
        steps outside the row groups, so its own KV becomes the entry, without a copy)."""
        cache = self.cache
        if cache is None:
            return
        cache.untrack_live(session.stream_id)
        tokens = session.kv_history
        if session.error is not None or len(tokens) < cache.min_hit:
            return
        entry, dropped = cache.store(tokens)
        pipe = self.pipeline
        try:
            for old in dropped:
                if old is not entry:
                    pipe.drop_prefix(old.entry_id)
            if entry not in dropped:
                pipe.save_prefix(session.stream_id, entry.entry_id, len(tokens), take=alone)
        except Exception as exc:  # noqa: BLE001 - the pipeline broke: the next reset starts over
            log.debug("stream %s: its prefix was not kept: %s", session.stream_id, exc)
            cache.remove(entry.entry_id)
