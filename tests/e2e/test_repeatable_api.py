"""The same greedy request, the same tokens, through the HTTP API of ``zctl serve`` with its
default settings (an embedded cluster of 3 processes on loopback addresses, healing on,
the default numerics): cold, and with the shared start of earlier prompts or the whole
prompt cached; alone and as one of 8 at once; streamed; with prompt lookup speculation;
and after a node is killed mid-generation and its stage heals onto a survivor. On the
tiny random-weight model and on SmolLM2 (skipped without its weights), over the 20 prompts
of ``zctl bench repeatable`` (tools/repeatable/prompts.py), 32 new tokens each, at
temperature 0.

A request's tokens are read from its logprobs (each token's text; the API gives no ids),
and its text besides. "Cold" is the same request sent alone to a cluster of its own with
no prefix cache; every other case runs on one cluster per model, in order, the node
killed in the last."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_embedded_clusters import cluster_of, coordinator_config, zctl
from tools.repeatable.prompts import DOCUMENT, PROMPTS, SYSTEM
from zctl.launcher.local import free_port
from zctl.service.client import query_service_stats
from zctl.service.messages import ServiceStats

TOKENS = 32  # new tokens per request
GROUP = 8  # requests at once in the concurrent and healed cases
NODES = 3  # processes of each cluster: the coordinator and 2 nodes
# the prompts whose start an earlier one shares (a system prompt, a document)
SHARED = tuple(i for i, p in enumerate(PROMPTS) if p.startswith((SYSTEM, DOCUMENT)))
# the healed case: 8 prompts (short, a shared system prompt, a shared document), each
# with enough new tokens (past an end of text) to be generating still when the node is
# killed, SETTLE_STEPS steps after all 8 ran (by then every one decodes). On a loaded host
# the 8 may reach the engine a second or more apart, and the first must not have ended by
# the time the last starts: the tiny model (about a millisecond a token) makes as many as
# its context holds beside the longest of the 8 prompts (829 tokens of its 2,048), and
# SmolLM2 (some 30 ms a step of 8) 128: at 48 a CI host's first request ended 24 steps in
HEALED = (0, 4, 9, 10, 13, 14, 17, 19)
HEAL_TOKENS = {"tiny": 1152, "smollm2": 128}
SETTLE_STEPS = 24
LOOKUP_K = 4  # draft tokens a lookup step verifies: a fixed K drafts wherever it can (an
# adaptive one drafts where the step costs it measured say it pays)
HITS = "vllm:prefix_cache_hits_total"  # prompts whose start was found in the prefix cache
START_S = 300.0  # for a cluster to serve (its stages compiled on 2 shared cores)


@dataclass(frozen=True)
class Ask:
    """A greedy chat request of one user turn; ``speculative``: the request's own choice
    (None: the server's default, none)."""

    prompt: str
    max_tokens: int = TOKENS
    ignore_eos: bool = False
    speculative: str | None = None


@dataclass(frozen=True)
class Output:
    """What the API answered: each token's text (from its logprobs), the text, and why it
    ended."""

    tokens: tuple[str, ...]
    text: str
    finish: str


@dataclass
class Api:
    """A client of one ``zctl serve``: its OpenAI API at ``url`` (chat completions as JSON
    and as server-sent events), and the generation service of its cluster (its engine's
    own figures, which the HTTP server may pass on seconds late for a fast model)."""

    url: str
    home: Path  # its zctl home
    service: str  # the generation service's address
    sent: set[str] = field(default_factory=set)  # the prompts sent so far
    http: httpx.Client = field(init=False)
    model: str = field(init=False)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.url, timeout=300)
        self.model = self.http.get("/v1/models").json()["data"][0]["id"]

    def ask(self, ask: Ask, stream: bool = False) -> Output:
        """Send ``ask`` (streamed or not) and wait for its whole answer."""
        self.sent.add(ask.prompt)
        options: dict[str, object] = {"ignore_eos": ask.ignore_eos}
        if ask.speculative is not None:
            options.update(speculative=ask.speculative, k=LOOKUP_K)
        body = {"model": self.model, "messages": [{"role": "user", "content": ask.prompt}],
                "max_tokens": ask.max_tokens, "temperature": 0, "logprobs": True,
                "zctl": options}
        if not stream:
            reply = self.http.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            (choice,) = reply.json()["choices"]
            return Output(tuple(t["token"] for t in choice["logprobs"]["content"]),
                          choice["message"]["content"] or "", choice["finish_reason"])
        tokens, text, finish = [], [], ""
        with self.http.stream("POST", "/v1/chat/completions",
                              json={**body, "stream": True}) as reply:
            assert reply.status_code == 200, reply.read()
            for line in reply.iter_lines():
                if not line.startswith("data: {"):
                    continue  # a blank line between events, or the closing [DONE]
                chunk = json.loads(line.removeprefix("data: "))
                assert "error" not in chunk, chunk
                for choice in chunk["choices"]:
                    text.append(choice["delta"].get("content") or "")
                    tokens += [t["token"] for t in (choice.get("logprobs") or {})
                               .get("content") or []]
                    finish = choice.get("finish_reason") or finish
        return Output(tuple(tokens), "".join(text), finish)

    def metric(self, name: str) -> float:
        """A counter or gauge of ``/metrics`` (its one sample, for this model)."""
        lines = self.http.get("/metrics").text.splitlines()
        (value,) = [float(line.split()[-1]) for line in lines if line.startswith(f"{name}{{")]
        return value

    def health(self) -> tuple[int, dict]:
        reply = self.http.get("/health")
        return reply.status_code, reply.json()

    def engine(self) -> ServiceStats:
        return query_service_stats(self.service, timeout=30)


