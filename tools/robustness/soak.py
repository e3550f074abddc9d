"""Soak: streams through the OpenAI API for minutes; memory of every process, leaks, bounded queues.

``zctl bench soak``: a local cluster (``--nodes`` processes) with ``zctl serve`` in front
of it, and ``--streams`` HTTP clients, each sending one chat completion after another
until ``--minutes`` are up:

    python -m tools.robustness.soak --model EXPORT_DIR --streams 16 --minutes 10 --json

The requests are a mix: prompts from a few words to a document of a few hundred tokens,
``max_tokens`` 16-128, most streamed, some whole, some with stop strings, some sampled
with a seed, and some cancelled mid-stream by closing the connection. At the deadline no
new request is sent; those in flight get ``--drain-s`` seconds to end, then are cut.

Every ``--sample-s`` seconds the resident memory (VmRSS) of every process is read: the
coordinator, each node, the API server and any process under them. After warm-up
(``--warmup-s``; default the first 20% of the run, at most 2 minutes) each must stay
flat: growth from the end of warm-up to the end of the load < 5%.

After the load, a burst of ``--max-queue`` + 8 requests at once checks that the API
bounds its queue (the excess answered 429), and the cluster must come back to idle:
no request running or waiting in the engine or the API, every stage's KV slots back to
their value before the load, and cached prefixes within the prefix cache's cap.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from tools.harness.cluster import served_cluster
from tools.harness.load import served_model
from tools.harness.models import export_or_cached
from tools.harness.options import Json, fail
from tools.harness.report import err, run_record
from tools.robustness.soak_load import LoadTally, Prompt, drive, prompt_pool, queue_burst
from tools.robustness.soak_probe import Sampler
from zctl.engine.requests import DEFAULT_MAX_STREAMS
from zctl.launcher.processes import runtime_spec

RSS_TARGET_PCT = 5.0
BURST_EXTRA = 8  # requests beyond --max-queue in the closing burst
IDLE_TIMEOUT_S = 30.0  # how long the cluster may take to be idle once the load stops


def roots(record: Any) -> dict[str, int]:
    """The cluster's processes by name: the coordinator, node1.., the API server (last)."""
    pids = list(record.pids)
    named = {"coordinator": pids[0]}
    named.update({f"node{i}": pid for i, pid in enumerate(pids[1:-1], start=1)})
    named["api"] = pids[-1]
    return named


# -- the idle state after the load -----------------------------------------------------------


def leak_figures(before: Any, after: Any, prefix_cap_tokens: int) -> dict[str, Any]:
    """What the cluster still holds once the load is over (``after``: a
    tools.robustness.soak_probe.ServiceSample) against before it began (``before``); ``leaked``:
    the problems found ([] when it is idle)."""
    leaked = []
    if after.running or after.waiting:
        leaked.append(f"the engine has {after.running} running, {after.waiting} waiting")
    if after.api_in_flight:
        leaked.append(f"the API holds {after.api_in_flight} requests")
    for stage, (idle, now) in enumerate(zip(before.kv_slots, after.kv_slots, strict=True)):
        if now != idle:
            leaked.append(f"stage {stage} holds {now} KV slots (idle: {idle})")
    if after.prefix_cached_tokens > prefix_cap_tokens:
        leaked.append(f"{after.prefix_cached_tokens} tokens of cached prefixes, over the "
                      f"cap of {prefix_cap_tokens}")
    return {"running": after.running, "waiting": after.waiting,
            "api_in_flight": after.api_in_flight, "kv_slots": after.kv_slots,
            "kv_slots_idle": before.kv_slots,
            "prefix_cached_tokens": after.prefix_cached_tokens,
            "prefix_cap_tokens": prefix_cap_tokens, "leaked": leaked}


def wait_idle(serve: str, api_url: str, before: Any, prefix_cap_tokens: int,
              clock: Any) -> dict[str, Any]:
    """Look until the cluster is idle or IDLE_TIMEOUT_S pass (a node's KV slots arrive
    with its heartbeats); the last look's leak figures and how long it took."""
    from tools.robustness.soak_probe import service_sample

    start = time.monotonic()
    while True:
        figures = leak_figures(before, service_sample(serve, api_url, clock()),
                               prefix_cap_tokens)
        waited = time.monotonic() - start
        if not figures["leaked"] or waited >= IDLE_TIMEOUT_S:
            return {**figures, "idle_after_s": round(waited, 1)}
        time.sleep(0.5)


