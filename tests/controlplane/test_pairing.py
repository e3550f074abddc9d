"""Pairing by a one-time code (controlplane.pairing): the right code exchanges both keys,
each side proven to hold the code; a wrong one gets nothing, is rate-limited and spends
the code after a few; a code works once; garbage never stops the desk. In-process, on
loopback."""

from __future__ import annotations

import json
import threading
import time

import pytest
import zmq
import zmq.auth

from controlplane.pairing import (
    Attempts,
    Paired,
    PairingDesk,
    PairingError,
    new_code,
    normal_code,
    pair,
)

NODE_PUB, _ = zmq.curve_keypair()
DESK_PUB, _ = zmq.curve_keypair()


class Desk:
    """A desk serving on a thread; ``result`` is what serve() returned or raised."""

    def __init__(self, code: str, valid_s: float = 30.0, attempts: Attempts | None = None) -> None:
        self.admitted: list[Paired] = []
        self.desk = PairingDesk("tcp://127.0.0.1:*", code, DESK_PUB, self.admitted.append,
                                valid_s, attempts)
        self.endpoint = self.desk.bind()
        self.result: Paired | PairingError | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.result = self.desk.serve()
        except PairingError as exc:
            self.result = exc


def test_codes_are_eight_digits_read_as_typed():
    code = new_code()
    assert len(code) == 9 and code[4] == "-" and normal_code(code) == code.replace("-", "")
    assert normal_code(" 1234 5678 ") == "12345678"
    for bad in ("1234-567", "1234-56789", "abcd-efgh", "١٢٣٤٥٦٧٨"):
        with pytest.raises(ValueError, match="8 digits"):
            normal_code(bad)


def test_the_right_code_exchanges_the_keys_once():
    desk = Desk("1234-5678")
    got = pair(desk.endpoint, "12345678", NODE_PUB, node_id="pc2-1")
    desk.thread.join(5)
    assert got.public == DESK_PUB
    assert isinstance(desk.result, Paired) and desk.result.public == NODE_PUB
    assert desk.admitted == [Paired(NODE_PUB, "pc2-1")]
    assert len(got.fingerprint) == 64
    with pytest.raises(PairingError, match="no pairing desk answered"):  # used: gone
        pair(desk.endpoint, "1234-5678", NODE_PUB, timeout=0.5)


def test_a_wrong_code_gets_nothing_is_rate_limited_and_spends_the_code():
    desk = Desk("1111-2222", attempts=Attempts(limit=3, first_cooldown=0.3))
    with pytest.raises(PairingError, match="code is wrong"):
        pair(desk.endpoint, "1111-2223", NODE_PUB)
    with pytest.raises(PairingError, match="rate-limited after wrong codes: try again in"):
        pair(desk.endpoint, "1111-2222", NODE_PUB)  # even the right one, during the cooldown
    assert desk.admitted == []
    time.sleep(0.35)
    with pytest.raises(PairingError, match="code is wrong"):
        pair(desk.endpoint, "9999-9999", NODE_PUB)
    time.sleep(0.65)
    with pytest.raises(PairingError, match="code is wrong"):
        pair(desk.endpoint, "9999-9998", NODE_PUB)
    desk.thread.join(5)
    assert isinstance(desk.result, PairingError) and "3 wrong codes" in str(desk.result)
    assert desk.admitted == [] and desk.desk.counters["refused"] == 3


def test_garbage_is_answered_and_the_desk_pairs_on():
    desk = Desk("5555-6666")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(desk.endpoint)
    try:
        for junk in (b"\xff", b"[]", json.dumps({"step": "hello", "spake": "!!"}).encode(),
                     json.dumps({"step": "hello", "spake": "QUJD"}).encode(),
                     json.dumps({"step": "proof", "key": "x", "proof": "y"}).encode(),
                     json.dumps({"step": "warp"}).encode(), b"x" * 5000):
            sock.send(junk)
            if len(junk) <= 4096:  # a frame over the limit is dropped by ZeroMQ, unanswered
                assert sock.poll(3000)
                assert "error" in json.loads(sock.recv())
    finally:
        sock.close(0)
    got = pair(desk.endpoint, "5555-6666", NODE_PUB)
    assert got.public == DESK_PUB and desk.desk.counters["refused"] == 0


def test_an_expired_code_closes_the_desk():
    desk = Desk("7777-8888", valid_s=0.2)
    desk.thread.join(5)
    assert isinstance(desk.result, PairingError) and "expired" in str(desk.result)


def test_attempts_cool_down_doubling():
    a = Attempts(limit=3, first_cooldown=1.0)
    assert a.wait(0.0) == 0.0
    a.failed(10.0)
    assert a.wait(10.5) == 0.5 and not a.spent
    a.failed(11.0)
    assert a.wait(11.0) == 2.0
    a.failed(13.0)
    assert a.spent
