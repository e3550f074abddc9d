"""Every decoder of what a socket receives, fuzzed with hypothesis: data-plane frames
(arbitrary bytes, and well-formed headers of every kind and shape, ragged rows included,
with bytes changed), control and service messages (arbitrary bytes, and any JSON body for
every registered type), and the OpenAI API's request models. Each either decodes or
refuses with its own error type: nothing else escapes, and what decodes re-encodes to
the bytes it came from."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.messages import PROTOCOL_VERSION, REGISTRY, MessageError, decode_message, from_frames
from dataplane.wire.frames import (
    MAX_ROWS,
    FrameError,
    HiddenStateFrame,
    Kind,
    ReplyMode,
    decode_frame,
    encode_frame,
)

# Examples per decoder of what a socket receives, and per API request model (pydantic
# validation: ~35 ms a hundred). The suite's counts keep CI short; `make fuzz` runs 10,000.
EXAMPLES = int(os.environ.get("ZCTL_FUZZ_EXAMPLES", "3000"))
API_EXAMPLES = max(EXAMPLES // 5, 100)
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats() |
    st.text(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                 max_size=4),
    max_leaves=12)


def _refused_or_exact(parts: list[bytes]) -> None:
    try:
        header, payload = decode_frame(parts)
    except FrameError as exc:
        assert str(exc)
        return
    again = encode_frame(header, payload)
    if "\ufffd" not in header.error:  # an error text's bad UTF-8 is read as U+FFFD, on purpose
        assert bytes(again[0]) == parts[0]
    assert bytes(memoryview(again[1])) == parts[1]


@FUZZ
@given(st.binary(max_size=400), st.binary(max_size=256))
def test_any_bytes_are_a_frame_or_refused(head: bytes, body: bytes) -> None:
    _refused_or_exact([head, body])


@st.composite
def frames(draw: st.DrawFn) -> list[bytes]:
    """A well-formed frame of any kind (rows, ragged rows, rewinds, logits indices), then
    up to 3 of its header's bytes changed."""
    kind = draw(st.sampled_from(list(Kind)))
    rows = draw(st.integers(1, 4))
    ragged = draw(st.booleans()) and kind in (Kind.STEP, Kind.REPLY, Kind.ERROR)
    counts = draw(st.lists(st.integers(1, 5), min_size=rows, max_size=rows))
    tokens = sum(counts) if ragged else rows * counts[0]
    positions = np.array(draw(st.lists(st.integers(0, 1 << 20), min_size=tokens,
                                       max_size=tokens)), dtype=np.int64)
    header = HiddenStateFrame(
        kind, draw(st.integers(0, 2 ** 32 - 1)), draw(st.integers(0, 2 ** 64 - 1)),
        draw(st.integers(0, 2 ** 64 - 1)), draw(st.integers(0, 2 ** 32 - 1)), positions,
        reply=draw(st.sampled_from(list(ReplyMode))), top_k=draw(st.integers(1, 8)),
        rows=rows, row_tokens=np.array(counts if ragged else [], dtype=np.int64),
        row_rewinds=np.array(draw(st.sampled_from([[], [0] * rows, [1] * rows])),
                             dtype=np.int64),
        error=draw(st.text(max_size=20)) if kind == Kind.ERROR else "")
    shape = (1, tokens, 4) if ragged else (rows, tokens // rows, 4)
    payload = None if kind not in (Kind.STEP,) else np.zeros(shape, np.float32)
    try:
        head, body = encode_frame(header, payload)
    except FrameError:
        return [b"", b""]
    junk = bytearray(head)
    for _ in range(draw(st.integers(0, 3))):
        junk[draw(st.integers(0, len(junk) - 1))] = draw(st.integers(0, 255))
    return [bytes(junk), bytes(memoryview(body)) if len(body) else b""]


@FUZZ
@given(frames())
def test_changed_frames_of_every_kind_are_refused_or_read_exactly(parts: list[bytes]) -> None:
    _refused_or_exact(parts)


@FUZZ
@given(st.binary(max_size=300))
def test_any_bytes_are_a_control_message_or_refused(data: bytes) -> None:
    try:
        decode_message(data)
    except MessageError as exc:
        assert str(exc)


@FUZZ
@given(st.sampled_from(sorted(REGISTRY)), JSON, st.sampled_from([PROTOCOL_VERSION, 0, True]))
def test_any_body_of_any_message_type_is_a_message_or_refused(msg_type: str, body: object,
                                                              protocol: object) -> None:
    data = json.dumps({"protocol": protocol, "type": msg_type, "body": body}).encode()
    try:
        decode_message(data)
    except MessageError as exc:
        assert str(exc)


@FUZZ
@given(st.lists(st.binary(max_size=120), max_size=3))
def test_any_multipart_is_a_service_message_or_refused(frames_: list[bytes]) -> None:
    try:
        from_frames(frames_)
    except MessageError as exc:
        assert str(exc)


@pytest.mark.parametrize("model", ["chat", "completion", "tokenize"])
def test_any_json_is_an_api_request_or_a_validation_error(model: str) -> None:
    pydantic = pytest.importorskip("pydantic")
    from zctl.serve.errors import ApiError
    from zctl.serve.openai.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        TokenizeBody,
        to_generations,
    )

    cls = {"chat": ChatCompletionRequest, "completion": CompletionRequest,
           "tokenize": TokenizeBody}[model]
    shaped = {  # near-valid shapes of the structured-output and tool fields, and any JSON
        "response_format": JSON | st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "json_object", "json_schema"])},
            optional={"json_schema": st.fixed_dictionaries({}, optional={"schema": JSON})}),
        "tools": JSON | st.lists(st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries(
                {"name": st.text(max_size=8)}, optional={"parameters": JSON})}), max_size=3),
        "tool_choice": JSON | st.sampled_from(["none", "auto", "required"]),
        "zctl": JSON | st.fixed_dictionaries({}, optional={
            "regex": st.text(max_size=12), "grammar": st.text(max_size=12), "choice": JSON})}
    fields = {"model": st.text(max_size=8), "messages": JSON, "prompt": JSON,
              "max_tokens": JSON, "temperature": JSON, "top_p": JSON, "stop": JSON,
              "n": JSON, "logprobs": JSON, "top_logprobs": JSON, "seed": JSON,
              "stream": JSON, "return_token_strs": JSON, **shaped}

    @settings(FUZZ, max_examples=API_EXAMPLES)
    @given(st.fixed_dictionaries({}, optional=fields))
    def check(body: dict) -> None:
        try:
            req = cls.model_validate(body)
        except pydantic.ValidationError:
            return
        try:
            gens = [req.generation("r")] if isinstance(req, TokenizeBody) else \
                to_generations(req, "r")
            for gen in gens:
                gen.problem()
        except ApiError as exc:
            assert str(exc)

    check()


