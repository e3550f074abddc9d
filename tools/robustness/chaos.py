"""Chaos: faults mid-generation (kill, hang, link down, flapping, slow link, heal), and how each is survived.

``zctl bench chaos``: scripted faults on a local cluster whose nodes each live in their
own network namespace.

    python -m tools.robustness.chaos --trials 20 --json

Every trial starts a greedy generation (exact numerics, so a fault-free run's tokens are
known), injects one fault once it has streamed ``--fault-at`` tokens, lifts it where it
is lifted, and records: seconds from the fault to the client being told the generation
paused (detection; none for faults that need no pause), seconds from the fault to the
next token, whether the tokens equal the fault-free run's, and whether the request was
lost (no answer, or an error).

Faults (node 1 of a 2-node cluster unless said):
- ``kill``: SIGKILL of the node's process, restarted at once with its state dir (as a
  service manager would);
- ``stop``: SIGSTOP (a hung node), SIGCONT after ``--hold`` seconds;
- ``link-down``: the node's link down for ``--hold`` seconds;
- ``flap``: its link down and up every 0.5 s for ``--hold`` seconds;
- ``slow``: its inbound link shaped to 1 Mbit/s by ``tbf`` for ``--hold`` seconds;
- ``heal``: SIGKILL of one node of a 3-node cluster, never restarted: the survivors take
  its stages (alternating the middle and the last node).
Every trial runs on a fresh cluster with the product's defaults: a node silent past its
heartbeats is healed around (``--no-heal``: wait for it to come back instead), so the
next token may come from the survivors before the fault is lifted. Without namespaces
(not root, no iproute2) nodes get 127.0.0.x addresses on the host's stack, the link
faults are skipped, and the output says so. Targets: 0 requests lost; detection within
3 s; tokens identical in every trial; the median seconds from the fault to the next
token <= 5.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from tools.harness.models import BenchModel
from tools.harness.options import Json, Model, fail
from tools.harness.report import err, run_record
from tools.robustness.chaos_net import Loopback, Namespaces, network

FAULTS = ("kill", "stop", "link-down", "flap", "slow", "heal")
LINK_FAULTS = ("link-down", "flap", "slow")
PROMPT = "Tell me about the lighthouse on the hill and the keeper who lived there."
DETECT_TARGET_S, NEXT_TOKEN_TARGET_S = 3.0, 5.0


@dataclass(frozen=True)
class Plan:
    faults: tuple[str, ...]
    trials: int
    tokens: int
    fault_at: int
    hold_s: float
    weights: str
    heal: bool = True
    link_delay_ms: float = 0.0  # emulated one-way delay of every data frame


@dataclass
class Cluster:
    """A running cluster: its record (zctl.launcher.record.ClusterRecord), the node
    processes by node index, and where it lives."""

    record: Any
    nodes: dict[int, int]
    root: Path
    net: Namespaces | Loopback
    link_delay_ms: float = 0.0

    def spawn_node(self, node: int) -> int:
        """Start node ``node`` again with its state dir (as a service manager would)."""
        from zctl.launcher.local import start_local_node
        from zctl.launcher.processes import link_shape

        pid, _ = start_local_node(self.record, node, self.root,
                                  link=link_shape(self.link_delay_ms), network=self.net)
        self.nodes[node] = pid
        self.record.pids.append(pid)
        return pid

    def stop(self) -> None:
        from zctl.launcher.local import stop_processes

        stop_processes(self.record.pids)


def start_cluster(net: Namespaces | Loopback, export_dir: Path, nodes: int, heal: bool,
                  root: Path, link_delay_ms: float = 0.0) -> Cluster:
    """A local cluster placed by ``net`` (zctl.launcher.local.start_local_cluster): the
    coordinator on the host (its control port on the bridge), ``nodes - 1`` nodes in their
    namespaces, a row group per stage; returns once the pipeline serves."""
    from zctl.launcher.local import start_local_cluster, wait_serving
    from zctl.launcher.processes import runtime_spec

    runtime = runtime_spec("f32", None, "CPU", "f32", dynamic_quantization=False)
    record = start_local_cluster(export_dir, nodes, runtime, root, link_delay_ms=link_delay_ms,
                                 row_groups=nodes, heal_after=0.0 if heal else None,
                                 resume_timeout=90.0, network=net)
    cluster = Cluster(record, dict(enumerate(record.pids[1:], start=1)), root, net,
                      link_delay_ms)
    try:
        wait_serving(record, 180)
    except BaseException:
        cluster.stop()
        raise
    return cluster


# -- one trial ---------------------------------------------------------------------------
def inject(fault: str, cluster: Cluster, node: int, hold_s: float) -> None:
    """Apply ``fault`` to ``node`` and lift it where it is lifted (this blocks for the
    hold)."""
    pid = cluster.nodes[node]
    net = cluster.net
    if fault in ("kill", "heal"):
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if fault == "kill":
            cluster.spawn_node(node)
    elif fault == "stop":
        os.killpg(pid, signal.SIGSTOP)
        time.sleep(hold_s)
        os.killpg(pid, signal.SIGCONT)
    elif fault == "link-down":
        assert isinstance(net, Namespaces)
        net.link(node, False)
        time.sleep(hold_s)
        net.link(node, True)
    elif fault == "flap":
        assert isinstance(net, Namespaces)
        end = time.monotonic() + hold_s
        while time.monotonic() < end:
            net.link(node, False)
            time.sleep(0.5)
            net.link(node, True)
            time.sleep(0.5)
    elif fault == "slow":
        assert isinstance(net, Namespaces)
        net.slow(node, 1.0)
        time.sleep(hold_s)
        net.slow(node, None)
    else:
        raise ValueError(f"unknown fault {fault!r}")


def run_trial(cluster: Cluster, fault: str, node: int, plan: Plan, expected: list[int]
              ) -> dict[str, Any]:
    """One generation with ``fault`` injected on ``node`` mid-stream; its figures."""
    from zctl.engine.requests import GenerationChunk, GenerationRequest
    from zctl.service.client import generate_many

    request = GenerationRequest(uuid.uuid4().hex[:16], PROMPT, plan.tokens, ignore_eos=True,
                                temperature=0.0)
    events: list[tuple[float, Any]] = []
    streamed = threading.Event()
    failure: list[str] = []

    def client() -> None:
        tokens = 0
        try:
            for msg in generate_many(cluster.record.serve, [request], idle_timeout=90.0):
                events.append((time.monotonic(), msg))
                if isinstance(msg, GenerationChunk):
                    tokens += len(msg.tokens)
                    if tokens >= plan.fault_at:
                        streamed.set()
        except Exception as exc:  # noqa: BLE001 - a lost request is what this measures
            failure.append(f"{type(exc).__name__}: {exc}")
        streamed.set()

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    streamed.wait(120)
    start = time.monotonic()
    inject(fault, cluster, node, plan.hold_s)
    thread.join(180)
    return trial_figures(events, start, expected, failure, thread.is_alive())


def trial_figures(events: list[tuple[float, Any]], start: float, expected: list[int],
                  failure: list[str], hung: bool) -> dict[str, Any]:
    """A trial's figures from the client's (time, message) log and the fault's time."""
    from zctl.engine.requests import GenerationChunk, GenerationDone

    paused = [t for t, m in events if t >= start and getattr(m, "note", "").startswith("paused")]
    detect = paused[0] - start if paused else None
    after = paused[0] if paused else start
    tokens_after = [t for t, m in events
                    if isinstance(m, GenerationChunk) and m.tokens and t >= after]
    done = next((m for _, m in events if isinstance(m, GenerationDone)), None)
    lost = hung or bool(failure) or done is None or bool(done.error)
    why = ("the client still waited" if hung else failure[0] if failure else
           "no answer" if done is None else done.error)
    return {"detect_s": None if detect is None else round(detect, 3),
            "next_token_s": round(tokens_after[0] - start, 3) if tokens_after else None,
            "identical": done is not None and list(done.tokens) == expected,
            "lost": lost, "error": why if lost else ""}