def differences(case: str, got: dict[int, Output], want: dict[int, Output]) -> list[str]:
    """For each request whose output is not its cold output: which prompt, where they part,
    and both outputs."""
    found = []
    for i, output in sorted(got.items()):
        cold = want[i]
        if output == cold:
            continue
        same = len(os.path.commonprefix([output.tokens, cold.tokens]))
        found.append(
            f"{case}: prompt {i} ({PROMPTS[i][:50]!r}...) differs from its cold output at "
            f"token {same}\n    cold:  {cold.text!r} ({len(cold.tokens)} tokens, {cold.finish})"
            f"\n    {case}: {output.text!r} ({len(output.tokens)} tokens, {output.finish})"
            f"\n    tokens from {same}: cold {list(cold.tokens[same:same + 8])} vs "
            f"{list(output.tokens[same:same + 8])}")
    return found


def assert_same(cases: Sequence[tuple[str, dict[int, Output]]], want: dict[int, Output]) -> None:
    problems = [p for case, got in cases for p in differences(case, got, want)]
    assert not problems, f"{len(problems)} output(s) differ:\n" + "\n".join(problems)


Timed = tuple[float, Output, float]  # when a request was sent, its answer, when that came


def send_together(api: Api, asks: Sequence[Ask], pool: ThreadPoolExecutor
                  ) -> list[Future[Timed]]:
    """Send the requests at the same moment, from as many threads of ``pool``."""
    ready = threading.Barrier(len(asks))

    def ask(request: Ask) -> Timed:
        ready.wait(60)
        sent = time.monotonic()
        output = api.ask(request)
        return sent, output, time.monotonic()

    return [pool.submit(ask, request) for request in asks]


def at_once(api: Api, asks: Sequence[Ask]) -> tuple[list[Output], bool]:
    """Send the requests at the same moment; their outputs, and whether all of them were
    in flight together (each sent before any was answered)."""
    with ThreadPoolExecutor(len(asks)) as pool:
        timed = [answer.result() for answer in send_together(api, asks, pool)]
    return [o for _, o, _ in timed], max(t[0] for t in timed) < min(t[2] for t in timed)


def wait_for(ready: Callable[[], bool], what: str, going: Callable[[], bool]) -> None:
    """Wait until ``ready()``, as long as ``going()`` (else fail, saying ``what`` never
    came about)."""
    while not ready():
        assert going(), f"the requests ended before {what}"
        time.sleep(0.005)


# -- the clusters ------------------------------------------------------------------------