def prefix_cap(export_dir: Path, prefix_cache_mb: int = 512) -> int:
    """Tokens of cached prefixes the cluster may hold (its --prefix-cache-mb, the default)."""
    from zctl.manifest import load_manifest
    from zctl.service.server import kv_tokens

    return kv_tokens(load_manifest(export_dir, verify_files=False), prefix_cache_mb)


# -- the run ---------------------------------------------------------------------------------


def soak(export_dir: Path, plan: dict[str, Any], root: Path) -> dict[str, Any]:
    """Start the cluster, load it for ``plan["minutes"]``, burst its queue, check it comes
    back to idle; the report (without the run record)."""
    from tools.robustness.soak_probe import service_sample
    from zctl.engine.tokenizer import ChatTokenizer

    with served_cluster(export_dir, plan["nodes"], runtime_spec("f32", None, "CPU"), root,
                        max_queue=plan["max_queue"], timeout_s=plan["start_timeout_s"],
                        max_streams=plan["max_streams"]) as record:
        api = record.api
        begin = time.monotonic()

        def clock() -> float:
            return time.monotonic() - begin

        model, max_context = model_and_context(api)
        prompts = prompt_pool(ChatTokenizer(export_dir), max_context)
        before = service_sample(record.serve, api, clock())
        sampler = Sampler(roots(record), record.serve, api, plan["sample_s"], clock)
        sampler.start()
        load_s = plan["minutes"] * 60.0
        try:
            tally = asyncio.run(drive(api, model, prompts, plan["streams"], load_s,
                                      plan["drain_s"], plan["seed"]))
            load_end = clock()
            burst = asyncio.run(queue_burst(api, model, prompts[0],
                                            plan["max_queue"] + BURST_EXTRA))
            leaks = wait_idle(record.serve, api, before, prefix_cap(export_dir), clock)
        finally:
            sampler.stop()
        processes = sampler.processes(plan["warmup_s"], load_end)
    return figures(plan, tally, load_end, processes, sampler, burst, leaks, prompts)


def model_and_context(api: str) -> tuple[str, int]:
    """The model id the API serves and its context length (GET /v1/models)."""
    served = asyncio.run(served_model(api))
    if served.max_model_len is None:
        raise RuntimeError(f"{api}/v1/models does not say the model's context (max_model_len)")
    return served.id, served.max_model_len


def figures(plan: dict[str, Any], tally: LoadTally, load_s: float,
            processes: list[dict[str, Any]], sampler: Sampler, burst: dict[str, Any],
            leaks: dict[str, Any], prompts: list[Prompt]) -> dict[str, Any]:
    """The soak's report from what was measured."""
    peaks = sampler.peaks()
    passed_rss = bool(processes) and all(p["growth_pct"] < RSS_TARGET_PCT for p in processes)
    passed_queue = burst["rejected"] >= 1 and not burst["errors"]
    return {
        "streams": plan["streams"], "minutes": plan["minutes"], "nodes": plan["nodes"],
        "load_s": round(load_s, 1), "warmup_s": plan["warmup_s"],
        "requests": tally.requests, "completed": tally.completed, "cancelled": tally.cancelled,
        "cut_at_deadline": tally.cut, "errors": tally.errors,
        "error_kinds": dict(tally.error_kinds), "error_examples": tally.error_examples,
        "kinds": dict(tally.kinds),
        "tokens": tally.tokens, "tok_s": round(tally.tokens / load_s, 1) if load_s else 0.0,
        "prompt_tokens": [min(p.tokens for p in prompts), max(p.tokens for p in prompts)],
        "processes": processes, "leaks": leaks, "burst": burst,
        "max_queue": plan["max_queue"], "max_queue_seen": peaks["api_in_flight"],
        "peaks": peaks, "sampler_problems": sampler.problems[:5],
        "passed_rss": passed_rss, "passed_leaks": not leaks["leaked"],
        "passed_queue": passed_queue, "passed_errors": tally.errors == 0,
    }


