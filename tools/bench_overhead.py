"""Measure the data plane's per-hop framework overhead on loopback.

overhead per hop = (per-token time - sum of stage compute - wire time) / hops, where the
per-token time is what ``generate_greedy`` sees through a ``ClusterHead`` whose
stages 1.. run as separate worker processes on 127.0.0.2, 127.0.0.3, ..., and the wire
time is, per step, the time frames spent between each sender's send stamp (taken after
encoding, right before the send) and the receiver's arrival stamp: exactly what a raw
ZeroMQ message costs (send/recv calls, I/O threads, kernel, waking the receiver).

Two references calibrate it on the machine at hand:
- raw ping: back-to-back pyzmq ping-pong through as many relay processes, same message
  sizes. Hot caches and no idle wake-ups, so "overhead vs raw ping" (the per-token time
  minus compute minus this) is an upper bound that charges wake-up latency to us.
- bare relay: the least a Python pipeline can do: the same stages in the same processes
  layout, a position and the raw hidden state per message, no validation, epochs or
  timing. "overhead vs bare relay" is what zctl adds on top of that floor.
The paper's Python relay cost 13 ms per token; our target is <= 0.2 ms per hop.

Each thread setting (INFERENCE_NUM_THREADS) is measured separately, with the in-process
LocalChain as the no-network reference; the coordinator's CPU time per token shows
whether anything spins while the coordinator waits for the reply.

``local_host_ms_per_token`` is the in-process chain's own host time per token: decode
time per token minus the stages' run time, i.e. sampling, the session and the step's
inputs between one inference and the next (cold caches right after an inference make
this several times what the same code costs in a tight loop).

    python -m tools.bench_overhead [EXPORT_DIR] [--tokens 64] [--threads default,1] [--json]

Without EXPORT_DIR: SmolLM2-135M in 2 INT4 stages, exported into the cache on first use.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from tools.bench_common import free_port, model_export, timed_greedy
from tools.bench_common import median as bench_median

if TYPE_CHECKING:
    from dataplane.head.cluster_head import ClusterHead
    from dataplane.runtime.config import RuntimeSpec
    from dataplane.wire.timing import StepTiming
    from zctl.engine.stats import GenerationStats

HelperCmd = Callable[[int, str, str], list[str]]  # (stage, bind, send_to) -> argv

HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
KV_CACHE_PRECISION: str | None = None  # the plugin's, as cluster nodes run by default
BARE_HEAD = struct.Struct("<qq")  # position, compute ns so far
BARE_REPLY = struct.Struct("<iq")  # token, compute ns of all stages


@dataclass
class ConfigResult:
    threads: str
    tokens: int
    local_ms_per_token: float
    local_compute_ms: list[float]
    local_host_ms_per_token: float  # decode time per token minus the stages' run time
    cluster_ms_per_token: float
    cluster_compute_ms: list[float]
    transit_ms: float  # in-band: send stamp to arrival stamp, all hops, median per step
    overhead_ms_per_hop: float  # median over decode steps of (step - compute - transit) / hops
    overhead_ms_per_hop_p95: float
    raw_ping_rtt_ms: float
    overhead_ms_per_hop_vs_raw_ping: float
    bare_relay_ms_per_token: float
    bare_relay_non_compute_ms: float  # the floor: a bare relay's step minus its compute
    overhead_ms_per_hop_vs_bare_relay: float
    coordinator_cpu_ms_per_token: float
    frame_bytes: dict[str, int] = field(default_factory=dict)
    breakdown_p50: dict[str, float] = field(default_factory=dict)
    load_avg_1min: tuple[float, float] = (0.0, 0.0)  # before and after: other load skews all


def median(values: list[float]) -> float:
    """The median, NaN when there is nothing to take it of."""
    return bench_median(values, math.nan)


def p95(values: list[float]) -> float:
    return float(np.percentile(values, 95)) if values else float("nan")


def overhead_per_hop(step_ms: list[float], compute_ms: list[list[float]],
                     wire_ms: list[float], hops: int) -> list[float]:
    """Per decode step: (step time - that step's stage compute - wire time) / hops."""
    return [(t - sum(c) - w) / hops for t, c, w in zip(step_ms, compute_ms, wire_ms, strict=True)]


def runtime_config(threads: str) -> RuntimeSpec:
    from dataplane.runtime.config import RuntimeSpec

    # the KV cache the cluster's nodes run by default (and the workers below are told)
    return RuntimeSpec(num_threads=None if threads == "default" else int(threads),
                       kv_cache_precision=KV_CACHE_PRECISION)


# -- processes ------------------------------------------------------------------------
@contextmanager
def spawned(cmd: list[str]) -> Iterator[str]:
    """Run a helper process that prints 'ready <endpoint>' once serving; kill it after."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("ready "):
            raise RuntimeError(f"{' '.join(cmd[:4])}... did not start")
        yield line.split()[1]
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def chain_addresses(stages: int) -> list[str]:
    """Bind addresses of stages 1..stages-1, one loopback host each."""
    return [f"tcp://{HOSTS[i % len(HOSTS)]}:{free_port(HOSTS[i % len(HOSTS)])}"
            for i in range(stages - 1)]


def start_chain(stack: ExitStack, addrs: list[str], reply_addr: str, make_cmd: HelperCmd) -> None:
    """Start a helper per stage 1.. from the last back; make_cmd(i, bind, send_to) -> argv."""
    for i in reversed(range(1, len(addrs) + 1)):
        send_to = addrs[i] if i < len(addrs) else reply_addr
        stack.enter_context(spawned(make_cmd(i, addrs[i - 1], send_to)))


def helper_cmd(*args: Any) -> list[str]:
    return [sys.executable, "-m", "tools.bench_overhead", *(str(a) for a in args)]


@contextmanager
def coordinator_pipes(stages: int, make_cmd: HelperCmd) -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """(push to stage 1, pull for replies) with helper processes for stages 1.. running."""
    from dataplane.wire.transport import bound_endpoint, pull_socket, push_socket

    ctx = zmq.Context.instance()
    pull = pull_socket(ctx, "tcp://127.0.0.1:*")
    with ExitStack() as stack:
        stack.callback(pull.close, 0)
        addrs = chain_addresses(stages)
        start_chain(stack, addrs, bound_endpoint(pull), make_cmd)
        push = push_socket(ctx, addrs[0])
        stack.callback(push.close, 0)
        yield push, pull


# -- references -----------------------------------------------------------------------
def ping_main(bind: str, send_to: str, reply: tuple[int, int]) -> None:
    """A raw PULL -> PUSH relay; with a reply size (header, payload bytes) it answers so."""
    from dataplane.wire.transport import bound_endpoint, pull_socket, push_socket

    ctx = zmq.Context.instance()
    pull, push = pull_socket(ctx, bind), push_socket(ctx, send_to)
    print(f"ready {bound_endpoint(pull)}", flush=True)
    answer = [b"\0" * reply[0], b"\0" * reply[1]] if reply[0] else None
    while True:
        parts = pull.recv_multipart(copy=False)
        push.send_multipart(answer or parts, copy=False)


def raw_ping_ms(stages: int, forward: tuple[int, int], reply: tuple[int, int],
                rounds: int) -> float:
    """Median back-to-back round trip through a relay process per remote stage."""
    def cmd(i: int, bind: str, send_to: str) -> list[str]:
        size = reply if i == stages - 1 else (0, 0)
        return helper_cmd("--ping", bind, send_to, "--reply-bytes", *size)

    with coordinator_pipes(stages, cmd) as (push, pull):
        message = [b"\0" * forward[0], b"\0" * forward[1]]
        samples = []
        for i in range(rounds):
            start = time.perf_counter()
            push.send_multipart(message)
            pull.recv_multipart(copy=False)
            if i >= rounds // 10:
                samples.append((time.perf_counter() - start) * 1e3)
    return median(samples)


def bare_main(export: str, stage: int, threads: str, bind: str, send_to: str) -> None:
    """One stage behind a bare relay: position + raw hidden state in, the same (or the
    greedy token) out, with the stages' compute time summed along."""
    from dataplane.runtime.stateful import StageRunner
    from dataplane.wire.transport import bound_endpoint, pull_socket, push_socket

    runner = StageRunner(export, stage, runtime_config(threads))
    runner.open_stream(0)
    ctx = zmq.Context.instance()
    pull, push = pull_socket(ctx, bind), push_socket(ctx, send_to)
    print(f"ready {bound_endpoint(pull)}", flush=True)
    while True:
        head, body = pull.recv_multipart(copy=False)
        position, compute = BARE_HEAD.unpack(head.buffer)
        x = np.frombuffer(body.buffer, np.float32).reshape(1, 1, -1)
        start = time.perf_counter_ns()
        out = runner.step(0, x, np.array([position]))
        compute += time.perf_counter_ns() - start
        if runner.spec.last:
            push.send(BARE_REPLY.pack(int(out.argmax()), compute))
        else:
            push.send_multipart([BARE_HEAD.pack(position, compute), out])


def bare_relay(export: str, stages: int, threads: str, tokens: int) -> tuple[float, float]:
    """(ms per token, ms per token minus all compute) of greedy decoding via bare relays."""
    from dataplane.runtime.stateful import StageRunner

    def cmd(i: int, bind: str, send_to: str) -> list[str]:
        return helper_cmd("--bare", export, i, threads, bind, send_to)

    first = StageRunner(export, 0, runtime_config(threads))
    first.open_stream(0)
    with coordinator_pipes(stages, cmd) as (push, pull):
        token, steps, rest = 1, [], []
        for position in range(tokens + 8):
            start = time.perf_counter_ns()
            hidden = first.step(0, np.array([[token]]), np.array([position]))
            compute = time.perf_counter_ns() - start
            push.send_multipart([BARE_HEAD.pack(position, 0), hidden])
            token, remote = BARE_REPLY.unpack(pull.recv())
            elapsed = time.perf_counter_ns() - start
            if position >= 8:
                steps.append(elapsed / 1e6)
                rest.append((elapsed - compute - remote) / 1e6)
    return median(steps), median(rest)


# -- the measured pipelines -----------------------------------------------------------
def host_ms_per_token(stats: Any) -> float:
    """Decode wall time per token not spent in the stages' run(): the host's share."""
    steps = stats.stage_ms  # decode steps only, as decode_ms
    if not steps or stats.new_tokens < 2:
        return 0.0
    return stats.decode_ms / (stats.new_tokens - 1) - sum(map(sum, steps)) / len(steps)


def run_local(export: str, threads: str, prompt: list[int], tokens: int
              ) -> tuple[list[int], GenerationStats]:
    """Greedy decoding through the in-process chain (warmed up): tokens and figures."""
    from dataplane.head.local_chain import LocalChain

    chain = LocalChain.load(export, runtime_config(threads))
    timed_greedy(chain, prompt, 8)  # warm-up
    return timed_greedy(chain, prompt, tokens)


@contextmanager
def cluster_pipeline(export: str, stages: int, threads: str = "default",
                     kv_cache_precision: str | None = KV_CACHE_PRECISION
                     ) -> Iterator[ClusterHead]:
    """A ClusterHead running stage 0 here and stages 1.. as ``dataplane.worker``
    processes on 127.0.0.2, ...; the workers stop on exit. ``kv_cache_precision`` None
    keeps the plugin's."""
    from dataplane.head.cluster_head import ClusterHead
    from dataplane.runtime.load import load_runner

    with ExitStack() as stack:
        addrs = chain_addresses(stages)
        config = replace(runtime_config(threads), kv_cache_precision=kv_cache_precision)
        pipe = ClusterHead(load_runner(export, 0, config), addrs[0],
                               "tcp://127.0.0.1:*", timeout_s=60)
        stack.callback(pipe.close)

        def cmd(i: int, bind: str, send_to: str) -> list[str]:
            extra = ["--kv-cache-precision", kv_cache_precision or "default"]
            extra += [] if threads == "default" else ["--threads", threads]
            return [sys.executable, "-m", "dataplane.worker", export, "--stage", str(i),
                    "--bind", bind, "--send-to", send_to, *extra]

        start_chain(stack, addrs, pipe.reply_endpoint, cmd)
        yield pipe


def run_cluster(export: str, stages: int, threads: str, prompt: list[int], tokens: int
                ) -> tuple[list[int], GenerationStats, list[StepTiming], float]:
    """Greedy decoding through a cluster pipeline (warmed up): tokens, figures, each
    decode step's timing record, the coordinator's CPU ms."""
    with cluster_pipeline(export, stages, threads) as pipe:
        timed_greedy(pipe, prompt, 8)  # warm-up
        pipe.timings.clear()
        cpu0 = time.process_time()
        out, stats = timed_greedy(pipe, prompt, tokens)
        cpu_ms = (time.process_time() - cpu0) * 1e3
        timings = pipe.timings.samples()[-len(stats.step_ms):]
        return out, stats, timings, cpu_ms


def frame_sizes(hidden_size: int, stages: int) -> dict[str, int]:
    """Bytes of a decode step's frames: stage 0's forward hop and the last stage's top-1 reply."""
    from dataplane.wire.frames import TOPK_DTYPE, HiddenStateFrame, Kind, encode_frame, stamp

    timings = stamp(b"", 0, 0, 0, 0, 0, 0, 0)
    header = HiddenStateFrame(Kind.STEP, 0, 1, 1, positions=np.zeros(1, np.int64),
                              timings=timings)
    fwd = encode_frame(header, np.zeros((1, 1, hidden_size), np.float32))
    back = encode_frame(HiddenStateFrame(Kind.REPLY, 0, 1, 1, timings=timings * stages),
                        np.zeros((1, 1), TOPK_DTYPE))
    return {"forward_header": len(fwd[0]), "forward_payload": fwd[1].nbytes,
            "reply_header": len(back[0]), "reply_payload": back[1].nbytes}


def measure(export: str, threads: str, tokens: int, prompt_len: int,
            rounds: int) -> ConfigResult:
    from dataplane.wire.timing import flatten, percentiles
    from zctl.manifest import load_manifest

    load_before = os.getloadavg()[0]
    manifest = load_manifest(export, verify_files=False)
    stages = len(manifest.stages)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(10, manifest.model.vocab_size - 10, prompt_len)]
    local_out, local = run_local(export, threads, prompt, tokens)
    out, stats, timings, cpu_ms = run_cluster(export, stages, threads, prompt, tokens)
    if out != local_out:
        raise RuntimeError("cluster tokens differ from LocalChain's: the benchmark is invalid")
    bare_ms, bare_rest = bare_relay(export, stages, threads, tokens)
    sizes = frame_sizes(manifest.model.hidden_size, stages)
    ping = raw_ping_ms(stages, (sizes["forward_header"], sizes["forward_payload"]),
                       (sizes["reply_header"], sizes["reply_payload"]), rounds)
    compute = [list(t.compute_ms) for t in timings]
    transit = [t.transit_ms for t in timings]
    per_hop = overhead_per_hop(stats.step_ms, compute, transit, hops=stages)
    per_hop_ping = overhead_per_hop(stats.step_ms, compute, [ping] * len(compute), stages)
    breakdown = percentiles([flatten(t) for t in timings], (50,))
    rest = median([t - sum(c) for t, c in zip(stats.step_ms, compute, strict=True)])
    return ConfigResult(
        threads=threads, tokens=len(out),
        local_ms_per_token=median(local.step_ms),
        local_compute_ms=[median([s[i] for s in local.stage_ms]) for i in range(stages)],
        local_host_ms_per_token=host_ms_per_token(local),
        cluster_ms_per_token=median(stats.step_ms),
        cluster_compute_ms=[median([c[i] for c in compute]) for i in range(stages)],
        transit_ms=median(transit), overhead_ms_per_hop=median(per_hop),
        overhead_ms_per_hop_p95=p95(per_hop), raw_ping_rtt_ms=ping,
        overhead_ms_per_hop_vs_raw_ping=median(per_hop_ping),
        bare_relay_ms_per_token=bare_ms, bare_relay_non_compute_ms=bare_rest,
        overhead_ms_per_hop_vs_bare_relay=(rest - bare_rest) / stages,
        coordinator_cpu_ms_per_token=cpu_ms / max(1, len(out)),
        frame_bytes=sizes, breakdown_p50={k: v["p50"] for k, v in breakdown.items()},
        load_avg_1min=(load_before, os.getloadavg()[0]),
    )