# -- the faults ----------------------------------------------------------------------------
def run_fault(fault: str, plan: Plan, net: Namespaces | Loopback, exports: Callable[[int], Path],
              root: Path) -> dict[str, Any]:
    """``plan.trials`` trials of ``fault``, each on a fresh cluster (a heal changes which
    node runs what); its summary (``skipped`` when it cannot run here)."""
    if fault in LINK_FAULTS and not net.link_faults:
        return {"trials": 0, "skipped": f"needs network namespaces ({net.why})"}
    nodes = 3 if fault == "heal" else 2
    trials: list[dict[str, Any]] = []
    for i in range(plan.trials):
        cluster = start_cluster(net, exports(nodes), nodes, plan.heal, root / f"{fault}{i}",
                                plan.link_delay_ms)
        try:
            expected = fault_free(cluster, plan)
            victim = 1 + i % 2 if fault == "heal" else 1  # the middle node, then the last
            trials.append(run_trial(cluster, fault, victim, plan, expected))
        finally:
            cluster.stop()
        err.print(f"{fault} trial {i + 1}: {trials[-1]}")
    return summarize(trials)


def fault_free(cluster: Cluster, plan: Plan) -> list[int]:
    from tools.harness.service import generate_done

    done = generate_done(cluster.record.serve, PROMPT, plan.tokens)
    if done.error:
        fail(f"the fault-free run failed: {done.error}")
    return list(done.tokens)


