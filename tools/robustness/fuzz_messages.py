"""Hostile messages for the live fuzzer (tools.robustness.fuzz), from a seeded ``random.Random``.

Each generator returns what one send puts on a socket: the frames of a ZeroMQ multipart
message (control ROUTER, generation service ROUTER, data PULL), or one HTTP request. The
mix: random bytes, random multipart, valid messages built with the product's own encoders
(controlplane.messages, zctl.service.messages, dataplane.wire.frames) then changed
(bits flipped, truncated, extended, a field given the wrong type or value, a wrong
version or type tag, huge counts and lengths, wrong shapes, frames added or dropped).
The same seed gives the same messages.
"""

from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from controlplane.messages import (
    PROTOCOL_VERSION,
    Enrol,
    Heartbeat,
    Leave,
    ShardChunk,
    ShardDone,
    ShardRequest,
    StageReady,
    StatusRequest,
    encode_message,
)
from controlplane.records import DeviceInfo
from dataplane.wire.frames import FIXED, HiddenStateFrame, Kind, ReplyMode, encode_frame
from zctl.engine.requests import GenerationRequest
from zctl.service.messages import (
    DetokenizeRequest,
    GenerateCancel,
    ServiceStatsRequest,
    TokenizeRequest,
)

Parts = list[bytes]
# Values that a field of the wrong type or range gets.
ODD_VALUES: tuple[Any, ...] = (None, True, -1, 0, 2 ** 64, -(2 ** 63), 1e308, float("nan"), "",
                               "x" * 300, [], {}, [1, "a", None], {"a": {"b": [1]}})


def mutate(rng: random.Random, data: bytes) -> bytes:
    """``data`` changed one way: bits flipped, cut short, extended, a run overwritten or
    repeated, or emptied."""
    if not data:
        return rng.randbytes(rng.randint(1, 64))
    op = rng.randrange(7)
    buf = bytearray(data)
    if op == 0:
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    elif op == 1:
        del buf[rng.randrange(len(buf)):]
    elif op == 2:
        buf += rng.randbytes(rng.randint(1, 256))
    elif op == 3:
        at = rng.randrange(len(buf))
        run = rng.randint(1, 16)
        buf[at:at + run] = rng.randbytes(run)
    elif op == 4:
        at = rng.randrange(len(buf))
        buf[at:at] = buf[at:at + rng.randint(1, 32)] * rng.randint(2, 8)
    elif op == 5:
        at = rng.randrange(len(buf))
        buf[at:at + 1] = rng.choice([b"\xff" * 8, b"\x00" * 8, b"\"", b"{", b"]", b"\\u0000"])
    else:
        return b""
    return bytes(buf)


def random_parts(rng: random.Random, max_frames: int = 6, max_bytes: int = 512) -> Parts:
    """1..max_frames frames of random bytes (some empty)."""
    return [rng.randbytes(rng.choice([0, rng.randint(1, max_bytes)]))
            for _ in range(rng.randint(1, max_frames))]


def envelope(msg_type: str, body: Any, protocol: Any = 1) -> bytes:
    """A control-plane JSON envelope with any type tag, body and protocol version."""
    return json.dumps({"protocol": protocol, "type": msg_type, "body": body},
                      allow_nan=True).encode()


def changed_envelope(rng: random.Random, frame: bytes) -> bytes:
    """A valid envelope with its version, type tag, one field or its shape changed."""
    raw = json.loads(frame)
    body = raw.setdefault("body", {})
    choice = rng.randrange(6)
    if choice == 0:
        raw["protocol"] = rng.choice([0, PROTOCOL_VERSION + 1, 99, -1, str(PROTOCOL_VERSION), None,
                                      1.5, True])
    elif choice == 1:
        raw["type"] = rng.choice(["", "nope", "STATUS_REQUEST", "error ", 7, None,
                                  "generate_request", "status_reply", "welcome"])
    elif choice == 2 and body:
        body[rng.choice(sorted(body))] = rng.choice(ODD_VALUES)
    elif choice == 3:
        body["".join(rng.choices("abcxyz_", k=rng.randint(1, 12)))] = rng.choice(ODD_VALUES)
    elif choice == 4:
        raw = rng.choice([[], "text", 1, None, {"type": raw["type"]}, {**raw, "extra": 1},
                          {**raw, "body": [body]}])
    else:  # nested past any parser's depth (json.dumps would not write it)
        depth = rng.choice([50, 5000])
        head = b'{"protocol":%d,"type":"%s","body":{"x":' % (PROTOCOL_VERSION,
                                                               str(raw["type"]).encode())
        return head + b"[" * depth + b"]" * depth + b"}}"
    return json.dumps(raw, allow_nan=True).encode()


