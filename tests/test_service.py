"""The generation service: streams tokens, refuses bad requests, keeps serving."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from controlplane.client import ClusterUnreachable, generate_stream
from controlplane.messages import Error, from_frames
from controlplane.service import GenerationService
from controlplane.service_messages import GenerateChunk, GenerateDone, GenerateRequest
from dataplane.generate import LocalChain, generate_greedy
from dataplane.runtime import RuntimeConfig
from dataplane.tokenizer import ChatTokenizer


@pytest.fixture
def service(tiny_exports):
    export_dir: Path = tiny_exports.get([(0, 2), (2, 4)])
    chain = LocalChain.load(str(export_dir), RuntimeConfig(precision="f32"))
    svc = GenerationService(export_dir, lambda: chain, "tcp://127.0.0.1:*")
    svc.start()
    yield svc, export_dir
    svc.stop()


def test_stream_matches_greedy_and_ends_with_done(service) -> None:
    svc, export_dir = service
    messages = list(generate_stream(svc.endpoint, GenerateRequest("a", "the sky is", 10,
                                                                  ignore_eos=True)))
    assert isinstance(messages[-1], GenerateDone) and not messages[-1].error
    chunks = [m for m in messages if isinstance(m, GenerateChunk)]
    streamed = [t for c in chunks for t in c.tokens]
    tokenizer = ChatTokenizer(export_dir)
    chain = LocalChain.load(str(export_dir), RuntimeConfig(precision="f32"))
    expected = list(generate_greedy(chain, tokenizer.encode("the sky is"), 10))
    assert streamed == messages[-1].tokens == expected
    assert messages[-1].text == tokenizer.decode(expected)


def test_bad_requests_get_errors_and_service_keeps_serving(service) -> None:
    svc, _ = service
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(svc.endpoint)
    try:
        for frames in ([b"not json"], [b'{"protocol":1,"type":"status_request","body":{}}'],
                       [b'{"protocol":1,"type":"generate_request","body":{"request_id":"x","prompt":""}}']):
            sock.send_multipart(frames)
            assert sock.poll(5000)
            msg, _ = from_frames(sock.recv_multipart())
            assert isinstance(msg, Error) and msg.code == "bad-request"
    finally:
        sock.close(0)
    assert svc.counters["malformed"] == 3
    done = list(generate_stream(svc.endpoint, GenerateRequest("b", "hello", 3)))[-1]
    assert isinstance(done, GenerateDone) and done.tokens


def test_unwired_pipeline_reports_an_error(tiny_exports) -> None:
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    svc = GenerationService(export_dir, lambda: None, "tcp://127.0.0.1:*")
    svc.start()
    try:
        done = list(generate_stream(svc.endpoint, GenerateRequest("c", "hi", 3)))[-1]
        assert isinstance(done, GenerateDone) and "not wired" in done.error
    finally:
        svc.stop()
    with pytest.raises(ClusterUnreachable, match="no answer"):
        list(generate_stream("tcp://127.0.0.1:1", GenerateRequest("d", "hi", 3), first_timeout=0.5))
