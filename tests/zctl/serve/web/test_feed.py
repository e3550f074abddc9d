"""The live cluster feed (asyncio, a fake service): one poll a second shared by every
watcher, windows of the stats, a service that does not answer and comes back, and a
poller that stops when nobody watches."""

from __future__ import annotations

import asyncio
import contextlib
import json

from tests.zctl.service.test_cluster_view import hist, stats
from zctl.serve.web.feed import ClusterFeed
from zctl.service.errors import ServiceUnavailable


class FakeService:
    def __init__(self) -> None:
        self.asked = 0
        self.down = False

    async def stats(self):
        self.asked += 1
        if self.down:
            raise ServiceUnavailable("gone")
        return stats([hist(self.asked, 0, 0, 0, 0)] * 3, generated=10 * self.asked)


def test_watchers_share_one_poll_and_the_poller_stops_with_the_last() -> None:
    async def main() -> None:
        service = FakeService()
        feed = ClusterFeed(service.stats, interval_s=0.05, window_s=10)
        async with contextlib.aclosing(feed.views()) as a, \
                contextlib.aclosing(feed.views()) as b:
            first_a, first_b = await anext(a), await anext(b)
            assert first_a is first_b  # one view, computed once, for both
            later = await anext(a)
            assert later["tok_s"] is not None and later["tok_s"] > 0
            assert later["stages"][0]["compute_ms"]["count"] >= 1
        await asyncio.sleep(0.15)
        asked = service.asked
        await asyncio.sleep(0.15)
        assert service.asked == asked  # nobody watches: no polls
    asyncio.run(main())


def test_a_service_that_does_not_answer_is_said_and_the_feed_recovers() -> None:
    async def main() -> None:
        service = FakeService()
        feed = ClusterFeed(service.stats, interval_s=0.02)
        async with contextlib.aclosing(feed.views()) as views:
            assert "error" not in await anext(views)
            service.down = True
            down = await anext(views)
            assert "does not answer" in down["error"] and down["events"] == []
            service.down = False
            assert "error" not in await anext(views)
    asyncio.run(main())


def test_a_view_that_fails_is_said_and_the_next_one_made() -> None:
    async def main() -> None:
        service = FakeService()
        broken = {"now": False}

        async def fetch():
            stats = await service.stats()
            return None if broken["now"] else stats  # None: cluster_view cannot read it

        feed = ClusterFeed(fetch, interval_s=0.02)
        async with contextlib.aclosing(feed.views()) as views:
            broken["now"] = True
            view = await anext(views)
            while "error" not in view:
                view = await anext(views)
            assert "the cluster view failed: AttributeError" in view["error"]
            broken["now"] = False
            assert "error" not in await anext(views)
    asyncio.run(main())


def test_the_stream_is_sse_with_a_retry_and_one_json_line_per_view() -> None:
    async def main() -> list[str]:
        feed = ClusterFeed(FakeService().stats, interval_s=0.01)
        async with contextlib.aclosing(feed.events()) as events:
            return [await anext(events) for _ in range(3)]
    retry, *views = asyncio.run(main())
    assert retry == "retry: 2000\n\n"
    for raw in views:
        event, data, end = raw.split("\n", 2)
        assert event == "event: cluster" and end == "\n"
        assert json.loads(data.removeprefix("data: "))["version"] == 1