def control_seeds() -> list[Parts]:
    """Valid control-plane messages a stranger may send the coordinator's ROUTER (an
    enrolment it refuses: a zctl and OpenVINO version no node has)."""
    device = DeviceInfo("CPU", "fuzz CPU", None)
    enrol = Enrol("fuzz-node", "127.0.0.9", "tcp://127.0.0.9:1", [device], 1 << 30, 1 << 29,
                  "0.0.0-fuzz", "0.0.0-fuzz")
    messages = [StatusRequest(), Heartbeat("ok", 3), Leave("fuzz"), enrol,
                ShardRequest("0" * 64, "stage.bin", 0, 0, 1024), ShardDone("0" * 64, True),
                StageReady(1, 1, True), GenerationRequest("r", "hi", 1)]
    chunk = ShardChunk("0" * 64, "stage.bin", 0, 0, 4, "0" * 64)
    return [[encode_message(m)] for m in messages] + [[encode_message(chunk), b"\0" * 4]]


def service_seeds() -> list[Parts]:
    """Valid generation-service messages: short generations, a cancel, a stats request,
    tokenize and detokenize requests, and a control message sent to the wrong ROUTER."""
    return [[encode_message(m)] for m in (
        GenerationRequest("fuzz-a", "the sky is", 2, ignore_eos=True),
        GenerationRequest("fuzz-b", "one two", 1, chat=False, temperature=0.7, seed=3),
        GenerateCancel("fuzz-a"), ServiceStatsRequest(), StatusRequest(),
        TokenizeRequest(GenerationRequest("fuzz-c", "the sky is", 1)),
        DetokenizeRequest("fuzz-d", [1, 2, 3]),
        GenerationRequest("fuzz-e", max_tokens=1, chat=False, prompt_ids=[1, 2, 3]))]