def test_the_fuzzed_shapes_stay_inside_the_limits() -> None:
    assert MAX_ROWS >= 4  # the frames strategy stays within what a header may hold


def test_any_grammar_compiles_or_is_refused(tiny_llama_dir) -> None:
    """What a request may hold its output to (zctl.engine.constraints), fuzzed: any JSON as a
    schema (or a schema's JSON or text), any text as a regex, a grammar or choices,
    compiles to a constraint whose
    mask and forced tokens can be read, or is refused with RequestRefused."""
    from zctl.engine.constraints import GrammarCompiler
    from zctl.engine.requests import RequestRefused
    from zctl.engine.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer(tiny_llama_dir)
    compiler = GrammarCompiler(tokenizer.backend.to_str(), tokenizer.vocab_size,
                               [tokenizer.eos_token_id])
    from zctl.engine.requests import GRAMMAR_KINDS

    objects = st.fixed_dictionaries({"type": st.just("object")}, optional={
        "properties": JSON, "required": JSON, "x-guidance": JSON}).map(json.dumps)
    texts = st.text(max_size=24) | JSON.map(json.dumps) | objects
    kinds = st.sampled_from(GRAMMAR_KINDS)

    @settings(FUZZ, max_examples=300)
    @given(kinds, texts)
    def check(kind: str, text: str) -> None:
        try:
            constraint = compiler.constraint(kind, text)
        except RequestRefused as exc:
            assert str(exc)
            return
        try:
            row = constraint.mask(np.zeros(tokenizer.vocab_size))
        except RuntimeError as exc:  # a grammar nothing can satisfy: the stream fails alone
            assert "allows no token" in str(exc)
            return
        assert row.shape == (tokenizer.vocab_size,) and np.isfinite(row).any()
        assert all(0 <= t < tokenizer.vocab_size for t in constraint.forced())

    check()
