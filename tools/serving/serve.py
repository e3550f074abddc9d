"""Serving: zctl serve under 1-16 concurrent clients against openvino_genai's ContinuousBatchingPipeline.

Modelled on vLLM's serving benchmark: ``zctl serve`` on a 2-node local cluster against
openvino_genai's ContinuousBatchingPipeline, 1, 4, 8 and 16 concurrent clients.

Each level sends the same fixed, seeded set of chat requests (mixed prompt lengths, 16..256
``max_tokens``, greedy) through the OpenAI-compatible HTTP API with N clients
(tools.harness.load: streamed, each client sends its next request when its last one ended),
and the same requests to a ContinuousBatchingPipeline with N in flight (tools.harness.baseline),
in the same run, levels alternating which system goes first. With ``--rounds R`` each level
runs R times on both, the first system alternating round by round, and the level's ratio
is the median of the rounds' ratios: on a machine whose speed drifts over minutes, each
pair of runs sees the same machine. Per level: aggregate output tok/s of both (completion
tokens / the level's wall time, over every round), TTFT, inter-token latency and TPOT
p50/p99, errors. Output lengths are the models' own (EOS may end a request before
``max_tokens``); the completion tokens counted are the server's ``usage``. Both systems
keep prompts' KV for later requests (zctl's prefix cache, on by default; the pipeline's
``enable_prefix_caching``), so a level after the first finds its prompts cached on both.

The HTTP layer's cost: at 1 client, the same requests through the coordinator's ZeroMQ
generation service (the engine request zctl serve builds: chat messages, every token sent
as it comes) and through the HTTP API, request by request in alternating order on the
same cluster, each prompt cached beforehand so that neither of a pair prefills it:
``http_overhead`` = 1 - http / direct tok/s (tokens / end-to-end time, summed), and its
paired form (the median over requests). 32 pairs by default: on a noisy machine one pair
that hit a slow spell moved 12 pairs' figure by several percent.

The cluster is a 2-node local cluster and ``zctl serve`` in front of it, started as ``zctl
cluster up --local 2 --api`` starts them (tools.harness.cluster.served_cluster), under a
ZCTL_HOME of their own (<cache>/bench-serve/home, so a cluster of the shared cache is not
touched), torn down on every exit, Ctrl-C included.

    python -m tools.serving.serve [--concurrency 1,4,8,16] [--requests 32] [--rounds 1] [--json]
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from tools.harness.cluster import exit_on_failure, served_cluster
from tools.harness.load import (
    LevelRun,
    RequestRecord,
    ServeRequest,
    async_client,
    auth_headers,
    chat_payload,
    http_level,
    request_set,
    served_model,
    stream_chat,
    summarize,
)
from tools.harness.models import BenchModel
from tools.harness.options import CpuSets, Json, fail, parse_numbers
from tools.harness.order import rotated
from tools.harness.report import err, print_result, run_record
from tools.harness.stats import p50_p99_ms, paired_ratio, rounded
from zctl.engine.requests import DEFAULT_MAX_STREAMS
from zctl.launcher.processes import runtime_spec

if TYPE_CHECKING:
    from tools.harness.baseline import GenaiServer

TARGET_OVERHEAD = 0.03
TARGET_RATIO_AT = 8
TARGET_RATIO = 1.0
GENAI_PREFIX_CACHING = True  # the baseline keeps prompts' KV as zctl's prefix cache does


# -- the engine driven directly, against the HTTP API ----------------------------------------------


def direct_record(serve: str, request: ServeRequest) -> RequestRecord:
    """One request through the coordinator's ZeroMQ generation service, as zctl serve
    hands it on: the conversation through the model's chat template, greedy, EOS
    honoured, every token sent as it comes (``chunk_interval_ms=0``; ``zctl run`` batches
    a stream's tokens every 100 ms). Recorded as an HTTP stream is; never raises."""
    from zctl.engine.requests import ChatMessage, GenerationChunk, GenerationDone, GenerationRequest
    from zctl.service.client import generate_stream

    record = RequestRecord(request.index, time.perf_counter())
    message = GenerationRequest(
        uuid.uuid4().hex[:16], max_tokens=request.max_tokens, temperature=0.0,
        messages=[ChatMessage(m["role"], m["content"]) for m in request.messages()],
        chunk_interval_ms=0)
    try:
        for msg in generate_stream(serve, message):
            now = time.perf_counter()
            if isinstance(msg, GenerationChunk) and msg.text:
                record.chunk_times.append(now)
            elif isinstance(msg, GenerationDone):
                record.completion_tokens, record.usage = len(msg.tokens), True
                record.prompt_tokens = msg.prompt_tokens
                record.error = f"done with error: {msg.error}"[:300] if msg.error else ""
    except Exception as exc:  # noqa: BLE001 (a counted error)
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    record.end = time.perf_counter()
    return record


def _tok_s(record: RequestRecord) -> float:
    return record.completion_tokens / (record.end - record.start)


def overhead_figures(direct: Sequence[RequestRecord],
                     http: Sequence[RequestRecord]) -> dict[str, Any]:
    """The HTTP API against the engine driven directly, over the same requests (pairs by
    position): tok/s of each (tokens / end-to-end time, summed over the successful
    requests), ``http_overhead`` = 1 - http / direct, the paired overhead (the median
    over requests both served of 1 - http / direct tok/s) and the paired TPOT ratio (the
    streaming path alone, without the prefill's noise)."""
    def total(records: Sequence[RequestRecord]) -> float:
        good = [r for r in records if r.ok]
        wall = sum(r.end - r.start for r in good)
        return sum(r.completion_tokens for r in good) / wall if wall > 0 else 0.0

    direct_tok_s, http_tok_s = total(direct), total(http)
    pairs = [(d, h) for d, h in zip(direct, http, strict=True)
             if d.ok and h.ok and d.completion_tokens and h.completion_tokens]
    ratio = http_tok_s / direct_tok_s if direct_tok_s else None
    paired = paired_ratio([_tok_s(h) for _, h in pairs], [_tok_s(d) for d, _ in pairs])
    tpots = [(dt, ht) for d, h in pairs if (dt := d.tpot_s()) and (ht := h.tpot_s())]
    return {
        "requests": len(direct),
        "direct_tok_s": round(direct_tok_s, 2), "http_tok_s": round(http_tok_s, 2),
        "ratio": None if ratio is None else round(ratio, 4),
        "http_overhead": None if ratio is None else round(1.0 - ratio, 4),
        "http_overhead_paired": None if paired is None else round(1.0 - paired, 4),
        "same_tokens": sum(d.completion_tokens == h.completion_tokens for d, h in pairs),
        "direct_ttft_ms": p50_p99_ms([t for r in direct if r.ok and (t := r.ttft_s) is not None]),
        "http_ttft_ms": p50_p99_ms([t for r in http if r.ok and (t := r.ttft_s) is not None]),
        # per token after the first, request by request: the streaming path without prefill
        "http_tpot_over_direct_paired": rounded(paired_ratio([h for _, h in tpots],
                                                             [d for d, _ in tpots]), 4),
        "errors": sum(not r.ok for r in direct), "http_errors": sum(not r.ok for r in http),
        "pairs": [{"index": d.index, "tokens": [d.completion_tokens, h.completion_tokens],
                   "direct_s": round(d.end - d.start, 3), "http_s": round(h.end - h.start, 3)}
                  for d, h in zip(direct, http, strict=True)],
    }


def overhead_steps(requests: Sequence[ServeRequest]) -> list[tuple[str, ServeRequest]]:
    """The overhead measurement's requests in order: for each request, first a one-token
    "warm" one (direct) that leaves its prompt in the prefix cache, then the request
    "direct" and through "http", which goes first alternating. Without the warm step the
    second of a pair found the prompt its partner had just prefilled cached, and the pair
    measured the prefix cache instead of the HTTP layer (a 16-token request: 0.54 s
    second against 1.46 s first)."""
    steps: list[tuple[str, ServeRequest]] = []
    for i, request in enumerate(requests):
        steps.append(("warm", replace(request, max_tokens=1)))
        steps += [(path, request) for path in rotated(("direct", "http"), i)]
    return steps


async def measure_overhead(base_url: str, model: str, serve: str,
                           requests: Sequence[ServeRequest],
                           api_key: str | None = None) -> dict[str, Any]:
    """Each request directly and through HTTP, one client, its prompt cached for both."""
    direct: list[RequestRecord] = []
    http: list[RequestRecord] = []
    async with async_client(base_url, 1) as client:
        for path, request in overhead_steps(requests):
            if path == "http":
                http.append(await stream_chat(client, chat_payload(model, request),
                                              RequestRecord(request.index),
                                              auth_headers(api_key)))
            else:
                record = await asyncio.to_thread(direct_record, serve, request)
                if path == "direct":
                    direct.append(record)
    return overhead_figures(direct, http)


# -- the run -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What a run measures."""

    levels: list[int]
    requests: list[ServeRequest]
    overhead_requests: int
    api_key: str | None = None
    rounds: int = 1


def warmup_set(plan: Plan) -> list[ServeRequest]:
    """Short requests, as many as the largest level: every batch size gets its first
    (slow) steps before anything is measured."""
    n = max(plan.levels)
    return [replace(plan.requests[i % len(plan.requests)], max_tokens=8) for i in range(n)]


def run_levels(plan: Plan, base_url: str, serve: str,
               genai: GenaiServer | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Warm both systems up, measure the HTTP overhead, then every level on both, each
    level ``plan.rounds`` times, the system that goes first alternating round by round."""
    model = asyncio.run(served_model(base_url, plan.api_key)).id
    warm = warmup_set(plan)
    asyncio.run(http_level(base_url, model, warm, len(warm), plan.api_key))
    if genai is not None:
        genai.serve(warm, len(warm))
    overhead = asyncio.run(measure_overhead(base_url, model, serve,
                                            plan.requests[:plan.overhead_requests], plan.api_key))
    err.print(f"1 client: direct {overhead['direct_tok_s']} tok/s, HTTP {overhead['http_tok_s']} "
              f"tok/s, overhead {overhead['http_overhead']}")
    rows = []
    for i, n in enumerate(plan.levels):
        zctl_runs: list[LevelRun] = []
        genai_runs: list[LevelRun] = []
        for r in range(plan.rounds):
            for system in (("zctl", "genai") if (i + r) % 2 == 0 else ("genai", "zctl")):
                if system == "zctl":
                    zctl_runs.append(asyncio.run(http_level(base_url, model, plan.requests, n,
                                                            plan.api_key)))
                elif genai is not None:
                    genai_runs.append(genai.serve(plan.requests, n))
        rows.append(level_row(summarize(pool(zctl_runs)),
                              summarize(pool(genai_runs)) if genai_runs else None,
                              paired_rounds(zctl_runs, genai_runs)))
        err.print(f"{n} clients: zctl {rows[-1]['zctl_tok_s']} tok/s, genai CB "
                  f"{rows[-1]['genai_cb_tok_s']} tok/s, ratio {rows[-1]['ratio']} (rounds "
                  f"{rows[-1]['round_ratios']}), errors {rows[-1]['errors']}")
    return rows, overhead


def pool(runs: Sequence[LevelRun]) -> LevelRun:
    """Rounds of one level as one run: every round's requests, their wall times summed
    (so its aggregate tok/s is every round's tokens over every round's time)."""
    if not runs:
        raise ValueError("no rounds to pool")
    return LevelRun(runs[0].concurrency, [r for run in runs for r in run.records],
                    sum(run.wall_s for run in runs))


RoundPairs = tuple[Sequence[float], Sequence[float]]  # zctl's and genai's tok/s, round by round


def paired_rounds(zctl: Sequence[LevelRun], genai: Sequence[LevelRun]) -> RoundPairs:
    """zctl's and genai's aggregate tok/s, round by round (the rounds of both systems
    paired by position; a round where genai served nothing left out: nothing to compare
    against; none without the baseline)."""
    pairs = [(summarize(z)["tok_s"], g_tok_s) for z, g in zip(zctl, genai, strict=False)
             if (g_tok_s := summarize(g)["tok_s"])]
    return [z for z, _ in pairs], [g for _, g in pairs]


def level_row(zctl: dict[str, Any], genai: dict[str, Any] | None,
              rounds: RoundPairs = ((), ())) -> dict[str, Any]:
    """One level's row: the headline figures, then each system's whole summary. The ratio
    is zctl's over genai's tok/s paired round by round (``paired_ratio`` of ``rounds``:
    a drift in the machine's speed between rounds then moves both systems of a pair
    alike) when there are rounds, else the two summaries' tok/s."""
    ratio = rounded(paired_ratio(*rounds))
    if ratio is None:
        ratio = round(zctl["tok_s"] / genai["tok_s"], 3) if genai and genai["tok_s"] else None
    ratios = [round(z / g, 3) for z, g in zip(*rounds, strict=True)]
    return {
        "concurrency": zctl["concurrency"],
        "zctl_tok_s": zctl["tok_s"], "genai_cb_tok_s": genai["tok_s"] if genai else None,
        "ratio": ratio, "round_ratios": list(ratios), "ttft_ms": zctl["ttft_ms"], "itl_ms": zctl["itl_ms"],
        "genai_ttft_ms": genai["ttft_ms"] if genai else None,
        "genai_itl_ms": genai["itl_ms"] if genai else None,
        "errors": zctl["errors"], "genai_errors": genai["errors"] if genai else None,
        "tpot_ms": zctl["tpot_ms"], "genai_tpot_ms": genai["tpot_ms"] if genai else None,
        "tokens_per_chunk": zctl["tokens_per_chunk"],
        "zctl": zctl, "genai_cb": genai,
    }


def targets(rows: Sequence[dict[str, Any]], overhead: float | None,
            overhead_paired: float | None = None) -> dict[str, Any]:
    """The issue's targets, each with its value and whether it is met (None: not measured);
    the overhead's also with its paired value (one outlier request moves the aggregate)."""
    at = next((r for r in rows if r["concurrency"] == TARGET_RATIO_AT), None)
    ratio = at["ratio"] if at else None
    return {
        "zero_errors": {"target": "0 errors at every concurrency",
                        "value": sum(r["errors"] for r in rows),
                        "met": all(r["errors"] == 0 for r in rows)},
        "http_overhead": {"target": f"<= {TARGET_OVERHEAD}", "value": overhead,
                          "met": None if overhead is None else overhead <= TARGET_OVERHEAD,
                          "paired": overhead_paired,
                          "met_paired": None if overhead_paired is None
                          else overhead_paired <= TARGET_OVERHEAD},
        f"ratio_at_{TARGET_RATIO_AT}": {
            "target": f">= {TARGET_RATIO}x genai CB at {TARGET_RATIO_AT} clients",
            "value": ratio, "met": None if ratio is None else ratio >= TARGET_RATIO},
    }


def report(rows: list[dict[str, Any]], overhead: dict[str, Any],
           settings: dict[str, Any]) -> dict[str, Any]:
    """The one JSON object of ``--json``."""
    return {**run_record(), "levels": rows, "http_overhead": overhead["http_overhead"],
            "overhead": overhead, "targets": targets(rows, overhead["http_overhead"],
                                                        overhead["http_overhead_paired"]),
            "settings": settings}


def _ms(figure: dict[str, Any] | None, key: str, digits: int = 1) -> str:
    value = figure.get(key) if figure else None
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(result: dict[str, Any], console: Console) -> None:
    """Throughput a row per concurrency level, latency a row per level and system, then
    the HTTP overhead and the targets."""
    from rich.table import Table

    console.print(f"zctl serve (2-node local cluster) vs openvino_genai ContinuousBatching"
                  f"Pipeline: {result['cpu']}, {result['date']}, commit {result['commit']}",
                  soft_wrap=True, highlight=False)
    tput = Table(title="aggregate output tok/s")
    for column in ("clients", "zctl", "genai CB", "ratio", "rounds' ratios", "errors",
                   "genai errors"):
        tput.add_column(column, justify="right")
    for r in result["levels"]:
        tput.add_row(str(r["concurrency"]), str(r["zctl_tok_s"]), str(r["genai_cb_tok_s"] or "-"),
                     f"{r['ratio']}x" if r["ratio"] else "-",
                     " ".join(str(x) for x in r.get("round_ratios") or []) or "-",
                     str(r["errors"]),
                     str("-" if r["genai_errors"] is None else r["genai_errors"]))
    console.print(tput)
    lat = Table(title="latency, ms")
    for column in ("clients", "system", "TTFT p50", "p99", "ITL p50", "p99", "TPOT p50", "p99",
                   "tok/chunk"):
        lat.add_column(column, justify="right")
    for r in result["levels"]:
        for name, key in (("zctl", "zctl"), ("genai", "genai_cb")):
            s = r[key]
            if s is not None:
                lat.add_row(str(r["concurrency"]), name, _ms(s["ttft_ms"], "p50", 0),
                            _ms(s["ttft_ms"], "p99", 0), _ms(s["itl_ms"], "p50"),
                            _ms(s["itl_ms"], "p99"), _ms(s["tpot_ms"], "p50"),
                            _ms(s["tpot_ms"], "p99"), str(s["tokens_per_chunk"]))
    console.print(lat)
    console.print("ITL: gaps between streamed chunks (genai: one token a step); TPOT: per "
                  "request, time per token after the first", soft_wrap=True)
    o = result["overhead"]
    console.print(f"HTTP at 1 client: {o['http_tok_s']} tok/s against {o['direct_tok_s']} "
                  f"direct: overhead {o['http_overhead']} (paired {o['http_overhead_paired']}; "
                  f"TPOT http/direct {o['http_tpot_over_direct_paired']}), {o['requests']} "
                  "requests each", soft_wrap=True)
    def verdict(met: bool | None) -> str:
        return "met" if met else "not measured" if met is None else "MISSED"

    for name, t in result["targets"].items():
        paired = f"; paired {t['paired']} -> {verdict(t['met_paired'])}" if "paired" in t else ""
        console.print(f"target {name} ({t['target']}): {t['value']} -> {verdict(t['met'])}"
                      f"{paired}")


def main(
    concurrency: Annotated[str, typer.Option(help="client counts, comma-separated")] = "1,4,8,16",
    requests: Annotated[int, typer.Option(help="requests per level (the same set each)")] = 32,
    overhead_requests: Annotated[int, typer.Option(
        help="requests sent both directly and over HTTP at 1 client (at most --requests)")] = 32,
    seed: Annotated[int, typer.Option(help="the request set's seed")] = 0,
    cpu_sets: CpuSets = "split",
    port: Annotated[int, typer.Option(help="zctl serve's port (0: a free one)")] = 0,
    max_queue: Annotated[int, typer.Option(
        help="zctl serve --max-queue (0: the server's default)")] = 0,
    api_key: Annotated[str | None, typer.Option(help="zctl serve --api-key")] = None,
    max_streams: Annotated[int, typer.Option(
        help="the cluster's generations at once (cluster up --max-streams)")] = DEFAULT_MAX_STREAMS,
    skip_genai: Annotated[bool, typer.Option("--skip-genai", help="no openvino_genai")] = False,
    timeout: Annotated[float, typer.Option(help="seconds for the cluster and server to "
                                                "come up")] = 300.0,
    rounds: Annotated[int, typer.Option(
        help="times each level is run on both systems, which goes first alternating; the "
             "ratio is the median of the rounds' ratios")] = 1,
    as_json: Json = False,
) -> None:
    levels = parse_numbers(concurrency, "--concurrency", "client counts")
    if requests < 1 or overhead_requests < 1 or rounds < 1:
        fail("--requests, --overhead-requests and --rounds need at least 1")
    plan = Plan(levels, request_set(requests, seed), min(overhead_requests, requests), api_key,
                rounds)
    bench_model = BenchModel.resolve("smollm2-135m")
    export_dir = bench_model.export(2, "int4")
    props = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}  # cluster up's
    genai = None if skip_genai else genai_server(bench_model, export_dir, props, max(levels))
    load_before = os.getloadavg()
    runtime = runtime_spec("f32", None, "CPU")  # zctl cluster up's
    with exit_on_failure(), served_cluster(
            export_dir, 2, runtime, bench_model.cache / "bench-serve" / "home", port=port,
            api_key=api_key, max_queue=max_queue or None, timeout_s=timeout, cpu_sets=cpu_sets,
            max_streams=max_streams) as record:
        rows, overhead = run_levels(plan, record.api, record.serve, genai)
    settings = {"requests": requests, "seed": seed, "rounds": rounds,
                "overhead_requests": plan.overhead_requests,
                "max_streams": max_streams, "genai_prefix_caching": GENAI_PREFIX_CACHING,
                "cpu_sets": cpu_sets, "export": str(export_dir), "genai_properties": props,
                "max_tokens": [r.max_tokens for r in plan.requests],
                "load_average_before_after": [round(load_before[0], 2),
                                              round(os.getloadavg()[0], 2)]}
    result = report(rows, overhead, settings)
    print_result(result, as_json, print_table)


def genai_server(bench_model: BenchModel, export_dir: Path, props: dict[str, Any],
                 max_level: int) -> GenaiServer:
    """The ContinuousBatchingPipeline on the monolithic export of the same INT4 source
    (the baseline tools.decode.microbatch builds), room for ``max_level`` sequences."""
    from tools.harness.baseline import GenaiServer, export_baseline_like

    model_dir = export_baseline_like(bench_model.hf_dir, export_dir, "int4", console=err)
    return GenaiServer(model_dir, export_dir, props, max_num_seqs=max(16, max_level),
                       prefix_caching=GENAI_PREFIX_CACHING)


if __name__ == "__main__":
    typer.run(main)
