"""The generation service: streams tokens, refuses bad requests, keeps serving."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import zmq

from controlplane.messages import PROTOCOL_VERSION, Error, encode_message, from_frames, to_frames
from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from zctl.engine.executor import InlineExecutor
from zctl.engine.requests import (
    MAX_NEW_TOKENS,
    MAX_PROMPT_CHARS,
    GenerationChunk,
    GenerationDone,
    GenerationRequest,
)
from zctl.engine.scheduler import generate_greedy
from zctl.engine.tokenizer import ChatTokenizer
from zctl.service.client import generate_many, generate_stream
from zctl.service.errors import ServiceUnavailable
from zctl.service.messages import GenerateCancel
from zctl.service.server import MAX_REQUEST_BYTES, GenerationService


@pytest.fixture
def service(tiny_exports):
    export_dir: Path = tiny_exports.get([(0, 2), (2, 4)])
    chain = LocalChain.load(str(export_dir), RuntimeSpec(precision="f32"))
    svc = GenerationService(export_dir, lambda: chain, "tcp://127.0.0.1:*")
    svc.start()
    yield svc, export_dir
    svc.stop()


def test_stream_matches_greedy_and_ends_with_done(service) -> None:
    svc, export_dir = service
    messages = list(generate_stream(svc.endpoint, GenerationRequest("a", "the sky is", 10,
                                                                  ignore_eos=True, temperature=0.0)))
    assert isinstance(messages[-1], GenerationDone) and not messages[-1].error
    chunks = [m for m in messages if isinstance(m, GenerationChunk)]
    streamed = [t for c in chunks for t in c.tokens]
    tokenizer = ChatTokenizer(export_dir)
    chain = LocalChain.load(str(export_dir), RuntimeSpec(precision="f32"))
    expected = list(generate_greedy(chain, tokenizer.encode("the sky is"), 10))
    assert streamed == messages[-1].tokens == expected
    assert messages[-1].text == tokenizer.decode(expected)


def test_bad_requests_get_errors_and_service_keeps_serving(service) -> None:
    svc, _ = service
    with raw_client(svc.endpoint) as sock:
        status = b'{"protocol":%d,"type":"status_request","body":{}}' % PROTOCOL_VERSION
        empty = (b'{"protocol":%d,"type":"generate_request","body":{"request_id":"x","prompt":""}}'
                 % PROTOCOL_VERSION)
        for frames in ([b"not json"], [status], [empty]):
            sock.send_multipart(frames)
            assert sock.poll(5000)
            msg, _ = from_frames(sock.recv_multipart())
            assert isinstance(msg, Error) and msg.code == "bad-request"
    assert svc.counters["malformed"] == 3
    done = list(generate_stream(svc.endpoint, GenerationRequest("b", "hello", 3)))[-1]
    assert isinstance(done, GenerationDone) and done.tokens


def test_the_largest_request_the_engine_accepts_fits_the_service_cap() -> None:
    """A prompt of MAX_PROMPT_CHARS characters outside the BMP is JSON-escaped at 12 bytes
    each; with a 4 MiB cap such a request (valid to the engine) dropped the client's
    connection and was never answered."""
    biggest = GenerationRequest("r" * 64, "\U0001F600" * MAX_PROMPT_CHARS, MAX_NEW_TOKENS,
                              messages=[], stop=["\U0001F600" * 64] * 4)
    assert biggest.problem() is None
    assert len(encode_message(biggest)) <= MAX_REQUEST_BYTES


def test_a_request_of_many_megabytes_is_answered(service) -> None:
    """Over 4 MiB of escaped prompt (and a bad temperature, so nothing is tokenized): the
    service reads it and refuses it with an Error, and keeps serving."""
    svc, _ = service
    body = GenerationRequest("big", "\x01" * (MAX_PROMPT_CHARS - 1), 1, temperature=-1.0)
    frame = encode_message(body)
    assert len(frame) > 4 << 20
    with raw_client(svc.endpoint) as sock:
        sock.send_multipart([frame])
        assert sock.poll(10_000), "no answer: the service dropped the connection"
        msg, _ = from_frames(sock.recv_multipart())
    assert isinstance(msg, Error) and "temperature" in msg.detail
    assert list(generate_stream(svc.endpoint, GenerationRequest("b", "hello", 2)))[-1].tokens


def test_unwired_pipeline_reports_an_error(tiny_exports) -> None:
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    svc = GenerationService(export_dir, lambda: None, "tcp://127.0.0.1:*")
    svc.start()
    try:
        done = list(generate_stream(svc.endpoint, GenerationRequest("c", "hi", 3)))[-1]
        assert isinstance(done, GenerationDone) and "not wired" in done.error
    finally:
        svc.stop()
    with pytest.raises(ServiceUnavailable, match="no answer"):
        list(generate_stream("tcp://127.0.0.1:1", GenerationRequest("d", "hi", 3), first_timeout=0.5))


def _done(endpoint: str, req: GenerationRequest) -> GenerationDone:
    return _done_and_chunks(endpoint, req)[0]


def _done_and_chunks(endpoint: str, req: GenerationRequest,
                     seen: Callable[[Any], None] = lambda m: None
                     ) -> tuple[GenerationDone, list[GenerationChunk]]:
    """The request's GenerationDone and the chunks before it (``seen`` gets each message as it
    comes); every token is streamed before the done, failed or not."""
    messages = []
    for message in generate_stream(endpoint, req):
        seen(message)
        messages.append(message)
    done, chunks = messages[-1], messages[:-1]
    assert isinstance(done, GenerationDone) and all(isinstance(m, GenerationChunk) for m in chunks)
    assert [t for m in chunks for t in m.tokens] == done.tokens
    return done, chunks


def test_concurrent_requests_share_the_pipeline_and_queue_beyond_max_streams(tiny_exports) -> None:
    from concurrent.futures import ThreadPoolExecutor

    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    chain = LocalChain.load(str(export_dir), RuntimeSpec(precision="f32"))
    tokenizer = ChatTokenizer(export_dir)
    prompts = ["the sky is", "one two three one two three", "hello", "a b c d"]
    expected = [list(generate_greedy(chain, tokenizer.encode(p), 12)) for p in prompts]
    svc = GenerationService(export_dir, lambda: chain, "tcp://127.0.0.1:*", max_streams=2)
    svc.start()
    try:
        requests = [GenerationRequest(f"r{i}", p, 12, ignore_eos=True, temperature=0.0)
                    for i, p in enumerate(prompts)]
        with ThreadPoolExecutor(len(requests)) as pool:
            dones = list(pool.map(lambda r: _done(svc.endpoint, r), requests))
    finally:
        svc.stop()
    assert [d.tokens for d in dones] == expected
    assert svc.counters["peak_streams"] == 2 and svc.counters["failed"] == 0


def test_speculative_requests_equal_greedy_and_report_acceptance(tiny_exports) -> None:
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    draft_dir = tiny_exports.get([(0, 4)])
    chain = LocalChain.load(str(export_dir), RuntimeSpec(precision="f32"))
    tokenizer = ChatTokenizer(export_dir)
    prompt = "one two three one two three one two"
    expected = list(generate_greedy(chain, tokenizer.encode(prompt), 16))
    svc = GenerationService(export_dir, lambda: chain, "tcp://127.0.0.1:*")
    svc.start()
    try:
        for mode, k in (("lookup", 4), ("lookup", 0), (f"draft:{draft_dir}", 3)):
            done = _done(svc.endpoint, GenerationRequest(f"s{k}", prompt, 16, ignore_eos=True,
                                                        speculative=mode, k=k, temperature=0.0))
            assert not done.error and done.tokens == expected, mode
            assert done.spec["steps"] >= 1 and 0.0 <= done.spec["acceptance"] <= 1.0
        assert _done(svc.endpoint, GenerationRequest("g", prompt, 16, ignore_eos=True,
                                               temperature=0.0)).spec == {}
        # a drafter that is missing, or not a 1-stage export, is refused; serving goes on
        for bad, why in ((export_dir.parent / "nope", "draft model"), (export_dir, "1-stage")):
            done = _done(svc.endpoint, GenerationRequest("x", prompt, 4, speculative=f"draft:{bad}"))
            assert why in done.error and not done.tokens
        assert _done(svc.endpoint, GenerationRequest("y", prompt, 16, ignore_eos=True,
                                               temperature=0.0)).tokens == expected
    finally:
        svc.stop()


def test_bad_speculative_fields_are_refused() -> None:
    from controlplane.messages import MessageError, decode_message, encode_message

    for kw in ({"speculative": "magic"}, {"speculative": "draft:"}, {"k": 99}, {"k": -1},
               {"temperature": -0.5}, {"top_p": 0.0}, {"top_k": -1}, {"seed": -3}):
        with pytest.raises(MessageError):
            decode_message(encode_message(GenerationRequest("z", "hi", 4, **kw)))


def test_sampled_requests_follow_the_seed_and_top_k_one_is_greedy(service) -> None:
    svc, export_dir = service
    prompt = "one two three one two three one two"
    chain = LocalChain.load(str(export_dir), RuntimeSpec(precision="f32"))
    greedy = list(generate_greedy(chain, ChatTokenizer(export_dir).encode(prompt), 12))
    sampled = [_done(svc.endpoint, GenerationRequest(f"t{i}", prompt, 12, ignore_eos=True,
                                                   temperature=1.5, seed=42, speculative=spec))
               for i, spec in enumerate(("", "", "lookup"))]
    assert sampled[0].tokens == sampled[1].tokens and not sampled[2].error  # same seed
    assert sampled[0].tokens != greedy  # (a 1-in-vocab^12 coincidence otherwise)
    for spec in ("", "lookup"):
        done = _done(svc.endpoint, GenerationRequest("u", prompt, 12, ignore_eos=True,
                                                   temperature=0.9, top_k=1, speculative=spec))
        assert done.tokens == greedy


class SlowChain(InlineExecutor):
    """A LocalChain whose every step takes at least ``delay_s`` (a generation in progress
    stays in progress long enough to be interrupted)."""

    def __init__(self, chain: LocalChain, delay_s: float = 0.02) -> None:
        super().__init__()
        self.chain, self.delay_s, self.steps = chain, delay_s, 0

    def __getattr__(self, name: str):
        return getattr(self.chain, name)

    @property
    def row_groups_supported(self) -> bool:
        return self.chain.row_groups_supported

    @property
    def rope_short_context(self) -> int:
        return self.chain.rope_short_context

    def reset(self, stream_id: int, long_rope: bool = False) -> None:
        self.drop_answers(stream_id)
        self.chain.reset(stream_id, long_rope)

    def close_stream(self, stream_id: int) -> None:
        self.drop_answers(stream_id)
        self.chain.close_stream(stream_id)

    def abandon_all(self, why: str) -> None:
        super().abandon_all(why)
        self.chain.abandon_all(why)

    def compute(self, step):
        self.steps += 1
        time.sleep(self.delay_s)
        return self.chain.compute(step)


DOWN = "stage 1 (layers 2-3) on node n1 at 127.0.0.2 left the cluster"


def _long_request(rid: str, n: int = 60) -> GenerationRequest:
    return GenerationRequest(rid, "the sky is", n, ignore_eos=True, temperature=0.0)


@pytest.fixture
def flaky(tiny_exports):
    """A service on a slow in-process chain whose health the test sets (``problem``)."""
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    chain = SlowChain(LocalChain.load(str(export_dir), RuntimeSpec(precision="f32")))
    problem: list[str] = []
    expected = list(generate_greedy(chain.chain, ChatTokenizer(export_dir).encode("the sky is"),
                                    60))

    def start(resume_timeout_s: float) -> GenerationService:
        svc = GenerationService(export_dir, lambda: chain, "tcp://127.0.0.1:*",
                                health=lambda: problem[0] if problem else None,
                                resume_timeout_s=resume_timeout_s)
        svc.start()
        started.append(svc)
        return svc

    started: list[GenerationService] = []
    yield start, problem, expected
    for svc in started:
        svc.stop()


def test_generations_pause_while_a_stage_is_down_and_resume_as_if_nothing_happened(flaky):
    start, problem, expected = flaky
    svc = start(30.0)
    stream = generate_stream(svc.endpoint, _long_request("long"))
    assert isinstance(next(stream), GenerationChunk)  # generating
    problem.append(DOWN)
    messages = []
    held: list[GenerationDone] = []
    waiter = threading.Thread(target=lambda: held.append(
        _done(svc.endpoint, GenerationRequest("r", "hi", 3, ignore_eos=True))))
    for msg in stream:
        messages.append(msg)
        if getattr(msg, "note", "").startswith("paused"):
            waiter.start()  # a new request while it is down waits for it (up to 10 s)
            time.sleep(0.5)
            problem.clear()  # back (the node returned, or a spare took the stage)
    waiter.join(30)
    assert held and not held[0].error and len(held[0].tokens) == 3, held
    notes = [m.note for m in messages if getattr(m, "note", "")]
    assert notes[0] == f"paused: {DOWN}; resuming when it is back (up to 30 s)"
    assert notes[1].startswith("resumed after ")
    done = messages[-1]
    assert isinstance(done, GenerationDone) and not done.error and done.tokens == expected
    streamed = [t for m in messages[:-1] if isinstance(m, GenerationChunk) for t in m.tokens]
    assert streamed == done.tokens[len(done.tokens) - len(streamed):]  # nothing twice
    assert _done(svc.endpoint, _long_request("after", 5)).tokens == expected[:5]


def test_a_new_request_held_longer_than_the_pipeline_may_take_is_refused(flaky) -> None:
    start, problem, _ = flaky
    svc = start(0.5)  # new requests wait up to the resume timeout when it is under 10 s
    problem.append(DOWN)
    refused = _done(svc.endpoint, GenerationRequest("r", "hi", 3))
    assert f"the pipeline cannot serve now: {DOWN}" in refused.error


def test_a_step_failing_because_the_pipeline_was_replaced_resumes_it(tiny_exports) -> None:
    """The coordinator re-wired the pipeline (a heal) between two health checks: the old
    executor's sockets are closed and its next step fails; the generation is held and
    resumed on the new executor by replay, not failed."""
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    config = RuntimeSpec(precision="f32")
    old, new = (SlowChain(LocalChain.load(str(export_dir), config)) for _ in range(2))
    expected = list(generate_greedy(old.chain, ChatTokenizer(export_dir).encode("the sky is"),
                                    60))
    current = [old]
    broken = []

    def compute(step):
        if broken:
            raise RuntimeError("Socket operation on non-socket")  # what a closed head raises
        return SlowChain.compute(old, step)

    old.compute = compute  # type: ignore[method-assign]
    svc = GenerationService(export_dir, lambda: current[0], "tcp://127.0.0.1:*",
                            health=lambda: None, resume_timeout_s=30.0)
    svc.start()
    try:
        stream = generate_stream(svc.endpoint, _long_request("swap"))
        assert isinstance(next(stream), GenerationChunk)
        current[0] = new
        broken.append(True)
        messages = list(stream)
        notes = [m.note for m in messages if getattr(m, "note", "")]
        assert notes[0].startswith("paused: the pipeline was re-wired"), notes
        assert notes[-1].startswith("resumed after ")
        done = messages[-1]
        assert isinstance(done, GenerationDone) and not done.error and done.tokens == expected
        assert new.steps > 0
    finally:
        svc.stop()


def test_a_long_pause_keeps_clients_waiting(flaky, monkeypatch) -> None:
    """Paused longer than a client's idle timeout: the service's periodic notes keep it."""
    import zctl.engine.core as service

    monkeypatch.setattr(service, "PAUSE_NOTE_S", 0.3)
    start, problem, expected = flaky
    svc = start(30.0)
    stream = generate_stream(svc.endpoint, _long_request("long"), idle_timeout=1.0)
    assert isinstance(next(stream), GenerationChunk)
    problem.append(DOWN)
    threading.Timer(2.5, problem.clear).start()  # back after 2.5 s, more than 1 s idle
    messages = list(stream)
    notes = [m.note for m in messages if getattr(m, "note", "")]
    assert sum(n.startswith("paused ") for n in notes) >= 3, notes
    assert not messages[-1].error and messages[-1].tokens == expected


@pytest.mark.parametrize("resume_timeout_s", [0.0, 0.6])
def test_paused_generations_end_with_their_tokens_when_it_is_not_back_in_time(
        flaky, resume_timeout_s):
    start, problem, expected = flaky
    svc = start(resume_timeout_s)
    stream = generate_stream(svc.endpoint, _long_request("long"))
    assert isinstance(next(stream), GenerationChunk)
    problem.append(DOWN)
    t0 = time.monotonic()
    messages = list(stream)
    done = messages[-1]
    assert isinstance(done, GenerationDone) and time.monotonic() - t0 < resume_timeout_s + 2
    assert done.error.startswith(f"PipelineDown: {DOWN}") and done.stop_reason == "error"
    if resume_timeout_s:
        assert f"(not back within {resume_timeout_s:g} s)" in done.error
    assert 0 < len(done.tokens) < 60 and done.tokens == expected[:len(done.tokens)]
    problem.clear()
    assert _done(svc.endpoint, _long_request("ok", 5)).tokens == expected[:5]
    assert svc.counters["failed"] == 1


def test_concurrent_row_grouped_generations_resume_exactly(tiny_exports) -> None:
    """Three streams batched in a row group when the pipeline goes down: each resumes on
    its own replay and ends with exactly its greedy tokens."""
    from concurrent.futures import ThreadPoolExecutor

    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    exact = RuntimeSpec(precision="f32", kv_cache_precision="f32")  # rows == streams
    chain = SlowChain(LocalChain.load(str(export_dir), exact), 0.01)
    tokenizer = ChatTokenizer(export_dir)
    prompts = ["the sky is", "one two three one two three", "hello"]
    expected = [list(generate_greedy(chain.chain, tokenizer.encode(p), 40)) for p in prompts]
    problem: list[str] = []
    svc = GenerationService(export_dir, lambda: chain, "tcp://127.0.0.1:*", row_groups=1,
                            health=lambda: problem[0] if problem else None,
                            resume_timeout_s=30)
    paused = threading.Event()

    def note_pause(message: Any) -> None:
        if isinstance(message, GenerationChunk) and message.note.startswith("paused"):
            paused.set()

    svc.start()
    try:
        with ThreadPoolExecutor(3) as pool:
            runs = [pool.submit(_done_and_chunks, svc.endpoint, GenerationRequest(
                f"g{i}", p, 40, ignore_eos=True, temperature=0.0), note_pause)
                    for i, p in enumerate(prompts)]
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and (svc.engine.scheduler is None
                                                   or not svc.engine.scheduler.row_steps):
                time.sleep(0.01)
            assert svc.engine.scheduler is not None and svc.engine.scheduler.row_steps  # batched
            problem.append(DOWN)
            assert paused.wait(20), "the generations never paused"
            problem.clear()
            results = [r.result(60) for r in runs]
    finally:
        svc.stop()
    dones = [done for done, _ in results]
    for _, chunks in results:  # each stream was told it paused, then that it resumed
        notes = [m.note for m in chunks if m.note]
        assert any(n.startswith("paused") for n in notes), notes
        assert any(n.startswith("resumed") for n in notes), notes
    assert [d.error for d in dones] == ["", "", ""]
    assert [d.tokens for d in dones] == expected


def stage_kv_slots(chain: LocalChain) -> list[int]:
    return [sum(s.physical for s in r.streams.values()) for r in chain.runners]


def test_a_client_that_stops_reading_or_cancels_frees_the_stages(flaky) -> None:
    """Closing the stream early (what Ctrl-C in zctl run does) sends a cancel; a client
    that vanishes without one is cancelled when its next chunk cannot be delivered. Either
    way the generation stops stepping and its KV slots are freed on every stage."""
    start, _, _ = flaky
    svc = start(30.0)
    chain = svc.engine.get_executor().chain
    stream = generate_many(svc.endpoint, [_long_request("early", 480)])
    first = next(stream)
    assert isinstance(first, GenerationChunk) and first.tokens
    stream.close()  # the consumer stops: GeneratorExit runs the client's cancel
    wait_for(lambda: svc.counters["cancelled"] == 1 and not svc.engine.busy)
    assert stage_kv_slots(chain) == [0, 0]
    # a client that vanishes: a raw DEALER that sends a request and closes, saying nothing
    with raw_client(svc.endpoint) as sock:  # closed at the end of the block
        sock.send_multipart(to_frames(_long_request("vanish", 480)))
        wait_for(lambda: svc.engine.active == 1)
    wait_for(lambda: svc.counters["cancelled"] == 2 and not svc.engine.busy)
    assert svc.counters["unreachable"] == 1  # the first said so; this one was found gone
    assert stage_kv_slots(chain) == [0, 0]
    done = list(generate_stream(svc.endpoint, GenerationRequest("after", "hello", 3)))[-1]
    assert isinstance(done, GenerationDone) and done.tokens and not done.error


def test_a_client_that_cancels_and_leaves_at_once_is_not_counted_as_found_gone(
        tiny_exports) -> None:
    """Ctrl-C in zctl run: the cancel goes out and the client is gone straight after, maybe
    before the service reads it. A send that finds the client gone first reads what it
    sent, so the cancel counts as one and not as a vanished client. (The service is driven
    by hand here, its thread never started, to make that order certain.)"""
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    svc = GenerationService(export_dir, lambda: LocalChain.load(
        str(export_dir), RuntimeSpec(precision="f32")), "tcp://127.0.0.1:*")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"quitter")
    sock.connect(svc.endpoint)
    try:
        sock.send_multipart(to_frames(_long_request("q", 480)))
        assert svc._sock.poll(10_000)
        svc._receive_all()
        wait_for(lambda: svc.engine.poll(0.05) and svc.engine.active == 1)
        sock.send_multipart(to_frames(GenerateCancel("q")))
        sock.close(1000)  # the cancel leaves, then the connection goes
        ctx.term()
        chunk = GenerationChunk("q", [1], "x", 1, 1.0, None, {}, {})

        def route_gone() -> bool:  # the service's ROUTER has seen the connection go
            try:
                svc._sock.send_multipart([b"quitter", *to_frames(chunk)], zmq.NOBLOCK)
            except zmq.ZMQError:
                return True
            return False

        wait_for(route_gone)
        svc._send(b"quitter", chunk)
        assert svc.counters["unreachable"] == 0 and svc.counters["cancelled"] == 1
    finally:
        svc.stop()


def test_clients_found_gone_are_forgotten_while_others_keep_the_service_busy(flaky) -> None:
    """The service drops what is meant for a client found gone until its cancelled
    generations have ended (the next poll), then forgets it: under a load that never lets
    up, vanished clients do not pile up."""
    start, _, _ = flaky
    svc = start(30.0)
    with raw_client(svc.endpoint) as busy:
        busy.send_multipart(to_frames(_long_request("busy", 480)))
        for i in range(3):
            with raw_client(svc.endpoint) as sock:
                sock.send_multipart(to_frames(_long_request(f"vanish{i}", 480)))
                wait_for(lambda: svc.engine.active == 2)
            wait_for(lambda i=i: svc.counters["cancelled"] == i + 1)
        wait_for(lambda: not svc._gone)  # (the set of clients found gone)
        assert svc.engine.active == 1 and svc.counters["unreachable"] == 3


def test_cancel_message_for_a_request_stops_only_that_one(flaky) -> None:
    start, _, expected = flaky
    svc = start(30.0)
    with raw_client(svc.endpoint) as sock:
        for rid in ("keep", "stop"):
            sock.send_multipart(to_frames(_long_request(rid)))
        wait_for(lambda: svc.engine.active == 2)
        sock.send_multipart(to_frames(GenerateCancel("stop")))
        sock.send_multipart(to_frames(GenerateCancel("no-such-request")))  # ignored
        dones: dict[str, GenerationDone] = {}
        while len(dones) < 2:
            assert sock.poll(10_000)
            msg, _ = from_frames(sock.recv_multipart())
            if isinstance(msg, GenerationDone):
                dones[msg.request_id] = msg
    assert dones["stop"].stop_reason == "cancelled" and len(dones["stop"].tokens) < 60
    assert dones["keep"].tokens == expected and dones["keep"].stop_reason == "max_tokens"


@contextmanager
def raw_client(endpoint: str) -> Iterator[zmq.Socket]:
    """A bare DEALER to the service (its own context), closed when the block ends."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close(0)
        ctx.term()


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "not reached in time"
        time.sleep(0.01)


