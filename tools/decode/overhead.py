"""Measure the data plane's per-hop framework overhead on loopback.

overhead per hop = (step time - stage compute - wire time) / hops, per decode step, as the
data plane publishes it (its executor's timing summary: ``overhead`` is a step's time on
the coordinator less the stages' compute and less the time its frames spent between each
sender's send stamp, taken after encoding, right before the send, and the receiver's
arrival stamp: exactly what a raw ZeroMQ message costs, send/recv calls, I/O threads,
kernel, waking the receiver). The cluster is a local cluster's data plane
(``zctl.launcher.data_plane.local_data_plane``): stage 0 in this process, stages 1.. as
stage-worker processes on 127.0.0.2, 127.0.0.3, ..., stepped greedily token by token.

Two references calibrate it on the machine at hand:
- raw ping: back-to-back pyzmq ping-pong through as many relay processes, the same message
  sizes (``frame_bytes``: what one decode step puts on the first and on the last hop, as
  the data plane counts them). Hot caches and no idle wake-ups, so "overhead vs raw ping"
  (the per-token time minus compute minus this) is an upper bound that charges wake-up
  latency to us.
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

    python -m tools.decode.overhead [EXPORT_DIR] [--tokens 64] [--threads default,1] [--json]

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from dataplane.runtime.config import RuntimeSpec
from tools.harness.greedy import greedy_step, start_stream, timed_greedy
from tools.harness.models import model_export
from tools.harness.stats import median as bench_median
from zctl.launcher.local import free_port

if TYPE_CHECKING:
    from dataplane.runtime.config import RuntimeSpec
    from zctl.engine.stats import GenerationStats

HelperCmd = Callable[[int, str, str], list[str]]  # (stage, bind, send_to) -> argv

HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
KV_CACHE_PRECISION: str | None = None  # the plugin's, as cluster nodes run by default
BARE_HEAD = struct.Struct("<qq")  # position, compute ns so far
BARE_REPLY = struct.Struct("<iq")  # token, compute ns of all stages
HIDDEN_BYTES = 4  # a hidden state's element on the wire: float32
TOP1_BYTES = 8  # a greedy reply's payload: the top-1 (token, logit) record (zctl.engine.payloads)
STREAM = 7  # the cluster's measured stream


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


def runtime_spec_of(threads: str) -> RuntimeSpec:
    """The stages' runtime for a thread setting: the KV cache the cluster's nodes run by
    default, stateful stages (what a stage-worker process runs)."""
    return RuntimeSpec(num_threads=None if threads == "default" else int(threads),
                       kv_cache_precision=KV_CACHE_PRECISION)


def runtime_config(threads: str) -> RuntimeSpec:
    """``runtime_spec_of``, for the in-process chain and the bare relays."""
    return runtime_spec_of(threads)


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
    return [sys.executable, "-m", "tools.decode.overhead", *(str(a) for a in args)]


def pull_socket(ctx: zmq.Context, bind: str) -> tuple[zmq.Socket, str]:
    """A raw PULL bound to ``bind`` (a ``*`` port picks one), and the endpoint it got."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(bind)
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def push_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    """A raw PUSH connected to ``address``."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


@contextmanager
def coordinator_pipes(stages: int, make_cmd: HelperCmd) -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """(push to stage 1, pull for replies) with helper processes for stages 1.. running."""
    ctx = zmq.Context.instance()
    pull, endpoint = pull_socket(ctx, "tcp://127.0.0.1:*")
    with ExitStack() as stack:
        stack.callback(pull.close, 0)
        addrs = chain_addresses(stages)
        start_chain(stack, addrs, endpoint, make_cmd)
        push = push_socket(ctx, addrs[0])
        stack.callback(push.close, 0)
        yield push, pull


# -- references -----------------------------------------------------------------------
def ping_main(bind: str, send_to: str, reply: tuple[int, int]) -> None:
    """A raw PULL -> PUSH relay; with a reply size (header, payload bytes) it answers so."""
    ctx = zmq.Context.instance()
    (pull, endpoint), push = pull_socket(ctx, bind), push_socket(ctx, send_to)
    print(f"ready {endpoint}", flush=True)
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


def stage_runner(export: str, stage: int, threads: str) -> Any:
    """Stage ``stage`` of the export, loaded by the runtime, with one stream (0) open."""
    from dataplane.runtime.load import load_runner

    runner = load_runner(export, stage, runtime_config(threads))
    runner.open_stream(0)
    return runner


def bare_main(export: str, stage: int, threads: str, bind: str, send_to: str) -> None:
    """One stage behind a bare relay: position + raw hidden state in, the same (or the
    greedy token) out, with the stages' compute time summed along."""
    runner = stage_runner(export, stage, threads)
    ctx = zmq.Context.instance()
    (pull, endpoint), push = pull_socket(ctx, bind), push_socket(ctx, send_to)
    print(f"ready {endpoint}", flush=True)
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
    def cmd(i: int, bind: str, send_to: str) -> list[str]:
        return helper_cmd("--bare", export, i, threads, bind, send_to)

    first = stage_runner(export, 0, threads)
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


