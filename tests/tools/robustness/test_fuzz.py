"""tools.robustness.fuzz: its message generators (seeded, valid seeds that the product's own
decoders accept, mutations that stay under each socket's cap), the raw ZMTP peer, and
(slow) a small live run on a tiny cluster: 0 crashes, the outputs unchanged, nothing for
an unknown CURVE key."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import typer
import zmq
from typer.testing import CliRunner

from controlplane.messages import PROTOCOL_VERSION, from_frames
from dataplane.wire.frames import decode_frame
from tools.robustness.fuzz import main
from tools.robustness.fuzz_messages import (
    ModelShape,
    control_seeds,
    data_frame,
    frame_seed,
    http_case,
    json_message,
    mutate,
    over_cap,
    over_cap_body,
    service_seeds,
)
from tools.robustness.fuzz_send import zmtp_dropped

SHAPE = ModelShape(hidden=64, vocab=384)


def test_the_seeds_are_valid_messages() -> None:
    for parts in control_seeds() + service_seeds():
        from_frames(parts)  # raises MessageError if the product would refuse it
    rng = random.Random(1)
    for _ in range(200):
        decode_frame(frame_seed(rng, SHAPE))


def test_the_same_seed_gives_the_same_messages_and_none_reaches_the_cap() -> None:
    def run(seed: int) -> list:
        rng = random.Random(seed)
        return ([json_message(rng, control_seeds(), 1 << 20) for _ in range(300)]
                + [data_frame(rng, SHAPE) for _ in range(300)]
                + [http_case(rng, "m", 1 << 20) for _ in range(300)])

    first = run(7)
    assert first == run(7) and first != run(8)
    frames = [p for parts in first[:300] for p in parts]
    assert max(len(p) for p in frames) < 1 << 20
    assert max(len(case.body) for case in first[600:]) < 1 << 20
    kinds = {type(p) for parts in first[:600] for p in parts}
    assert kinds == {bytes}


def test_mutations_change_the_bytes_and_over_cap_is_just_over() -> None:
    rng = random.Random(3)
    data = b'{"protocol":%d,"type":"status_request","body":{}}' % PROTOCOL_VERSION
    changed = [mutate(rng, data) for _ in range(200)]
    assert sum(c != data for c in changed) >= 190
    assert all(1 << 10 < len(over_cap(rng, 1 << 10)[0]) <= (1 << 10) + 64 for _ in range(20))
    big = over_cap_body(rng, "m", 1 << 12)
    assert 1 << 12 < len(big.body) <= (1 << 12) + 64 and json.loads(big.body)["model"] == "m"


@pytest.mark.parametrize("kind, peer", [(zmq.PULL, "PUSH"), (zmq.ROUTER, "DEALER")])
def test_a_listener_drops_a_peer_announcing_a_frame_over_its_cap(kind: int, peer: str) -> None:
    """The raw ZMTP peer is dropped when it announces more than MAXMSGSIZE, and not when it
    announces less (so a drop is the cap's doing)."""
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        address = f"tcp://127.0.0.1:{port}"
        assert zmtp_dropped(address, peer, (1 << 16) + 1)
        assert zmtp_dropped(address, peer, (1 << 63) - 1)
        assert not zmtp_dropped(address, peer, 1 << 15, timeout_s=1.0)
    finally:
        sock.close(0)
        ctx.term()


def test_bad_options_are_refused_before_anything_starts() -> None:
    app = typer.Typer()
    app.command()(main)
    for args in (["--messages", "0"], ["--nodes", "4"]):
        assert CliRunner().invoke(app, args).exit_code == 2


@pytest.mark.e2e
def test_a_small_live_run_on_a_tiny_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path))
    app = typer.Typer()
    app.command()(main)
    result = CliRunner().invoke(app, ["--messages", "300", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    sockets = out["sockets"]
    kinds = {name.split(" ")[0] for name in sockets}
    assert kinds == {"control", "service", "data", "HTTP"} and len(sockets) == 5
    for name, s in sockets.items():
        assert s["messages"] == 300 and s["crashes"] == 0, (name, s)
        assert s["serving_after"] and s["outputs_unchanged_after"], (name, s)
        assert all(s.get("caps", {}).values()), (name, s)
    assert sockets["control ROUTER"]["replies"] > 0 and sockets["HTTP API"]["replies"] == 303
    assert out["crashes"] == 0 and out["outputs_unchanged"] and out["processes_alive"]
    assert out["curve_unknown_key_replies"] == 0
    curve = out["curve"]
    assert curve["serving_after"] and curve["outputs_unchanged"] and curve["processes_alive"]
    assert all(p["refused_handshakes"] > 0 for p in curve["probes"].values()), curve