def test_the_stages_runtime_loads_draft_models_and_prices_a_streams_kv(tiny_exports) -> None:
    """The service is given the runtime its stages are compiled with: draft models load
    with it (a drafter runs as stage 0 does) and a stream's KV is priced by it."""
    from dataplane.runtime.draft_model import DraftModels
    from zctl.manifest import load_manifest
    from zctl.service.server import kv_cost

    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    runtime = RuntimeSpec(precision="f32", paged_attention=True)
    svc = GenerationService(export_dir, lambda: None, "tcp://127.0.0.1:*", stage_runtime=runtime)
    try:
        drafter = svc.engine.load_drafter
        assert isinstance(drafter, DraftModels) and drafter.config is runtime
        assert svc.engine.kv_cost == kv_cost(load_manifest(export_dir, verify_files=False),
                                             runtime)
    finally:
        svc.stop()
    plain = GenerationService(export_dir, lambda: None, "tcp://127.0.0.1:*")
    try:
        drafter = plain.engine.load_drafter
        assert isinstance(drafter, DraftModels) and drafter.config is None
    finally:
        plain.stop()


def test_kv_cost_counts_sliding_layers_at_their_bound() -> None:
    """Paged stages' sliding layers keep their window, margin and a step's token over
    block edges; stateful ones of an export made before, or a runtime not known, keep
    every token, and those of an export that lets them trim, their bound."""
    from dataclasses import replace

    from dataplane.runtime.config import RuntimeSpec
    from dataplane.runtime.synthetic import LayerShape, synthetic_manifest
    from zctl.engine.kv_cost import EVERY_TOKEN
    from zctl.service.server import kv_cost

    base = synthetic_manifest(LayerShape(hidden=64, heads=2, kv_heads=1, head_dim=32,
                                         intermediate=128, vocab=100), 6, True, "fp32")
    stage = base.stages[0]
    manifest = replace(
        base, model=replace(base.model, sliding_window=512, sliding_layers=(0, 1, 2, 4)),
        stages=(replace(stage, layer_end=3), replace(stage, index=1, layer_start=3)))
    paged = RuntimeSpec(paged_attention=True)
    cost = kv_cost(manifest, paged)
    kept = (-(-(512 - 1 + paged.sliding_margin + 1) // 32) + 1) * 32
    assert cost.stages == ((0, 3), (2, 1)) and cost.sliding_tokens == kept
    assert cost.tokens(8192) == -(-(2 * 8192 + kept) // 3)
    assert kv_cost(manifest, RuntimeSpec()) == kv_cost(manifest, None) == EVERY_TOKEN
    trimmable = replace(manifest, model=replace(manifest.model, sliding_kv_trimmable=True))
    assert kv_cost(trimmable, RuntimeSpec()).sliding_tokens == 511 + 528 + 256 + 1
    assert kv_cost(base, paged) == EVERY_TOKEN  # no sliding layer


def test_a_sliding_layer_holds_its_window_margin_and_a_step() -> None:
    """On paged stages over block edges; on stateful ones with a slack, where the export's
    graphs let a sliding layer's state be trimmed; every token elsewhere."""
    from dataclasses import replace

    from dataplane.runtime.config import RuntimeSpec
    from dataplane.runtime.kv.blocks import sliding_tokens
    from dataplane.runtime.synthetic import LayerShape, synthetic_manifest

    base = synthetic_manifest(LayerShape(hidden=64, heads=2, kv_heads=1, head_dim=32,
                                         intermediate=128, vocab=100), 6, True, "fp32").model
    old = replace(base, sliding_window=512, sliding_layers=(0, 1, 2, 4))
    model = replace(old, sliding_kv_trimmable=True)
    paged = RuntimeSpec(paged_attention=True)
    # 511 keys before a query, 528 of margin and the step's token: 33 blocks, +1 over edges
    assert sliding_tokens(paged, model) == sliding_tokens(paged, old) == 34 * 32
    # stateful: 511 + 528, the slack of 256 and the step's token
    assert sliding_tokens(RuntimeSpec(), model) == 511 + 528 + 256 + 1
    assert sliding_tokens(RuntimeSpec(), old) is None  # an export made before: every token
    assert sliding_tokens(paged, base) is None and sliding_tokens(None, model) is None