def main(
    model: Annotated[str, typer.Option(
        help="an export directory, or smollm2-135m, random-1b or an HF directory (exported "
             "in --nodes stages)")] = "smollm2-135m",
    weights: Annotated[str, typer.Option(help="int4 | int8 | fp16 | fp32 (not an export)")] =
        "int8",
    nodes: Annotated[int, typer.Option(help="cluster processes (= stages)")] = 2,
    streams: Annotated[int, typer.Option(help="concurrent HTTP clients")] = 16,
    minutes: Annotated[float, typer.Option(help="how long the clients send requests")] = 10.0,
    warmup_s: Annotated[float | None, typer.Option(
        help="seconds of warm-up before memory must stay flat (default: 20% of the run, "
             "at most 120)")] = None,
    sample_s: Annotated[float, typer.Option(help="seconds between samples")] = 5.0,
    drain_s: Annotated[float, typer.Option(
        help="seconds the requests in flight at the deadline get to end")] = 60.0,
    max_queue: Annotated[int, typer.Option(
        help="the API's --max-queue (default: 2 x --streams)")] = 0,
    max_streams: Annotated[int, typer.Option(help="the cluster's generations at once")] = DEFAULT_MAX_STREAMS,
    seed: Annotated[int, typer.Option(help="seed of the request mix")] = 0,
    as_json: Json = False,
) -> None:
    if nodes < 2 or streams < 1 or minutes <= 0 or sample_s <= 0 or drain_s < 0:
        fail("--nodes >= 2, --streams >= 1, --minutes > 0, --sample-s > 0, --drain-s >= 0")
    if max_queue < 0 or max_streams < 1 or (warmup_s is not None and warmup_s < 0):
        fail("--max-queue >= 0, --max-streams >= 1, --warmup-s >= 0")
    if warmup_s is not None and warmup_s >= minutes * 60:
        fail(f"--warmup-s ({warmup_s:g}) must end before the run does ({minutes * 60:g} s)")
    plan = {"nodes": nodes, "streams": streams, "minutes": minutes,
            "warmup_s": round(min(120.0, 12.0 * minutes) if warmup_s is None else warmup_s, 1),
            "sample_s": sample_s, "drain_s": drain_s, "max_queue": max_queue or 2 * streams,
            "max_streams": max_streams, "seed": seed, "start_timeout_s": 300.0}
    export_dir = export_or_cached(model, nodes, weights)
    root = Path(os.environ.get("ZCTL_HOME") or Path.home() / ".zctl") / "soak" / \
        time.strftime("%Y%m%d-%H%M%S")
    err.print(f"soak: {streams} streams for {minutes:g} min on a {nodes}-node cluster of "
              f"{export_dir} (logs under {root / 'local' / 'logs'})")
    report = {**run_record(), "model": str(export_dir),
              **soak(export_dir, plan, root)}
    if as_json:
        print(json.dumps(report))
    else:
        print_report(report)
    if not (report["passed_leaks"] and report["passed_errors"] and report["passed_queue"]):
        raise typer.Exit(1)


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"soak: {report['streams']} streams, {report['minutes']:g} min "
                        f"({report['cpu']}, {report['date']}, {report['commit']})")
    for column in ("process", "pid", "RSS after warm-up MB", "RSS at end MB", "max MB",
                   "growth %"):
        table.add_column(column, justify="left" if column == "process" else "right")
    for p in report["processes"]:
        growth = f"{p['growth_pct']:+.2f}"
        table.add_row(p["name"], str(p["pid"]), f"{p['rss_warm_mb']:.1f}",
                      f"{p['rss_end_mb']:.1f}", f"{p['rss_max_mb']:.1f}",
                      growth if p["growth_pct"] < RSS_TARGET_PCT else f"[red]{growth}[/]")
    console.print(table)
    console.print(f"requests {report['requests']}: completed {report['completed']}, "
                  f"cancelled {report['cancelled']}, cut at the deadline "
                  f"{report['cut_at_deadline']}, errors {report['errors']} "
                  f"{report['error_kinds'] or ''}; {report['tokens']} tokens, "
                  f"{report['tok_s']} tok/s")
    leaks, burst = report["leaks"], report["burst"]
    console.print(f"after the load: running {leaks['running']}, waiting {leaks['waiting']}, "
                  f"API in flight {leaks['api_in_flight']}, KV slots {leaks['kv_slots']} "
                  f"(idle {leaks['kv_slots_idle']}), cached prefixes "
                  f"{leaks['prefix_cached_tokens']} of {leaks['prefix_cap_tokens']} tokens")
    console.print(f"queue: at most {report['max_queue_seen']} in flight of --max-queue "
                  f"{report['max_queue']}; a burst of {burst['sent']}: {burst['rejected']} "
                  f"answered 429")
    for name in ("rss", "leaks", "queue", "errors"):
        met = report[f"passed_{name}"]
        console.print(f"{name}: {'passed' if met else '[red]FAILED[/]'}")
    for problem in leaks["leaked"]:
        console.print(f"[red]leak:[/] {problem}")


if __name__ == "__main__":
    typer.run(main)