@contextmanager
def serving(export_dir: Path, root: Path, *options: str) -> Iterator[Api]:
    """``zctl serve`` of ``export_dir`` on an embedded cluster of NODES processes (its
    defaults, but ``options``), in a zctl home of its own under ``root``; stopped on leaving,
    however the test went, and nothing of it left running."""
    home, log = root / "home", root / "serve.log"
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    with zctl(["serve", "--model", str(export_dir), "--nodes", str(NODES), "--port", str(port),
               *options], home, log) as serve:
        try:
            end = time.monotonic() + START_S
            while not _serves(url):
                assert serve.poll() is None, f"zctl serve exited: {log.read_text()[-3000:]}"
                assert time.monotonic() < end, f"not serving: {log.read_text()[-3000:]}"
                time.sleep(0.2)
            (coordinator,) = [p for p in cluster_of(home) if p.role == "coordinator"]
            api = Api(url, home, coordinator_config(coordinator).serve)
            try:
                yield api
            finally:
                api.http.close()
        finally:
            serve.send_signal(signal.SIGTERM)  # its own stop: the cluster's, then its own
            try:
                serve.wait(30)
            except subprocess.TimeoutExpired:
                pass  # killed on leaving zctl(), its cluster with it
    left = cluster_of(home)
    assert not left, f"outlived zctl serve: {[p.describe() for p in left]}"


def _serves(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass(frozen=True)
class Model:
    name: str
    export_dir: Path


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          dp_hosts: tuple[str, str]) -> Model:
    """The tiny random-weight model (int8 weights, a context for the longest prompt) or
    SmolLM2 (the INT4 export of tests/e2e/test_smollm2.py), in 3 stages."""
    if request.param == "smollm2":
        from exporter.sources import SourceError, smollm2_gguf_path

        try:
            smollm2_gguf_path()
        except SourceError as exc:
            pytest.skip(f"SmolLM2's weights are absent: {exc}")
        return Model("smollm2", request.getfixturevalue("smol_int4_exports")[1])
    from exporter.export import export_model
    from exporter.sources import open_source
    from tests.helpers.tiny_models import build_llama

    root = tmp_path_factory.mktemp("tiny-2k")
    source = build_llama(root / "hf", context=2048)  # its tokenizer makes ~830 of a document
    export_model(open_source(str(source)), [(0, 1), (1, 3), (3, 4)], "int8", root / "export")
    return Model("tiny", root / "export")


def heal_ask(model: Model, i: int) -> Ask:
    return Ask(PROMPTS[i], HEAL_TOKENS[model.name], ignore_eos=True)


@dataclass(frozen=True)
class Cold:
    """Every request sent alone to a cluster with no prefix cache: the 20 prompts, and the
    healed case's requests."""

    outputs: dict[int, Output]
    healed: dict[int, Output]


@pytest.fixture(scope="module")
def cold(model: Model, tmp_path_factory: pytest.TempPathFactory) -> Cold:
    with serving(model.export_dir, tmp_path_factory.mktemp(f"cold-{model.name}"),
                 "--prefix-cache-mb", "0") as api:
        outputs = {i: api.ask(Ask(p)) for i, p in enumerate(PROMPTS)}
        healed = {i: api.ask(heal_ask(model, i)) for i in HEALED}
    return Cold(outputs, healed)