def summarize(trials: list[dict[str, Any]]) -> dict[str, Any]:
    detects = [t["detect_s"] for t in trials if t["detect_s"] is not None]
    nexts = [t["next_token_s"] for t in trials if t["next_token_s"] is not None]
    return {
        "trials": len(trials), "lost": sum(t["lost"] for t in trials),
        "identical": sum(t["identical"] for t in trials),
        "detected": len(detects),
        "detect_s_max": max(detects) if detects else None,
        "detect_s_median": round(statistics.median(detects), 3) if detects else None,
        "next_token_s_median": round(statistics.median(nexts), 3) if nexts else None,
        "next_token_s_max": max(nexts) if nexts else None,
        "errors": sorted({t["error"] for t in trials if t["error"]}),
        "per_trial": trials,
    }


def targets(faults: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ran = {name: f for name, f in faults.items() if f.get("trials")}
    detect = [f["detect_s_max"] for f in ran.values() if f["detect_s_max"] is not None]
    medians = [f["next_token_s_median"] for f in ran.values()
               if f["next_token_s_median"] is not None]
    return {
        "lost": {"target": "0 requests lost", "value": sum(f["lost"] for f in ran.values()),
                 "met": all(f["lost"] == 0 for f in ran.values())},
        "detection": {"target": f"<= {DETECT_TARGET_S} s", "value": max(detect, default=None),
                      "met": all(d <= DETECT_TARGET_S for d in detect)},
        "identical": {"target": "identical tokens in every trial",
                      "met": all(f["identical"] == f["trials"] for f in ran.values())},
        "next_token": {"target": f"median <= {NEXT_TOKEN_TARGET_S} s per fault",
                       "value": max(medians, default=None),
                       "met": all(m <= NEXT_TOKEN_TARGET_S for m in medians)},
    }


def main(
    trials: Annotated[int, typer.Option(help="trials per fault")] = 20,
    faults: Annotated[str, typer.Option(help=f"comma-separated, of {', '.join(FAULTS)}")] =
        ",".join(FAULTS),
    tokens: Annotated[int, typer.Option(help="new tokens per generation")] = 48,
    fault_at: Annotated[int, typer.Option(help="tokens streamed before the fault")] = 8,
    hold: Annotated[float, typer.Option(help="seconds a lifted fault lasts")] = 5.0,
    model: Model = "smollm2-135m",
    weights: Annotated[str, typer.Option(help="auto | int4 | int8 | fp16 | fp32")] = "int8",
    loopback: Annotated[bool, typer.Option("--loopback", help="no namespaces: 127.0.0.x")] =
        False,
    heal: Annotated[bool, typer.Option(help="heal around a lost node (the product's "
                                            "default); --no-heal: wait for it")] = True,
    link_delay_ms: Annotated[float, typer.Option(
        help="emulated one-way delay of every data frame (slower tokens)")] = 0.0,
    as_json: Json = False,
) -> None:
    chosen = tuple(f.strip() for f in faults.split(",") if f.strip())
    unknown = [f for f in chosen if f not in FAULTS]
    if unknown or not chosen:
        fail(f"unknown fault(s) {unknown}: choose from {', '.join(FAULTS)}")
    if trials < 1 or tokens < 2 or not 1 <= fault_at < tokens or hold <= 0 or link_delay_ms < 0:
        fail("--trials >= 1, --tokens >= 2, 1 <= --fault-at < --tokens, --hold > 0 and "
             "--link-delay-ms >= 0")
    plan = Plan(chosen, trials, tokens, fault_at, hold, weights, heal, link_delay_ms)
    bench_model = BenchModel.resolve(model)
    cache: dict[int, Path] = {}

    def exports(stages: int) -> Path:
        if stages not in cache:
            cache[stages] = bench_model.export(stages, weights)
        return cache[stages]

    root = bench_model.cache / "chaos"
    net = network(3, want_namespaces=not loopback)
    try:
        results = {fault: run_fault(fault, plan, net, exports, root) for fault in plan.faults}
    finally:
        net.down()
    where = (net.kind if isinstance(net, Namespaces) else f"loopback fallback: {net.why}")
    report = {**run_record(), "network": where, "model": bench_model.name,
              "settings": {"trials": trials, "tokens": tokens, "fault_at": fault_at,
                           "hold_s": hold, "weights": weights, "heal": heal,
                           "link_delay_ms": link_delay_ms},
              "faults": results, "targets": targets(results)}
    if as_json:
        print(json.dumps(report))
        return
    print_report(report)


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"chaos on {report['network']} ({report['cpu']}, {report['commit']})")
    for column in ("fault", "trials", "lost", "identical", "detect max s", "next token "
                   "median s", "note"):
        table.add_column(column)
    for name, f in report["faults"].items():
        table.add_row(name, str(f["trials"]), str(f.get("lost", "")), str(f.get("identical", "")),
                      str(f.get("detect_s_max", "")), str(f.get("next_token_s_median", "")),
                      f.get("skipped", "") or "; ".join(f.get("errors", [])))
    console = Console()
    console.print(table)
    for name, t in report["targets"].items():
        console.print(f"{name}: {t['target']}: {'met' if t['met'] else 'MISSED'}"
                      + (f" ({t['value']})" if t.get("value") is not None else ""))


if __name__ == "__main__":
    typer.run(main)
