"""GenerationEngine on its own (no sockets): what each client is told, cancellation, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from dataplane.local_chain import LocalChain
from dataplane.runtime import RuntimeConfig
from engine.requests import GenerationChunk, GenerationDone, GenerationRequest
from engine.scheduler import generate_greedy
from engine.service import GenerationEngine
from engine.tokenizer import ChatTokenizer


@pytest.fixture(scope="module")
def setup(tiny_exports):
    export_dir: Path = tiny_exports.get([(0, 2), (2, 4)])
    chain = LocalChain.load(str(export_dir), RuntimeConfig(precision="f32"))
    return export_dir, chain, ChatTokenizer(export_dir)


def engine_for(setup, **kwargs) -> GenerationEngine:
    _, chain, tokenizer = setup
    return GenerationEngine(tokenizer, [], lambda: chain, **kwargs)


def drive(engine: GenerationEngine, until, limit: int = 2000) -> list:
    """Poll until ``until(events so far)``; every (client, event) seen."""
    seen: list = []
    for _ in range(limit):
        seen += engine.poll(0.0)
        if until(seen):
            return seen
    raise AssertionError(f"not reached in {limit} polls: {seen[-3:]}")


def done_of(seen: list, client: str) -> GenerationDone:
    return next(e for c, e in seen if c == client and isinstance(e, GenerationDone))


def test_two_clients_get_their_own_tokens(setup) -> None:
    _, chain, tokenizer = setup
    engine = engine_for(setup)
    prompts = {"a": "the sky is", "b": "one two three"}
    for client, prompt in prompts.items():
        engine.submit(client, GenerationRequest(client + "-1", prompt, 12, ignore_eos=True))
    seen = drive(engine, lambda s: sum(isinstance(e, GenerationDone) for _, e in s) == 2)
    for client, prompt in prompts.items():
        done = done_of(seen, client)
        assert done.request_id == client + "-1" and done.stop_reason == "max_tokens"
        assert done.tokens == list(generate_greedy(chain, tokenizer.encode(prompt), 12))
        streamed = [t for c, e in seen if c == client and isinstance(e, GenerationChunk)
                    for t in e.tokens]
        assert streamed == done.tokens
    assert not engine.busy and engine.counters["peak_streams"] == 2


def test_cancel_ends_one_generation_and_leaves_the_other(setup) -> None:
    _, chain, tokenizer = setup
    engine = engine_for(setup)
    engine.submit("a", GenerationRequest("ra", "the sky is", 200, ignore_eos=True))
    engine.submit("b", GenerationRequest("rb", "one two three", 16, ignore_eos=True))
    first = drive(engine, lambda s: any(c == "a" and isinstance(e, GenerationChunk)
                                        for c, e in s))
    for _ in range(6):  # tokens made since that chunk wait for the next one (every 0.1 s)
        first += engine.poll(0.0)
    assert not engine.cancel("a", "rb") and not engine.cancel("nobody", "ra")  # not theirs
    assert engine.cancel("a", "ra")
    seen = engine.poll(0.0) + drive(engine, lambda s: not engine.busy)
    cancelled = done_of(seen, "a")
    assert cancelled.stop_reason == "cancelled" and not cancelled.error
    assert 0 < len(cancelled.tokens) < 200
    want = list(generate_greedy(chain, tokenizer.encode("the sky is"), len(cancelled.tokens)))
    assert cancelled.tokens == want  # what it had, exactly
    streamed = [t for c, e in seen if c == "a" and isinstance(e, GenerationChunk) for t in e.tokens]
    assert [t for c, e in first if c == "a" and isinstance(e, GenerationChunk)
            for t in e.tokens] + streamed == cancelled.tokens  # every token streamed first
    other = done_of(seen, "b")
    assert other.tokens == list(generate_greedy(chain, tokenizer.encode("one two three"), 16))
    assert engine.counters["cancelled"] == 1 and not engine.cancel("a", "ra")  # over now


def test_cancel_a_waiting_request(setup) -> None:
    engine = engine_for(setup, max_streams=1)
    engine.submit("a", GenerationRequest("first", "the sky is", 30, ignore_eos=True))
    engine.submit("b", GenerationRequest("queued", "hello", 30, ignore_eos=True))
    engine.poll(0.0)  # the first starts, the second waits for its stream
    assert engine.active == 1 and engine.cancel("b", "queued")
    seen = drive(engine, lambda s: not engine.busy)
    queued = done_of(seen, "b")
    assert queued.stop_reason == "cancelled" and queued.tokens == []
    assert len(done_of(seen, "a").tokens) == 30


@pytest.mark.parametrize("request_, problem", [
    (GenerationRequest("x", "hi", 0), "bad request: max_tokens must be in 1.."),
    (GenerationRequest("x", "", 4), "bad request: prompt must have 1.."),
    (GenerationRequest("x", "hi", 4, temperature=-1), "bad request: temperature"),
    (GenerationRequest("x", "hi", 4, speculative="draft:/m"), "has no draft models"),
])
def test_bad_requests_are_refused_and_the_engine_keeps_serving(setup, request_, problem) -> None:
    engine = engine_for(setup)
    engine.submit("a", request_)
    engine.submit("b", GenerationRequest("ok", "hello", 3, ignore_eos=True))
    seen = drive(engine, lambda s: not engine.busy)
    refused = done_of(seen, "a")
    assert refused.stop_reason == "error" and problem in refused.error and refused.tokens == []
    assert len(done_of(seen, "b").tokens) == 3 and not done_of(seen, "b").error


def test_no_executor_yet_is_refused_clearly(setup) -> None:
    _, _, tokenizer = setup
    engine = GenerationEngine(tokenizer, [], lambda: None)
    engine.submit("a", GenerationRequest("x", "hi", 3))
    (client, done), = engine.poll(0.0)
    assert client == "a" and isinstance(done, GenerationDone)
    assert "not wired yet" in done.error and not engine.busy