@dataclass
class ClusterRun:
    """Greedy decoding through the cluster's data plane: its tokens, each decode step's ms
    as the loop saw it, the data plane's own timing summary of those steps (p50, p95 of
    each figure), the coordinator's CPU ms, and the bytes of one decode step's frames."""

    tokens: list[int]
    step_ms: list[float]
    timing: dict[str, dict[str, float]]
    cpu_ms: float
    frame_bytes: dict[str, int]


def run_cluster(export: str, threads: str, prompt: list[int], tokens: int, hidden_size: int,
                root: Path | None = None) -> ClusterRun:
    """Greedy decoding through a local cluster's data plane (warmed up; its workers logging
    under ``root``): the prompt's prefill, then ``tokens - 1`` decode steps, their timing
    summary read from the data plane, and one step more whose frames are counted."""
    from zctl.launcher.data_plane import local_data_plane

    with local_data_plane(Path(export), runtime_spec_of(threads), root) as pipe:
        timed_greedy(pipe, prompt, 8)  # warm-up
        cpu0 = time.process_time()
        token, position = start_stream(pipe, STREAM, prompt)
        pipe.clear_timings()  # the decode steps' figures only
        out, step_ms = [token], []
        for _ in range(tokens - 1):
            start = time.perf_counter()
            token, position = greedy_step(pipe, STREAM, token, position)
            step_ms.append((time.perf_counter() - start) * 1e3)
            out.append(token)
        cpu_ms = (time.process_time() - cpu0) * 1e3
        timing = pipe.timing_summary()
        return ClusterRun(out, step_ms, timing, cpu_ms,
                          step_frame_bytes(pipe, token, position, hidden_size))


def step_frame_bytes(pipe: Any, token: int, position: int, hidden_size: int) -> dict[str, int]:
    """Bytes of one greedy decode step's frames, as the data plane's executor counts what
    crosses its first hop (stage 0's step frame) and its last (the reply; ``figures``): the
    payloads are a token's float32 hidden state and a top-1 record, the rest is header."""
    before = pipe.metrics.hop_bytes()
    greedy_step(pipe, STREAM, token, position)
    after = pipe.metrics.hop_bytes()
    forward, reply = after[0] - before[0], after[-1] - before[-1]
    return {"forward_header": forward - hidden_size * HIDDEN_BYTES,
            "forward_payload": hidden_size * HIDDEN_BYTES,
            "reply_header": reply - TOP1_BYTES, "reply_payload": TOP1_BYTES}


def measure(export: str, threads: str, tokens: int, prompt_len: int,
            rounds: int, root: Path | None = None) -> ConfigResult:
    from zctl.manifest import load_manifest

    load_before = os.getloadavg()[0]
    manifest = load_manifest(export, verify_files=False)
    stages = len(manifest.stages)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(10, manifest.model.vocab_size - 10, prompt_len)]
    local_out, local = run_local(export, threads, prompt, tokens)
    cluster = run_cluster(export, threads, prompt, tokens, manifest.model.hidden_size, root)
    if cluster.tokens != local_out:
        raise RuntimeError("cluster tokens differ from LocalChain's: the benchmark is invalid")
    bare_ms, bare_rest = bare_relay(export, stages, threads, tokens)
    sizes = cluster.frame_bytes
    ping = raw_ping_ms(stages, (sizes["forward_header"], sizes["forward_payload"]),
                       (sizes["reply_header"], sizes["reply_payload"]), rounds)
    p50 = {name: figure["p50"] for name, figure in cluster.timing.items()}
    compute = [p50[f"stage{i}.compute"] for i in range(stages)]
    step_ms = median(cluster.step_ms)
    return ConfigResult(
        threads=threads, tokens=len(cluster.tokens),
        local_ms_per_token=median(local.step_ms),
        local_compute_ms=[median([s[i] for s in local.stage_ms]) for i in range(stages)],
        local_host_ms_per_token=host_ms_per_token(local),
        cluster_ms_per_token=step_ms, cluster_compute_ms=compute, transit_ms=p50["transit"],
        overhead_ms_per_hop=p50["overhead"] / stages,
        overhead_ms_per_hop_p95=cluster.timing["overhead"]["p95"] / stages,
        raw_ping_rtt_ms=ping,
        overhead_ms_per_hop_vs_raw_ping=(step_ms - sum(compute) - ping) / stages,
        bare_relay_ms_per_token=bare_ms, bare_relay_non_compute_ms=bare_rest,
        overhead_ms_per_hop_vs_bare_relay=(step_ms - sum(compute) - bare_rest) / stages,
        coordinator_cpu_ms_per_token=cluster.cpu_ms / max(1, len(cluster.tokens)),
        frame_bytes=sizes, breakdown_p50=p50,
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
    parser = argparse.ArgumentParser(prog="python -m tools.decode.overhead",
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
    from zctl.paths import zctl_home

    root = zctl_home() / "bench-overhead"  # the stage workers' logs
    results = [measure(args.export_dir, t.strip(), args.tokens, args.prompt_len, args.rounds,
                       root) for t in args.threads.split(",")]
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
