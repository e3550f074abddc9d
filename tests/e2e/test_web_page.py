"""The web page and its cluster stream on a real 2-node local cluster of the tiny model,
the page driven in Debian's headless chromium by Playwright: an answer streamed equal to
the API's greedy one, Stop cancelling the generation on every stage, the cluster view
(2 nodes, their layers, figures that follow a generation), a key asked for and kept,
a wrong key, a server restart and a network drop survived with the conversation on
screen, a phone's width and a desktop's (their screenshots saved to docs/images/), and a
node killed mid-answer: the page shows the heal and the answer completes.

One cluster, one browser and one keyed server for the whole module (CI time): the tests
run in order, the node killed last. Without chromium or Playwright they skip, unless
ZCTL_REQUIRE_TOOLS=1 (CI) makes that a failure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from tests.helpers.repo import ROOT
from tests.helpers.tools import missing_tool
from zctl.cli.app import app
from zctl.launcher.local import free_port, stop_processes
from zctl.launcher.record import ClusterRecord, read_record
from zctl.manifest import load_manifest
from zctl.service.client import query_service_stats

runner = CliRunner()
CHROMIUM = "/usr/bin/chromium"
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync"]
IMAGES = ROOT / "docs" / "images"
PROMPT = "the sky is"
KEY = "open-sesame"
DESKTOP, PHONE = {"width": 1280, "height": 800}, {"width": 390, "height": 844}


def need_browser() -> None:
    """Skip (fail with ZCTL_REQUIRE_TOOLS=1) without chromium or Playwright."""
    missing = ("Debian's chromium" if not Path(CHROMIUM).exists() else
               "Playwright for Python" if _no_playwright() else "")
    if missing:
        missing_tool(missing)


def _no_playwright() -> bool:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return True
    return False


def wait_until(cond: Callable[[], object], timeout_s: float = 30.0, what: str = "") -> object:
    end = time.monotonic() + timeout_s
    while not (value := cond()):
        assert time.monotonic() < end, f"not reached in {timeout_s} s: {what}"
        time.sleep(0.05)
    return value


@dataclass
class WebCluster:
    url: str
    record: ClusterRecord
    model: str

    def stats(self):  # noqa: ANN201
        return query_service_stats(self.record.serve)

    def greedy(self, messages: list[dict], max_tokens: int) -> str:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0}
        reply = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=60)
        return reply.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def cluster(tiny_exports, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebCluster]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ZCTL_HOME", str(tmp_path_factory.mktemp("web-home")))
        export_dir = tiny_exports.get([(0, 2), (2, 4)])
        port = free_port("127.0.0.1")
        # 10 ms each way per hop: a token takes >= 20 ms, time to stop or kill mid-answer
        up = runner.invoke(app, ["cluster", "up", "--local", "2", "--model", str(export_dir),
                                 "--heartbeat", "0.3", "--link-delay-ms", "10",
                                 "--api", f"127.0.0.1:{port}"])
        try:
            assert up.exit_code == 0, up.output
            record = read_record()
            assert record is not None
            yield WebCluster(f"http://127.0.0.1:{port}", record,
                             load_manifest(export_dir).model.name)
        finally:
            runner.invoke(app, ["cluster", "down"])


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    need_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM,
            headless=True, args=BROWSER_ARGS, viewport=DESKTOP)
        context.set_default_timeout(30_000)
        yield context
        context.close()


def fresh_page(browser, url: str, viewport: dict = DESKTOP):  # noqa: ANN001, ANN201
    """A page on ``url`` with nothing stored, temperature 0 (greedy) and ``max_tokens``."""
    page = browser.new_page()
    page.set_viewport_size(viewport)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url)
    page.evaluate("localStorage.clear()")
    page.reload()
    page.errors = errors
    return page


def settings(page, **values: object) -> None:  # noqa: ANN001
    page.locator("#settings summary").click()
    for name, value in values.items():
        page.fill(f"#{name}", str(value))
        page.dispatch_event(f"#{name}", "change")
    page.locator("#settings summary").click()


def conversation(page) -> list[dict]:  # noqa: ANN001
    """The current conversation's messages as the page stored them."""
    return page.evaluate("""() => {
        const all = JSON.parse(localStorage.getItem('zctl.conversations') || '[]');
        const id = localStorage.getItem('zctl.current');
        return (all.find(c => c.id === id) || {messages: []}).messages; }""")


