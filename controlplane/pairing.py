"""Pairing a node with a CURVE cluster by a short one-time code, no key files copied.

The coordinator's machine runs a ``PairingDesk`` (``zctl cluster pair``) for a few minutes;
the node (``zctl node join --pair CODE``) runs ``pair``. Both run SPAKE2 (the ``spake2``
package) on the code, so each ends with the same key only if both hold the same code,
and nothing sent lets an eavesdropper test guesses offline. Then:

1. node -> desk: its SPAKE2 message;
2. desk -> node: the desk's SPAKE2 message;
3. node -> desk: its CURVE public key and an HMAC of the transcript and that key under
   the shared key (proof that it holds the code);
4. desk -> node, only if that proof holds: the coordinator's public key and the desk's own
   HMAC (proof to the node that this is the desk that made the code). The desk admits the
   node's key (as ``cluster authorize`` does) and closes: a code works once.

A wrong proof gets ``refused`` and nothing else; after each one the desk refuses every
attempt for a while (``Attempts``: 1 s, doubling), and after ``MAX_FAILURES`` it closes,
the code spent. The messages are JSON in single ZeroMQ frames on a plain (not CURVE)
ROUTER: everything in them is public or bound to the code.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from spake2 import SPAKE2_A, SPAKE2_B

from controlplane.security import key_fingerprint
from dataplane.wire.transport import is_z85_key

PAIR_PORT = 5549  # the desk's default port, beside the default control port 5550
CODE_DIGITS = 8
MAX_FAILURES = 5
FIRST_COOLDOWN_S = 1.0
MAX_MESSAGE = 4096
NODE_ID = b"zctl node"
DESK_ID = b"zctl coordinator"


class PairingError(RuntimeError):
    """Pairing did not happen; the message says why."""


def new_code() -> str:
    """A one-time code of ``CODE_DIGITS`` random digits, as ``1234-5678``."""
    digits = f"{secrets.randbelow(10 ** CODE_DIGITS):0{CODE_DIGITS}d}"
    return f"{digits[:4]}-{digits[4:]}"


def normal_code(text: str) -> str:
    """The digits of a code as typed (spaces and dashes dropped); ValueError if it is not one."""
    digits = "".join(ch for ch in text if ch not in " -")
    if len(digits) != CODE_DIGITS or not digits.isascii() or not digits.isdigit():
        raise ValueError(f"a pairing code is {CODE_DIGITS} digits (1234-5678), not {text!r}")
    return digits


def _proof(key: bytes, role: bytes, transcript: bytes, public: bytes) -> str:
    return hmac.new(key, role + b"\0" + transcript + b"\0" + public, hashlib.sha256).hexdigest()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: object) -> bytes:
    if not isinstance(text, str) or len(text) > MAX_MESSAGE:
        raise ValueError("not a base64 string")
    return base64.b64decode(text, validate=True)


def _message(frame: bytes) -> dict:
    if len(frame) > MAX_MESSAGE:
        raise ValueError(f"a {len(frame)}-byte message")
    body = json.loads(frame)
    if not isinstance(body, dict):
        raise ValueError("not a JSON object")
    return body


def _z85_key(value: object) -> bytes:
    """A Z85 CURVE public key (40 characters); ValueError otherwise."""
    key = value.encode("ascii", "replace") if isinstance(value, str) else b""
    if not is_z85_key(key):
        raise ValueError("not a 40-character Z85 key")
    return key


@dataclass
class Attempts:
    """The desk's count of wrong proofs: after each, a cooldown that doubles; after
    ``limit``, closed. Pure, given the clock readings."""

    limit: int = MAX_FAILURES
    first_cooldown: float = FIRST_COOLDOWN_S
    failures: int = 0
    blocked_until: float = 0.0

    @property
    def spent(self) -> bool:
        return self.failures >= self.limit

    def wait(self, now: float) -> float:
        """Seconds until an attempt is heard again (0: now)."""
        return max(0.0, self.blocked_until - now)

    def failed(self, now: float) -> None:
        self.failures += 1
        self.blocked_until = now + self.first_cooldown * 2 ** (self.failures - 1)


@dataclass
class Paired:
    """A pairing that happened: the other side's public key."""

    public: bytes
    node_id: str = ""

    @property
    def fingerprint(self) -> str:
        return key_fingerprint(self.public)


@dataclass
class _Session:
    """One node's exchange between its hello and its proof."""

    inbound: bytes
    outbound: bytes
    key: bytes