def json_message(rng: random.Random, seeds: list[Parts], cap: int) -> Parts:
    """One hostile message for a ROUTER that reads control-plane envelopes (``cap``: its
    MAXMSGSIZE, which no message here reaches)."""
    seed = rng.choice(seeds)
    pick = rng.random()
    if pick < 0.12:
        return [rng.randbytes(rng.randint(0, 2048))]
    if pick < 0.22:
        return random_parts(rng)
    if pick < 0.55:
        return [mutate(rng, seed[0]), *seed[1:]]
    if pick < 0.85:
        frame = changed_envelope(rng, seed[0])
        return [frame if len(frame) < cap else frame[:cap // 2]]
    if pick < 0.95:  # frames added or taken away
        extra = [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 4))]
        return rng.choice([[*seed, *extra], [], [b"", *seed], extra + seed])
    length = rng.choice([cap // 4, cap // 2, cap - 4096])  # big, under the cap
    return [rng.choice([b"{", b"[", b'"', b"1"]) * length]


def over_cap(rng: random.Random, cap: int) -> Parts:
    """A message whose one frame is just over a socket's MAXMSGSIZE (it drops the peer)."""
    return [rng.choice([b"{", b"\0", b"a"]) * (cap + rng.randint(1, 64))]


# -- data-plane frames -----------------------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    """What a stage's valid frames look like: hidden states and logits widths."""

    hidden: int
    vocab: int


def frame_seed(rng: random.Random, shape: ModelShape) -> Parts:
    """A valid frame of any kind, for a stream id no generation uses (>= 2**31)."""
    sid, rid, epoch = rng.randint(1 << 31, (1 << 32) - 1), rng.getrandbits(63), rng.randint(0, 9)
    tokens = rng.randint(1, 8)
    positions = np.arange(tokens, dtype=np.int64) + rng.randint(0, 400)
    kind = rng.choice(list(Kind))
    header = HiddenStateFrame(kind, sid, rid, epoch, step=rng.randint(0, 50),
                              positions=positions if kind in (Kind.STEP, Kind.REPLY) else
                              np.zeros(0, np.int64))
    payload: np.ndarray | None = None
    if kind == Kind.STEP:
        payload = (rng.choice([np.random.default_rng(rng.getrandbits(32)).standard_normal(
            (1, tokens, shape.hidden), dtype=np.float32),
            np.array([[rng.randrange(shape.vocab) for _ in range(tokens)]], np.int64)]))
        header.reply = rng.choice(list(ReplyMode))
        header.top_k = rng.randint(1, 8) if header.reply == ReplyMode.TOPK else 1
        if rng.random() < 0.3:  # a pipelined run's step: its fed tokens, maybe a guess
            header.fed = np.array([rng.randrange(shape.vocab) for _ in range(tokens)], np.int64)
            header.guessed = rng.random() < 0.5
    elif kind == Kind.REPLY:
        header.positions = positions[-1:]
        payload = np.zeros((1, 1), np.dtype([("token", "<i4"), ("logit", "<f4")]))
    elif kind == Kind.ERROR:
        header.error = rng.choice(["stage 1 failed", "\x00" * 20, "é" * 100])
    elif kind == Kind.GROUP:
        payload = np.array([rng.randint(1 << 31, (1 << 32) - 1) for _ in range(3)], np.int64)
    elif kind == Kind.PREFIX:
        payload = np.array([rng.randint(0, 4), rng.getrandbits(31), rng.randint(0, 64),
                            rng.randint(0, 1), sid], np.int64)
    elif kind == Kind.CANCEL:
        first = rng.randint(0, 50)
        payload = np.array([first, first + rng.randint(-1, 4), rng.randint(0, 400)], np.int64)
    return [bytes(memoryview(p)) for p in encode_frame(header, payload)]


FIXED_FIELDS = 22  # magic, version, kind, ... n_row_tokens, n_fed, flags (frames.FIXED)
FIELD_LIMITS = (None, 255, 255, 255, 255, 65535, 255, 255, 65535, 2 ** 32 - 1, 2 ** 64 - 1,
                2 ** 64 - 1, 2 ** 32 - 1, 2 ** 32 - 1, 2 ** 32 - 1, 2 ** 32 - 1, 2 ** 32 - 1,
                65535, 65535, 65535, 65535, 255)


def changed_header(rng: random.Random, head: bytes) -> bytes:
    """A frame header with one fixed field set to an edge value: a wrong magic, version,
    kind, dtype, dimension count, huge token/row/error counts, a wrong shape."""
    values = list(FIXED.unpack_from(head))
    index = rng.randrange(FIXED_FIELDS)
    if index == 0:
        values[0] = rng.choice([b"ZCDQ", b"\0\0\0\0", b"GET "])
    else:
        top = FIELD_LIMITS[index]
        values[index] = rng.choice([0, 1, 2, 3, 9, top, top - 1, rng.randint(0, top)])
    rest = head[FIXED.size:]
    if rng.random() < 0.3 and len(rest) >= 4:  # a payload dimension changed too
        at = rng.randrange(0, len(rest) - 3)
        rest = rest[:at] + struct.pack("<I", rng.choice([0, 1, 2 ** 31, 2 ** 32 - 1])) + rest[at + 4:]
    return FIXED.pack(*values) + rest


def data_frame(rng: random.Random, shape: ModelShape) -> Parts:
    """One hostile message for a stage's data PULL."""
    pick = rng.random()
    if pick < 0.1:
        return random_parts(rng, max_bytes=4096)
    seed = frame_seed(rng, shape)
    if pick < 0.4:
        return [mutate(rng, seed[0]), seed[1]]
    if pick < 0.75:
        return [changed_header(rng, seed[0]), seed[1]]
    if pick < 0.85:
        return [seed[0], mutate(rng, seed[1])]
    if pick < 0.95:
        return rng.choice([[seed[0]], [seed[0], seed[1], seed[1]], [seed[1], seed[0]],
                           [b"", b""], [seed[0], b""]])
    return seed  # well-formed, for a stream no generation uses


# -- HTTP ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class HttpCase:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


POSTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
         "/v1/messages/count_tokens", "/tokenize", "/detokenize")
ROUTES = (*POSTS, "/v1/models", "/health", "/metrics", "/v1/responses/resp_0")
ODD_PATHS = ("/", "/v1", "/v1/", "/v2/completions", "/v1/chat/completions/x", "/%00", "/..%2f",
             "/v1/models/../../etc/passwd", "/" + "a" * 4000, "/docs", "/openapi.json")
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "FOO")