@pytest.fixture(scope="module")
def api(model: Model, cold: Cold, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    """``zctl serve`` with its defaults (started once the cold cluster stopped), shared by
    the cases in order; the last kills a node."""
    with serving(model.export_dir, tmp_path_factory.mktemp(f"serve-{model.name}")) as served:
        yield served


# -- the cases, in order ------------------------------------------------------------------

def test_shared_prefixes_give_the_cold_tokens(api: Api, cold: Cold) -> None:
    """The prompts that share a start (a system prompt, a document), one after another:
    each but the first of its kind finds that start cached."""
    hits = api.metric(HITS)
    first = {i: api.ask(Ask(PROMPTS[i])) for i in SHARED}
    assert_same([("shared prefix", first)], cold.outputs)
    assert api.metric(HITS) - hits >= len(SHARED) - 2  # (every one after the first)


def test_one_of_8_at_once_gives_the_cold_tokens(api: Api, cold: Cold) -> None:
    """Every prompt as one of 8 requests at once (the last 8 wrap round to the first)."""
    order = list(range(len(PROMPTS)))
    got: dict[int, Output] = {}
    for start in range(0, len(order), GROUP):
        batch = (order + order)[start:start + GROUP]
        outputs, together = at_once(api, [Ask(PROMPTS[i]) for i in batch])
        assert together, f"prompts {batch} were not in flight together"
        for i, output in zip(batch, outputs, strict=True):
            assert got.setdefault(i, output) == output, f"prompt {i} differed between batches"
    # the engine stepped them together (as many as had arrived and not ended yet: a fast
    # model may end one before the last has come through the HTTP server)
    assert api.engine().counters["peak_streams"] > 1
    assert_same([("one of 8", got)], cold.outputs)


def test_cached_prompts_give_the_cold_tokens(api: Api, cold: Cold) -> None:
    """Every prompt sent again (after the cases above, or now), found whole in the cache."""
    for prompt in PROMPTS:
        if prompt not in api.sent:
            api.ask(Ask(prompt))
    hits = api.metric(HITS)
    again = {i: api.ask(Ask(p)) for i, p in enumerate(PROMPTS)}
    assert_same([("cached", again)], cold.outputs)
    assert api.metric(HITS) - hits >= len(SHARED)  # (the long prompts at least)


def test_streamed_gives_the_cold_tokens(api: Api, cold: Cold) -> None:
    assert_same([("streamed", {i: api.ask(Ask(p), stream=True)
                               for i, p in enumerate(PROMPTS)})], cold.outputs)


def test_prompt_lookup_speculation_gives_the_cold_tokens(api: Api, cold: Cold) -> None:
    """Each request with prompt lookup on (the server's default is off)."""
    drafted = api.metric("vllm:spec_decode_num_draft_tokens_total")
    got = {i: api.ask(Ask(p, speculative="lookup")) for i, p in enumerate(PROMPTS)}
    assert api.metric("vllm:spec_decode_num_draft_tokens_total") > drafted  # it drafted
    assert_same([("prompt lookup", got)], cold.outputs)


def test_a_node_killed_mid_generation_heals_with_the_cold_tokens(
        api: Api, cold: Cold, model: Model) -> None:
    """8 requests at once; once all 8 have run a few steps, the node of the last stage is
    killed: they pause, its stage moves to the middle node, and they resume (replayed) to
    their ends."""
    stages = api.engine().stages
    assert len({s.node_id for s in stages}) == NODES, stages
    (node,) = [p for p in cluster_of(api.home) if p.role == "node"
               and (Path(p.state_dir) / "node_id").read_text().strip() == stages[-1].node_id]
    with ThreadPoolExecutor(len(HEALED)) as pool:
        answers = send_together(api, [heal_ask(model, i) for i in HEALED], pool)

        def going() -> bool:  # (a request that failed says why)
            ended = [answer for answer in answers if answer.done()]
            for answer in ended:
                answer.result()
            return not ended

        def steps() -> int:  # steps stage 0 has computed (and had answered) so far
            return sum(api.engine().stages[0].compute_ms.counts)

        wait_for(lambda: api.engine().running == len(HEALED), "all 8 ran", going)
        settled = steps() + SETTLE_STEPS
        wait_for(lambda: steps() >= settled, f"{SETTLE_STEPS} steps more", going)
        os.kill(node.pid, signal.SIGKILL)
        running = api.engine().running
        timed = [answer.result(timeout=300) for answer in answers]
    results = {i: output for i, (_, output, _) in zip(HEALED, timed, strict=True)}
    sent = [at for at, _, _ in timed]
    # none had ended when the node died: every one went through the heal
    assert running == len(HEALED), (
        f"{running} of {len(HEALED)} running at the kill: too few tokens to be killed "
        f"mid-generation (the requests were sent over {max(sent) - min(sent):.2f} s)")
    status, after = api.health()
    assert status == 200 and len({s["node"] for s in after["stages"]}) == NODES - 1, after
    assert_same([("healed", results)], cold.healed)