class PairingDesk:
    """The coordinator's side: serves one code on ``endpoint`` until a node pairs (its
    key admitted by ``admit``), the code expires, or too many wrong proofs spend it."""

    def __init__(self, endpoint: str, code: str, public: bytes,
                 admit: Callable[[Paired], None], valid_s: float = 300.0,
                 attempts: Attempts | None = None) -> None:
        self.endpoint = endpoint
        self.code = normal_code(code).encode()
        self.public = public
        self.admit = admit
        self.deadline = time.monotonic() + valid_s
        self.attempts = attempts or Attempts()
        self.sessions: dict[bytes, _Session] = {}
        self.counters = dict.fromkeys(("malformed", "refused", "rate_limited"), 0)
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None

    def bind(self) -> str:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise PairingError(f"cannot listen for pairing on {self.endpoint}: {exc}") from None
        self._sock = sock
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def serve(self, stop: Callable[[], bool] = lambda: False) -> Paired:
        """Answer nodes until one pairs; PairingError when the code expires or is spent."""
        if self._sock is None:
            self.bind()
        assert self._sock is not None
        try:
            while not stop():
                now = time.monotonic()
                if now >= self.deadline:
                    raise PairingError("the pairing code expired; zctl cluster pair makes another")
                if not self._sock.poll(200):
                    continue
                frames = self._sock.recv_multipart()
                if len(frames) != 2:
                    self.counters["malformed"] += 1
                    continue
                paired = self._answer(frames[0], frames[1], time.monotonic())
                if paired is not None:
                    return paired
                if self.attempts.spent:
                    raise PairingError(f"{self.attempts.failures} wrong codes: pairing closed "
                                       "and the code spent")
            raise PairingError("pairing stopped")
        finally:
            self.close()

    def _reply(self, identity: bytes, body: dict) -> None:
        assert self._sock is not None
        self._sock.send_multipart([identity, json.dumps(body).encode()])

    def _answer(self, identity: bytes, frame: bytes, now: float) -> Paired | None:
        try:
            body = _message(frame)
            step = body.get("step")
            if step == "hello":
                wait = self.attempts.wait(now)
                if wait > 0:
                    self.counters["rate_limited"] += 1
                    self._reply(identity, {"error": "rate-limited", "retry_s": round(wait, 1)})
                    return None
                inbound = _unb64(body.get("spake"))
                spake = SPAKE2_B(self.code, idA=NODE_ID, idB=DESK_ID)
                outbound = spake.start()
                key = spake.finish(inbound)
                if len(self.sessions) > 16:
                    self.sessions.pop(next(iter(self.sessions)))
                self.sessions[identity] = _Session(inbound, outbound, key)
                self._reply(identity, {"step": "hello", "spake": _b64(outbound)})
                return None
            if step == "proof":
                session = self.sessions.pop(identity, None)
                if session is None:
                    raise ValueError("a proof before a hello")
                public = _z85_key(body.get("key"))
                transcript = session.inbound + session.outbound
                expected = _proof(session.key, b"node", transcript, public)
                if not hmac.compare_digest(expected, str(body.get("proof", ""))):
                    self.attempts.failed(now)
                    self.counters["refused"] += 1
                    self._reply(identity, {"error": "refused"})
                    return None
                node_id = str(body.get("node_id", ""))[:80]
                paired = Paired(public, node_id)
                self.admit(paired)
                self._reply(identity, {"step": "welcome", "key": self.public.decode(),
                                       "proof": _proof(session.key, b"coordinator", transcript,
                                                       self.public)})
                return paired
            raise ValueError(f"unknown step {step!r}")
        except Exception as exc:  # noqa: BLE001 - whatever a stranger sends is answered
            # with an error and forgotten; the desk goes on
            self.counters["malformed"] += 1
            self.sessions.pop(identity, None)
            self._reply(identity, {"error": f"malformed: {str(exc)[:100]}"})
            return None


def pair(endpoint: str, code: str, public: bytes, node_id: str = "", timeout: float = 10.0,
         ctx: zmq.Context | None = None) -> Paired:
    """The node's side: pair with the desk at ``endpoint`` by ``code``, offering this
    node's CURVE ``public`` key; the coordinator's key, proven to come from the desk that
    made the code. PairingError says why not (a wrong code, rate-limited, no desk)."""
    digits = normal_code(code).encode()
    spake = SPAKE2_A(digits, idA=NODE_ID, idB=DESK_ID)
    outbound = spake.start()
    context = ctx or zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
    sock.connect(endpoint)

    def ask(body: dict) -> dict:
        sock.send(json.dumps(body).encode())
        if not sock.poll(int(timeout * 1000)):
            raise PairingError(f"no pairing desk answered at {endpoint} within {timeout:g} s "
                               "(is zctl cluster pair running on the coordinator?)")
        try:
            answer = _message(sock.recv())
        except ValueError as exc:
            raise PairingError(f"the desk at {endpoint} sent a malformed answer: {exc}") from None
        if answer.get("error") == "rate-limited":
            raise PairingError(f"rate-limited after wrong codes: try again in "
                               f"{answer.get('retry_s')} s")
        if answer.get("error") == "refused":
            raise PairingError("the pairing code is wrong (or spent): nothing was exchanged")
        if "error" in answer:
            raise PairingError(f"the desk refused: {answer['error']}")
        return answer

    try:
        hello = ask({"step": "hello", "spake": _b64(outbound)})
        try:
            inbound = _unb64(hello.get("spake"))
            key = spake.finish(inbound)
        except Exception as exc:  # noqa: BLE001 - a desk's bad SPAKE2 message
            raise PairingError(f"the desk's key exchange failed: {exc}") from None
        transcript = outbound + inbound
        welcome = ask({"step": "proof", "key": public.decode(), "node_id": node_id,
                       "proof": _proof(key, b"node", transcript, public)})
        try:
            server = _z85_key(welcome.get("key"))
        except ValueError as exc:
            raise PairingError(f"the desk sent no usable key: {exc}") from None
        expected = _proof(key, b"coordinator", transcript, server)
        if not hmac.compare_digest(expected, str(welcome.get("proof", ""))):
            raise PairingError("the desk could not prove it holds the code: not trusted")
        return Paired(server)
    finally:
        sock.close(0)