def print_table(export: str, results: list[ConfigResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"data-plane overhead on loopback: {export} (ms)")
    for name in ("threads", "per token: local | zctl | bare", "local host", "compute: zctl | local",
                 "transit", "overhead/hop p50", "p95", "vs raw ping", "vs bare relay",
                 "coord CPU/token", "load"):
        table.add_column(name, justify="right")
    for r in results:
        table.add_row(
            r.threads, f"{r.local_ms_per_token:.2f} | {r.cluster_ms_per_token:.2f} | "
                       f"{r.bare_relay_ms_per_token:.2f}",
            f"{r.local_host_ms_per_token:.3f}",
            " + ".join(f"{c:.2f}" for c in r.cluster_compute_ms) + " | "
            + " + ".join(f"{c:.2f}" for c in r.local_compute_ms),
            f"{r.transit_ms:.3f}", f"{r.overhead_ms_per_hop:.3f}",
            f"{r.overhead_ms_per_hop_p95:.3f}",
            f"{r.overhead_ms_per_hop_vs_raw_ping:.3f} ({r.raw_ping_rtt_ms:.3f})",
            f"{r.overhead_ms_per_hop_vs_bare_relay:.3f}",
            f"{r.coordinator_cpu_ms_per_token:.2f}", "/".join(f"{x:.1f}" for x in r.load_avg_1min),
        )
    console = Console(width=160)
    console.print(table)
    for r in results:
        parts = {k: round(v, 3) for k, v in r.breakdown_p50.items() if k.startswith("hop")}
        console.print(f"threads={r.threads} per hop p50: {parts}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_overhead",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("export_dir", nargs="?", default=None,
                        help="a 2+ stage export (default: SmolLM2 in 2 INT4 stages, cached)")
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per run")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", default="default,1",
                        help="comma-separated INFERENCE_NUM_THREADS settings ('default' = plugin)")
    parser.add_argument("--rounds", type=int, default=500, help="raw ping round trips")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--ping", nargs=2, metavar=("BIND", "SEND_TO"), help=argparse.SUPPRESS)
    parser.add_argument("--reply-bytes", type=int, nargs=2, default=(0, 0),
                        help=argparse.SUPPRESS)
    parser.add_argument("--bare", nargs=5, metavar=("EXPORT", "STAGE", "THREADS", "BIND",
                                                    "SEND_TO"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ping:
        ping_main(args.ping[0], args.ping[1], tuple(args.reply_bytes))
        return 0
    if args.bare:
        export, stage, threads, bind, send_to = args.bare
        bare_main(export, int(stage), threads, bind, send_to)
        return 0
    if args.export_dir is None:
        args.export_dir = str(model_export("smollm2-135m", 2, "int4"))
    if not Path(args.export_dir, "manifest.json").is_file():
        parser.error(f"{args.export_dir} is not an export directory")
    results = [measure(args.export_dir, t.strip(), args.tokens, args.prompt_len, args.rounds)
               for t in args.threads.split(",")]
    if args.json:
        report: dict[str, Any] = {
            "export": args.export_dir,
            "overhead_ms_per_hop": results[0].overhead_ms_per_hop,
            "target_ms_per_hop": 0.2,
            "configs": [asdict(r) for r in results],
        }
        print(json.dumps(report, indent=2))
    else:
        print_table(args.export_dir, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
