"""The live cluster view (``GET /zctl/cluster/stream``, docs/web.md): one poller of the
generation service's stats, once a second while anyone watches, whose views every
watcher shares (a view is computed once however many watch), with the latency and tok/s
over the last WINDOW_S seconds and the cluster's timeline of events.

Each watcher reads views as Server-Sent Events (``event: cluster``); one that reads
slowly skips to the newest view rather than queueing old ones. While the service does
not answer, views say so (``error``) and the poller keeps trying.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from zctl.serve.encoding import named_event
from zctl.service.cluster_view import VIEW_VERSION, cluster_view
from zctl.service.errors import ServiceUnavailable
from zctl.service.messages import ServiceStats
from zctl.service.timeline import Timeline

INTERVAL_S = 1.0  # between views
WINDOW_S = 5.0  # latency percentiles and tok/s are over about this many seconds
RETRY_MS = 2000  # an EventSource reconnects after this long

log = logging.getLogger(__name__)


class ClusterFeed:
    """Views of the cluster ``fetch`` (the service's stats) describes, shared by watchers."""

    def __init__(self, fetch: Callable[[], Awaitable[ServiceStats]],
                 interval_s: float = INTERVAL_S, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fetch, self.interval_s, self.window_s, self.clock = fetch, interval_s, window_s, clock
        self.timeline = Timeline()
        self._history: deque[tuple[float, ServiceStats]] = deque()
        self._watchers: set[asyncio.Queue[dict[str, Any]]] = set()
        self._poller: asyncio.Task[None] | None = None
        self.latest: dict[str, Any] | None = None

    async def view(self) -> dict[str, Any]:
        """A view made now (kept in the history, as a poll's)."""
        try:
            stats = await self.fetch()
        except ServiceUnavailable as exc:
            return self._error_view(f"the generation service does not answer: {exc}")
        now = self.clock()
        if stats.cluster is not None:
            self.timeline.feed(stats.cluster)
        before = self._earliest(now)
        self._history.append((now, stats))
        view = cluster_view(stats, before[1] if before else None,
                            now - before[0] if before else 0.0)
        view["events"] = self.timeline.recent()
        self.latest = view
        return view

    def _error_view(self, error: str) -> dict[str, Any]:
        """A view that says why there is no cluster to show, with the timeline so far."""
        return {"version": VIEW_VERSION, "error": error, "events": self.timeline.recent()}

    def _earliest(self, now: float) -> tuple[float, ServiceStats] | None:
        """The oldest snapshot within the window (older ones are dropped)."""
        while len(self._history) > 1 and now - self._history[1][0] >= self.window_s:
            self._history.popleft()
        return self._history[0] if self._history else None

    async def _poll(self) -> None:
        while self._watchers:
            try:
                view = await self.view()
            except Exception as exc:  # noqa: BLE001 - a view must never stop the feed
                log.exception("could not make the cluster view")
                view = self._error_view(
                    f"the cluster view failed: {type(exc).__name__}: {exc}")
            for queue in self._watchers:
                if queue.full():
                    queue.get_nowait()  # a slow reader gets the newest view
                queue.put_nowait(view)
            await asyncio.sleep(self.interval_s)
        self._poller = None

    async def views(self) -> AsyncIterator[dict[str, Any]]:
        """Views as they are made (the latest first, when others watch already), for as
        long as this is read."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=1)
        self._watchers.add(queue)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.ensure_future(self._poll())
        elif self.latest is not None:
            queue.put_nowait(self.latest)
        try:
            while True:
                yield await queue.get()
        finally:
            self._watchers.discard(queue)
            if not self._watchers and self._poller is not None:
                self._poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._poller
                self._poller = None

    async def events(self) -> AsyncIterator[str]:
        """The views as an SSE stream (its first line says how soon to reconnect)."""
        yield f"retry: {RETRY_MS}\n\n"
        async with contextlib.aclosing(self.views()) as views:
            async for view in views:
                yield named_event("cluster", view)
