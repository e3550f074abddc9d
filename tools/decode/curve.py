"""What CURVE costs a data-plane hop: frame-sized ping-pong over two PUSH/PULL pipes (the
data plane's own sockets, dataplane.wire.transport) with and without CURVE, alternated run by
run in one process; prints the median round trip of each and their ratio.

    python -m tools.decode.curve [--runs 5] [--messages 3000] [--json]
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from typing import Annotated

import typer
import zmq

from dataplane.wire.transport import (
    PipeCurve,
    PipeOptions,
    bound_endpoint,
    close_gate,
    pull_socket,
    push_socket,
)
from tools.harness.options import Json
from tools.harness.order import rotated
from tools.harness.stats import paired_ratio, rounded

HEADER, PAYLOAD = b"h" * 130, b"x" * 2304  # a 1-token SmolLM2 step frame


def round_trip_us(curve: bool, messages: int) -> float:
    """Median round trip (us) of a header+payload frame to an echo thread and back."""
    a, b = zmq.curve_keypair(), zmq.curve_keypair()
    ctx = zmq.Context()
    opts_a = opts_b = PipeOptions()
    if curve:
        opts_a = PipeOptions(curve=PipeCurve(*a, peer=b[0], admit=frozenset({b[0]})))
        opts_b = PipeOptions(curve=PipeCurve(*b, peer=a[0], admit=frozenset({a[0]})))
    inbox_a = pull_socket(ctx, "tcp://127.0.0.1:*", opts_a)
    inbox_b = pull_socket(ctx, "tcp://127.0.0.1:*", opts_b)
    to_b, to_a = push_socket(ctx, bound_endpoint(inbox_b), opts_a), push_socket(
        ctx, bound_endpoint(inbox_a), opts_b)

    def echo() -> None:
        while (frame := inbox_b.recv_multipart())[0] != b"stop":
            to_a.send_multipart(frame)

    thread = threading.Thread(target=echo)
    thread.start()
    times = []
    try:
        for _ in range(messages):
            start = time.perf_counter()
            to_b.send_multipart([HEADER, PAYLOAD])
            inbox_a.recv_multipart()
            times.append(time.perf_counter() - start)
    finally:
        to_b.send(b"stop")
        thread.join()
        for sock in (inbox_a, inbox_b, to_a, to_b):
            sock.close(0)
        close_gate(ctx)
        ctx.term()
    return statistics.median(times[messages // 10:]) * 1e6


def main(runs: Annotated[int, typer.Option(help="alternated runs of each")] = 5,
         messages: Annotated[int, typer.Option(help="round trips per run")] = 3000,
         as_json: Json = False) -> None:
    plain, curve = [], []
    for run in range(runs):  # alternate which goes first
        for use_curve in rotated((False, True), run):
            (curve if use_curve else plain).append(round_trip_us(use_curve, messages))
    result = {"plain_rtt_us": round(statistics.median(plain), 1),
              "curve_rtt_us": round(statistics.median(curve), 1),
              "curve_over_plain": rounded(paired_ratio(curve, plain)),
              "samples": {"plain": [round(v, 1) for v in plain],
                          "curve": [round(v, 1) for v in curve]}}
    print(json.dumps(result) if as_json else
          f"round trip: plain {result['plain_rtt_us']} us, CURVE {result['curve_rtt_us']} us "
          f"({result['curve_over_plain']}x, median of paired runs)")


if __name__ == "__main__":
    typer.run(main)