def api_body(rng: random.Random, model: str) -> dict[str, Any]:
    """A chat or text completion body, valid but for what ``odd_body`` changes."""
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(1, 3),
                            "temperature": 0.0}
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "the sky is"
    if rng.random() < 0.2:
        body["stream"] = True
    if rng.random() < 0.2:  # what /detokenize takes
        body["tokens"] = [rng.randint(0, 64) for _ in range(rng.randint(0, 8))]
    if "prompt" in body and rng.random() < 0.2:  # the prompt as token ids
        body["prompt"] = [rng.randint(0, 64) for _ in range(rng.randint(1, 8))]
    if "prompt" in body and rng.random() < 0.2:  # a scored prompt
        body.update(echo=True, logprobs=rng.randint(0, 2))
    if rng.random() < 0.1:
        body["repetition_penalty"] = rng.choice([1.0, 1.3, 2.0])
    if rng.random() < 0.3:  # what /v1/responses takes
        body.update(input=rng.choice(["hi", [{"role": "user", "content": "hi"}], [
            {"type": "function_call_output", "call_id": "c", "output": "r"}]]),
            max_output_tokens=rng.randint(1, 3))
    return body


def odd_body(rng: random.Random, body: dict[str, Any]) -> dict[str, Any]:
    key = rng.choice([*sorted(body), "n", "stop", "seed", "top_p", "logprobs", "top_logprobs",
                      "zctl", "stream_options", "messages", "max_completion_tokens", "tokens",
                      "echo", "repetition_penalty", "tools", "tool_choice", "input",
                      "instructions", "text", "include", "previous_response_id",
                      "max_output_tokens", "system", "stop_sequences", "output_config"])
    body[key] = rng.choice([*ODD_VALUES, -5, 10 ** 9, [{"role": "wizard"}],
                            [{"role": "user", "content": [{"type": "image_url"}]}],
                            {"speculative": "draft:/etc"}, {"k": 99}, ["", "a"]])
    return body


def http_case(rng: random.Random, model: str, cap: int) -> HttpCase:
    """One hostile HTTP request (``cap``: the API's body limit; none here reach it)."""
    json_type = {"content-type": "application/json"}
    route = rng.choice(POSTS)
    pick = rng.random()
    if pick < 0.08:  # a valid short generation
        return HttpCase("POST", route, json_type, json.dumps(api_body(rng, model)).encode())
    if pick < 0.4:
        body = json.dumps(odd_body(rng, api_body(rng, model)), allow_nan=True).encode()
        return HttpCase("POST", route, json_type, body)
    if pick < 0.6:
        raw = json.dumps(api_body(rng, model)).encode()
        return HttpCase("POST", route, json_type, mutate(rng, raw))
    if pick < 0.68:
        return HttpCase("POST", route, json_type, rng.randbytes(rng.randint(0, 4096)))
    if pick < 0.76:
        headers = rng.choice([{"content-type": "text/plain"}, {"content-type": "application/json; "
                              "charset=ebcdic"}, {"authorization": "Bearer " + "k" * 2000},
                              {"x-junk": "v" * 8000}, {"content-encoding": "gzip",
                                                              **json_type}, {}])
        return HttpCase("POST", route, headers, json.dumps(api_body(rng, model)).encode())
    if pick < 0.88:
        return HttpCase(rng.choice(METHODS), rng.choice(ROUTES + ODD_PATHS), {},
                        rng.choice([b"", b"{}", rng.randbytes(64)]))
    if pick < 0.96:  # big, under the cap: a long prompt, deep nesting
        big: dict[str, Any] = api_body(rng, model)
        big["prompt" if "prompt" in big else "zctl"] = rng.choice(
            ["word " * (cap // rng.choice([64, 16])), "\x01" * (cap // 8),
             json.loads("[" * 500 + "]" * 500)])
        return HttpCase("POST", route, json_type, json.dumps(big).encode()[:cap - 1])
    return HttpCase("GET", rng.choice(ROUTES[len(POSTS):]), {}, b"")


def over_cap_body(rng: random.Random, model: str, cap: int) -> HttpCase:
    """A completion whose body is just over the API's limit."""
    head = json.dumps({"model": model, "prompt": ""}).encode()[:-2]
    pad = cap + rng.randint(1, 64) - len(head) - 2
    return HttpCase("POST", rng.choice(ROUTES[:2]), {"content-type": "application/json"},
                    head + b"x" * pad + b'"}')

