"""The web page's routes on a server over an in-process two-stage chain: the page and its
files, the cluster view as JSON and as an SSE stream at least once a second with figures
that follow a generation, and the key they ask for."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.zctl.serve import test_app as ts
from zctl.serve.settings import ServeSettings

tiny, server, started = ts.tiny, ts.server, ts.started  # the API's fixtures, shared


def cluster_events(url: str, count: int, headers: dict | None = None) -> list[dict]:
    """The first ``count`` views of the stream."""
    views = []
    with httpx.stream("GET", f"{url}/zctl/cluster/stream", headers=headers, timeout=10) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                views.append(json.loads(line.removeprefix("data: ")))
                if len(views) == count:
                    break
    return views


def test_the_page_and_its_files_are_served_from_the_package(server) -> None:
    page = httpx.get(f"{server.url}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<title>zctl</title>" in page.text
    for bad in ("/web/nothing.js", "/web/../routes.py", "/web/%2e%2e/routes.py", "/web/",
                "/web/vendor"):
        assert httpx.get(f"{server.url}{bad}", timeout=10).status_code == 404, bad


def test_the_pages_files_are_asked_for_again_and_answer_not_modified(server) -> None:
    for path in ("/", "/web/cluster.js"):
        first = httpx.get(f"{server.url}{path}", timeout=10)
        assert first.status_code == 200 and first.headers["cache-control"] == "no-cache"
        etag, modified = first.headers["etag"], first.headers["last-modified"]
        for asked in ({"If-None-Match": etag}, {"If-Modified-Since": modified}):
            again = httpx.get(f"{server.url}{path}", headers=asked, timeout=10)
            assert again.status_code == 304 and again.content == b"", (path, asked)
            assert again.headers["cache-control"] == "no-cache"
        changed = httpx.get(f"{server.url}{path}", headers={"If-None-Match": '"other"'},
                            timeout=10)
        assert changed.status_code == 200 and changed.content == first.content


def test_the_cluster_view_streams_every_second_and_follows_a_generation(server) -> None:
    snapshot = httpx.get(f"{server.url}/zctl/cluster", timeout=10).json()
    assert snapshot["version"] == 1 and len(snapshot["stages"]) == 2
    body = {"model": ts.MODEL, "prompt": "count", "max_tokens": 40, "temperature": 0,
            "zctl": {"ignore_eos": True}}
    generation = threading.Thread(target=lambda: httpx.post(
        f"{server.url}/v1/completions", json=body, timeout=60))
    start = time.monotonic()
    generation.start()
    views = cluster_events(server.url, 3)
    generation.join()
    assert time.monotonic() - start < 3 * 1.0 + 2.0  # once a second (and a margin)
    counts = [v["stages"][0]["compute_ms"]["count"] for v in views]
    assert counts[-1] > 0, views[-1]  # steps in the window
    assert any(v["tok_s"] for v in views[1:])
    after = httpx.get(f"{server.url}/zctl/cluster", timeout=10).json()["counters"]
    assert after["generated_tokens"] - snapshot["counters"]["generated_tokens"] == 40


def test_with_a_key_the_cluster_view_asks_for_it_and_the_page_does_not(started) -> None:
    srv = started(ServeSettings(api_key="sesame"))
    assert httpx.get(f"{srv.url}/", timeout=10).status_code == 200
    assert httpx.get(f"{srv.url}/zctl/cluster", timeout=10).status_code == 401
    with httpx.stream("GET", f"{srv.url}/zctl/cluster/stream", timeout=10) as resp:
        assert resp.status_code == 401
        assert json.loads(resp.read())["error"]["code"] == "invalid_api_key"
    views = cluster_events(srv.url, 1, {"Authorization": "Bearer sesame"})
    assert views[0]["model"] == ts.MODEL
