"""Micro-batching: aggregate decode throughput of 1, 2, 4 concurrent streams on a local cluster.

The cluster is the real thing (a coordinator and node processes on loopback, driven
through the generation service as ``zctl run`` drives it): N requests are sent at once,
each on its own stream with its own KV on every stage, and the coordinator keeps one step
of every stream in flight so that no stage idles. Measured with and without speculative
decoding (prompt lookup, adaptive K), against openvino_genai in the same run: one
LLMPipeline serving the N users one after another, and its ContinuousBatchingPipeline
serving them at once. Runs are interleaved system by system; medians are reported.

Aggregate tok/s = tokens after each stream's first / (last stream done - first token of
any stream): decode throughput with prefill excluded. ``memory_per_stream_mb`` is the
growth of the cluster processes' resident memory per extra stream (its InferRequests and
KV) after the 4-stream runs.

Row groups (coordinator ``--row-groups``, on by default) batch the streams' one-token
decode steps: a group's streams are the rows of one inference per stage, which reads the
weights once for all of them. ``--row-groups 0`` measures interleaving alone.

Where the gain comes from: a single stream leaves every stage idle while the others (and
the wire) work; more streams fill those gaps. Across PCs that scales until the slowest
stage is busy all the time. On one machine the nodes share its cores: with
``--cpu-sets shared`` (the default of ``zctl cluster up --local``) one stream's stages
already use every core in turn, so a second stream has little idle time to fill;
``--cpu-sets split`` gives each node its own cores, as separate PCs would have, and
``--link-delay-ms`` emulates the hops of a real LAN/WAN, where the idle time
micro-batching fills is on the wire.

    python -m tools.bench_microbatch [--model smollm2-135m] [--tokens 64] [--runs 3] [--json]
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import typer
from rich.console import Console
from rich.table import Table

from common.manifest import load_manifest
from console.cluster_procs import (
    local_row_groups,
    runtime_args,
    start_local_cluster,
    stop_processes,
    wait_serving,
)
from tools.bench_common import (
    cached_export,
    export_name,
    model_hf_dir,
    paired_ratio,
    plugin_properties,
)

if TYPE_CHECKING:
    from tools.baseline import GenaiUsers

err = Console(stderr=True)
PROMPTS = [
    "Explain in detail how a bicycle's gears work.",
    "Write a short story about a lighthouse keeper and a storm.",
    "List the planets of the solar system with one fact about each.",
    "Write a Python function that checks whether a string is a palindrome, with tests.",
]
STREAM_COUNTS = (1, 2, 4)
MODES = ("cluster", "lookup", "genai_seq", "genai_cb")


def cluster_aggregate(serve: str, prompts: list[str], tokens: int,
                      speculative: str = "") -> dict[str, Any]:
    """Send ``prompts`` at once; aggregate and per-stream decode tok/s of the run."""
    from controlplane.client import generate_many
    from controlplane.service_messages import GenerateDone, GenerateRequest

    requests = [GenerateRequest(uuid.uuid4().hex[:16], p, tokens, True, ignore_eos=True,
                                speculative=speculative) for p in prompts]
    first: dict[str, float] = {}
    dones: dict[str, GenerateDone] = {}
    for msg in generate_many(serve, requests):
        first.setdefault(msg.request_id, time.monotonic())
        if isinstance(msg, GenerateDone):
            if msg.error:
                raise RuntimeError(msg.error)
            dones[msg.request_id] = msg
    span = time.monotonic() - min(first.values())
    after_first = sum(len(d.tokens) - 1 for d in dones.values())
    return {"aggregate_tok_s": after_first / span,
            "per_stream_tok_s": [round(dones[r.request_id].tok_s, 2) for r in requests],
            "acceptance": [dones[r.request_id].spec.get("acceptance") for r in requests]}


def paired_scaling(samples: dict[str, list[float]]) -> dict[str, float]:
    """Per stream count, the median over runs of that run's aggregate over its own
    1-stream figure (measured moments before): free of the drift between runs, which
    moves whole runs by +-10% here."""
    return {n: paired_ratio(values, samples["1"]) for n, values in samples.items()}


def cluster_rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def genai_users(hf_dir: Path, export_dir: Path, weights: str, props: dict[str, Any]) -> GenaiUsers:
    """openvino_genai on the monolithic export of the same model and weights: one
    LLMPipeline serving N users in turn ("genai_seq") and a ContinuousBatchingPipeline
    serving them at once ("genai_cb")."""
    from tools.baseline import GenaiUsers, export_baseline

    model_dir = export_baseline(hf_dir, weights, load_manifest(export_dir).group_size,
                                console=err)
    return GenaiUsers(model_dir, props, PROMPTS, warmup_streams=max(STREAM_COUNTS))


def main(
    model: str = typer.Option("smollm2-135m", help="smollm2-135m, random-1b, or an HF directory"),
    stages: int = typer.Option(2, help="cluster nodes (= stages)"),
    weights: str = typer.Option("int4"),
    tokens: int = typer.Option(64, help="new tokens per stream"),
    runs: int = typer.Option(3, help="interleaved runs per configuration (median reported)"),
    precision: str = typer.Option("f32", help="INFERENCE_PRECISION_HINT on both sides"),
    threads: int = typer.Option(0, help="INFERENCE_NUM_THREADS per stage and baseline (0: default)"),
    link_delay_ms: float = typer.Option(0.0, help="emulated one-way latency on every cluster hop "
                                                  "(the baseline has no hops)"),
    cpu_sets: str = typer.Option("shared", help="shared: every stage may use every core | "
                                                "split: each node its own cores (separate PCs)"),
    layers: str = typer.Option("", help="layer split, e.g. 0-16,17-29 (default: --stages "
                                        "even ranges)"),
    row_groups: int = typer.Option(-1, help="coordinator --row-groups: batch decode steps "
                                            "into this many row groups (0: none; -1: the "
                                            "local default, see local_row_groups)"),
    baseline: bool = typer.Option(True, help="also measure openvino_genai"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    from common.paths import zctl_home

    cache = zctl_home()
    hf_dir = model_hf_dir(model, cache)
    export_dir = cached_export(hf_dir, export_name(model, hf_dir), stages, weights, True,
                               cache, layers)
    stages = len(load_manifest(export_dir).stages)
    groups = local_row_groups(cpu_sets, stages, None if row_groups < 0 else row_groups,
                              link_delay_ms)
    props = plugin_properties(precision, threads)
    genai = genai_users(hf_dir, export_dir, weights, props) if baseline else None
    record = start_local_cluster(export_dir, stages, runtime_args(
        props.get("INFERENCE_PRECISION_HINT"), threads or None, "CPU"), cache / "bench-microbatch",
        link_delay_ms=link_delay_ms, cpu_sets=cpu_sets, row_groups=groups)
    samples: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    per_stream: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    try:
        wait_serving(record, 300)
        cluster_aggregate(record.serve, PROMPTS[:1], 8)  # warm-up
        rss_one = cluster_rss_mb(record.pids)
        for run in range(runs):  # every system and configuration once per run: drift hits all
            for n in STREAM_COUNTS:
                prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
                for mode in MODES:
                    if mode.startswith("genai"):
                        if genai is None:
                            continue
                        result = (genai.concurrent if mode == "genai_cb"
                                  else genai.sequential)(n, tokens)
                    else:
                        result = cluster_aggregate(record.serve, prompts, tokens,
                                                   "lookup" if mode == "lookup" else "")
                    samples[mode].setdefault(str(n), []).append(result["aggregate_tok_s"])
                    per_stream[mode].setdefault(str(n), []).append(
                        statistics.mean(result["per_stream_tok_s"]))
                    err.print(f"run {run + 1}/{runs} {mode:10s} {n} streams: "
                              f"{result['aggregate_tok_s']:.1f} tok/s")
            if run == 0:
                rss_four = cluster_rss_mb(record.pids)
    finally:
        stop_processes(record.pids)

    def med(table: dict[str, dict[str, list[float]]], mode: str) -> dict[str, float]:
        return {n: round(statistics.median(v), 2) for n, v in table[mode].items()}

    cluster = med(samples, "cluster")
    result: dict[str, Any] = {
        "model": model, "stages": stages, "weights": weights, "tokens": tokens, "runs": runs,
        "properties": props, "link_delay_ms": link_delay_ms,
        "cpu_sets": cpu_sets, "row_groups": groups,
        "layers": [f"{st.layer_start}-{st.layer_end - 1}"
                   for st in load_manifest(export_dir).stages],
        "cluster_tok_s": cluster,
        "cluster_spec_tok_s": med(samples, "lookup"),
        "cluster_per_stream_tok_s": med(per_stream, "cluster"),
        "scaling": {n: round(v / cluster["1"], 3) for n, v in cluster.items()},
        "scaling_paired": paired_scaling(samples["cluster"]),
        "memory_per_stream_mb": round(max(rss_four - rss_one, 0.0) / (max(STREAM_COUNTS) - 1), 1),
        "samples": samples,
    }
    if genai is not None:
        sequential = med(samples, "genai_seq")
        result.update({
            "baseline_tok_s": sequential["1"],  # one user on LLMPipeline
            "baseline_sequential_tok_s": sequential,
            "baseline_cb_tok_s": med(samples, "genai_cb"),
            "ratio_to_baseline": {n: round(v / sequential["1"], 3) for n, v in cluster.items()},
        })
    if as_json:
        print(json.dumps(result))
        return
    table = Table(title=f"aggregate decode tok/s, {stages}-node local cluster, {model} {weights}")
    for column in ("streams", "cluster", "cluster + lookup", "scaling", "genai sequential",
                   "genai continuous batching"):
        table.add_column(column, justify="right")
    for n in map(str, STREAM_COUNTS):
        table.add_row(n, str(cluster[n]), str(result["cluster_spec_tok_s"][n]),
                      f"{result['scaling'][n]:.2f}x",
                      str(result.get("baseline_sequential_tok_s", {}).get(n, "-")),
                      str(result.get("baseline_cb_tok_s", {}).get(n, "-")))
    Console().print(table)
    Console().print(f"memory per extra stream: {result['memory_per_stream_mb']} MB")


if __name__ == "__main__":
    typer.run(main)