def answered(page) -> dict:  # noqa: ANN001
    """The last answer, once the page is ready for the next prompt."""
    page.wait_for_selector("#send:not([hidden])")
    page.wait_for_selector(".message.assistant:not(.pending)")
    return conversation(page)[-1]


def api_first_token_ms(cluster: WebCluster, messages: list[dict], max_tokens: int) -> float:
    """The time to the first text of a streamed chat completion, as an API client sees it."""
    body = {"model": cluster.model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    start, first = time.perf_counter(), None
    with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", json=body,
                      timeout=60) as resp:
        for line in resp.iter_lines():  # (read to its end)
            if first is None and line.startswith("data: {") and json.loads(
                    line[6:])["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
    assert first is not None, "no text streamed"
    return (first - start) * 1e3


def ask(page, text: str) -> None:  # noqa: ANN001
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


# -- the stream, no browser -----------------------------------------------------------------
def test_the_cluster_stream_shows_both_nodes_and_follows_a_generation(cluster) -> None:
    body = {"model": cluster.model, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 60, "temperature": 0, "zctl": {"ignore_eos": True}}
    views, start = [], time.monotonic()
    generation = threading.Thread(target=lambda: httpx.post(
        f"{cluster.url}/v1/chat/completions", json=body, timeout=60))
    with httpx.stream("GET", f"{cluster.url}/zctl/cluster/stream", timeout=30) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                views.append(json.loads(line.removeprefix("data: ")))
                if len(views) == 1:
                    generation.start()
                if len(views) == 4:
                    break
    generation.join()
    assert time.monotonic() - start < 4 + 3  # once a second, with a margin
    first, *later = views
    assert [s["layers"] for s in first["stages"]] == ["0-1", "2-3"]
    assert [s["node"] for s in first["stages"]][0] == "coordinator"
    assert len({s["address"] for s in first["stages"]}) == 2 and len(first["nodes"]) == 2
    assert all(s["device"] == "CPU" and s["ram_total"] > 0 for s in first["stages"])
    busy = [v for v in later if v["stages"][1]["compute_ms"]["count"]]
    assert busy, later
    assert busy[0]["hops"][0]["network_ms"]["p50"] is not None
    assert any(v["tok_s"] for v in later)


# -- the page --------------------------------------------------------------------------------
def test_an_answer_streams_in_and_equals_the_apis_greedy_one(cluster, browser) -> None:
    page = fresh_page(browser, cluster.url)
    settings(page, temperature=0, max_tokens=24)
    ask(page, PROMPT)
    page.wait_for_selector(".message.assistant.pending")
    # tokens show while the answer runs (more than the cursor, before it ends)
    wait_until(lambda: page.evaluate(
        "() => { const m = document.querySelector('.message.assistant.pending .body');"
        " return m && m.textContent.replace('…', '').trim().length > 0; }")
        or not page.locator(".message.assistant.pending").count(), what="a partial answer")
    answer = answered(page)
    assert "error" not in answer, answer
    assert answer["content"] == cluster.greedy([{"role": "user", "content": PROMPT}], 24)
    assert answer["stats"]["tokens"] == 24 and answer["stats"]["ttft_ms"] > 0
    assert "24 tokens" in page.locator(".message.assistant .stats").inner_text()
    # regenerate gives the same greedy answer, its first tokens on screen about when an
    # API client gets them (both prompts found in the prefix cache now)
    api_ttft = api_first_token_ms(cluster, [{"role": "user", "content": PROMPT}], 24)
    page.click("button[data-action=regenerate]")
    again = answered(page)
    assert again["content"] == answer["content"]
    assert again["stats"]["ttft_ms"] < api_ttft + 100 + 250, (again["stats"], api_ttft)
    print(f"TTFT: page {again['stats']['ttft_ms']:.1f} ms, API {api_ttft:.1f} ms")
    # answers are Markdown, made safe: code with a Copy button, no raw HTML, no script URLs
    html = page.evaluate("""async () => (await import('/web/markdown.js')).renderMarkdown(
        '**hi**\\n\\n```py\\nprint(1 < 2)\\n```\\n\\n<img src=x onerror=alert(1)> '
        + '[a](javascript:alert(1)) [b](https://example.com)')""")
    assert "<strong>hi</strong>" in html and '<button type="button" class="copy">' in html
    assert "print(1 &lt; 2)" in html and "<img" not in html and "javascript:" not in html
    assert 'href="https://example.com"' in html
    # the API's errors in words: a full queue, a cluster healing, a context overrun
    said = page.evaluate("""async () => { const {ApiError, humanError} = await import('/web/api.js');
        return [429, 503, 400].map(s => humanError(new ApiError(s, s === 400 ?
            'prompt (500 tokens) and max_tokens exceed the context (512)' : 'x'))); }""")
    assert "busy" in said[0] and "healing" in said[1] and "too long" in said[2], said
    # edit-and-resend replaces the turn
    page.click("button[data-action=edit]")
    page.fill("#prompt", "hello there")
    page.press("#prompt", "Enter")
    answered(page)
    assert [m["content"] for m in conversation(page)][:1] == ["hello there"]
    assert len(conversation(page)) == 2 and not page.errors


def test_stop_cancels_on_every_stage_and_the_page_is_ready_again(cluster, browser) -> None:
    page = fresh_page(browser, cluster.url)
    settings(page, temperature=0, max_tokens=5000)  # beyond the tiny model's 512 tokens
    ask(page, PROMPT)
    assert "too long for the model" in answered(page)["error"]
    page.click("#new-chat")
    settings(page, max_tokens=400)
    cancelled = cluster.stats().counters["cancelled"]
    ask(page, "count with me: one two three")
    wait_until(lambda: cluster.stats().running == 1, what="the generation running")
    wait_until(lambda: len(conversation(page)[-1]["content"]) > 10, what="tokens")
    page.click("#stop")
    answer = answered(page)
    assert answer.get("stopped") and answer["content"], answer
    wait_until(lambda: cluster.stats().running == 0, 10, "the generation to stop")
    assert cluster.stats().counters["cancelled"] == cancelled + 1
    wait_until(lambda: all(s.kv_slots == 0 for s in cluster.stats().stages), 10,
               "every stage to free its KV")
    assert page.locator("#send").is_visible() and not page.locator("#stop").is_visible()
    settings(page, max_tokens=4)
    ask(page, "and again")
    assert "error" not in answered(page)


def test_the_cluster_view_shows_the_nodes_and_live_figures(cluster, browser) -> None:
    page = fresh_page(browser, cluster.url)
    page.click("#tab-cluster")
    page.wait_for_selector(".stage[data-stage='1']")
    assert not page.locator("#view-chat").is_visible()  # one view at a time
    assert page.locator(".stage").count() == 2
    assert page.locator(".stage .layers").all_inner_texts() == ["0-1", "2-3"]
    assert page.locator("#link-state").inner_text() == "live"
    body = {"model": cluster.model, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 150, "temperature": 0, "zctl": {"ignore_eos": True}}
    generation = threading.Thread(target=lambda: httpx.post(
        f"{cluster.url}/v1/chat/completions", json=body, timeout=60))
    before = page.locator(".stage[data-stage='1'] .compute").inner_text()
    generation.start()
    seen = {before}
    wait_until(lambda: seen.add(page.locator(".stage[data-stage='1'] .compute").inner_text())
               or len(seen) >= 3, 10, "the compute figures to change")
    assert page.locator(".running").inner_text() == "1"
    page.screenshot(path=str(IMAGES / "web-cluster.png"))
    page.set_viewport_size(PHONE)
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    page.screenshot(path=str(IMAGES / "web-cluster-phone.png"))
    generation.join()
    page.click("#tab-chat")
    assert not page.locator("#view-cluster").is_visible()
    settings(page, temperature=0, max_tokens=40)
    ask(page, "Write a line of Python that prints the sky's colour.")
    answered(page)
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    page.screenshot(path=str(IMAGES / "web-chat-phone.png"))
    page.set_viewport_size(DESKTOP)
    page.screenshot(path=str(IMAGES / "web-chat.png"))
    assert not page.errors


@pytest.fixture(scope="module")
def keyed(cluster) -> Iterator[Callable[[], str]]:
    """``zctl serve --api-key`` on the running cluster, started again by calling this."""
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen] = []

    def start() -> str:
        for proc in procs:
            stop_processes([proc.pid])
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "zctl", "serve", "--port", str(port), "--api-key", KEY],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        wait_until(lambda: _answers(f"{url}/health"), 60, "the keyed server")
        return url

    start()
    yield start
    for proc in procs:
        stop_processes([proc.pid])


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_key_is_asked_once_and_a_wrong_key_restart_or_drop_lose_nothing(
        cluster, keyed, browser) -> None:
    url = keyed()
    page = fresh_page(browser, url)
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key", "wrong")
    page.click("#key-form button")
    page.wait_for_selector("#key-dialog[open]")  # asked again: the key did not serve
    page.fill("#key", KEY)
    page.click("#key-form button")
    wait_until(lambda: page.locator("#link-state").inner_text() == "live", 10, "live")
    settings(page, temperature=0, max_tokens=8)
    ask(page, PROMPT)
    first = answered(page)
    assert "error" not in first
    page.reload()  # kept in the browser: not asked again, the conversation still there
    wait_until(lambda: page.locator("#link-state").inner_text() == "live", 10, "live again")
    assert not page.locator("#key-dialog[open]").count()
    assert page.locator(".message").count() == 2
    # the key revoked mid-session: the answer says so, the key is asked, nothing is lost
    page.evaluate("localStorage.setItem('zctl.key', 'revoked')")
    ask(page, "again")
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key", KEY)
    page.click("#key-form button")
    assert "API key" in answered(page)["error"]
    page.click("button[data-action=regenerate]")
    assert "error" not in answered(page)
    assert page.locator(".message").count() == 4
    # the server restarts: the page says it is away, then is live again by itself
    page.evaluate("""() => { window.linkStates = [];
        new MutationObserver(() => window.linkStates.push(
            document.getElementById('link-state').dataset.state))
        .observe(document.getElementById('link-state'), {attributes: true}); }""")
    keyed()
    wait_until(lambda: page.locator("#link-state").inner_text() == "live", 20, "back")
    assert "offline" in page.evaluate("window.linkStates")
    # the network drops: the page says so, keeps the conversation, and comes back
    page.context.set_offline(True)
    ask(page, PROMPT)
    assert "cannot be reached" in answered(page)["error"]
    wait_until(lambda: page.locator("#link-state").inner_text() == "offline", 15, "offline")
    page.context.set_offline(False)
    wait_until(lambda: page.locator("#link-state").inner_text() == "live", 20, "online")
    page.click("button[data-action=regenerate]")
    assert "error" not in answered(page)
    assert page.locator(".message").count() == 6 and not page.errors


def test_a_node_killed_mid_answer_heals_and_the_answer_completes(cluster, browser) -> None:
    page = fresh_page(browser, cluster.url)
    settings(page, temperature=0, max_tokens=300)
    want = cluster.greedy([{"role": "user", "content": PROMPT}], 300)
    ask(page, PROMPT)
    wait_until(lambda: len(conversation(page)[-1]["content"]) > 20, what="tokens")
    os.kill(cluster.record.pids[1], signal.SIGKILL)
    banner = page.wait_for_selector("#heal:not([hidden])", timeout=15_000)
    assert "heal" in banner.inner_text()
    answer = answered(page)
    assert "error" not in answer and answer["content"] == want
    page.click("#tab-cluster")
    kinds = page.locator("#timeline .event").evaluate_all("els => els.map(e => e.dataset.kind)")
    assert "lost" in kinds and "healed" in kinds, kinds
    assert not page.errors
