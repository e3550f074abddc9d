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

    python -m tools.decode.microbatch [--model smollm2-135m] [--tokens 64] [--runs 3] [--json]
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import psutil
import typer
from rich.console import Console
from rich.table import Table

from tools.harness.cluster import local_cluster
from tools.harness.models import BenchModel, plugin_properties
from tools.harness.options import CpuSets, Json, Model, Nodes, Precision, Threads, Weights
from tools.harness.report import err
from tools.harness.service import bench_request, generate_together
from tools.harness.stats import paired_ratio, rounded
from zctl.launcher.local import local_row_groups
from zctl.launcher.processes import runtime_spec
from zctl.manifest import load_manifest

if TYPE_CHECKING:
    from tools.harness.baseline import GenaiUsers

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
    requests = [bench_request(p, tokens, speculative=speculative) for p in prompts]
    dones, span = generate_together(serve, requests)
    after_first = sum(len(d.tokens) - 1 for d in dones)
    return {"aggregate_tok_s": after_first / span,
            "per_stream_tok_s": [round(d.tok_s, 2) for d in dones],
            "acceptance": [d.spec.get("acceptance") for d in dones]}


def paired_scaling(samples: dict[str, list[float]]) -> dict[str, float | None]:
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
    from tools.harness.baseline import GenaiUsers, export_baseline_like

    model_dir = export_baseline_like(hf_dir, export_dir, weights, console=err)
    return GenaiUsers(model_dir, props, PROMPTS, warmup_streams=max(STREAM_COUNTS))


SampleTable = dict[str, dict[str, list[float]]]  # mode -> stream count -> one figure a run


def measure_mode(serve: str, genai: GenaiUsers | None, mode: str, n: int,
                 tokens: int) -> dict[str, Any] | None:
    """One run of ``mode`` with ``n`` streams (None: a genai mode without genai)."""
    if mode.startswith("genai"):
        if genai is None:
            return None
        return (genai.concurrent if mode == "genai_cb" else genai.sequential)(n, tokens)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    return cluster_aggregate(serve, prompts, tokens, "lookup" if mode == "lookup" else "")


def interleaved_runs(serve: str, pids: list[int], genai: GenaiUsers | None, tokens: int,
                     runs: int) -> tuple[SampleTable, SampleTable, float]:
    """Every system and configuration once per run, so drift hits all: the aggregate and
    the mean per-stream tok/s of each, and the cluster's memory per extra stream (MB,
    from its resident memory before and after the first run)."""
    samples: SampleTable = {m: {} for m in MODES}
    per_stream: SampleTable = {m: {} for m in MODES}
    cluster_aggregate(serve, PROMPTS[:1], 8)  # warm-up
    rss_one = rss_four = cluster_rss_mb(pids)
    for run in range(runs):
        for n in STREAM_COUNTS:
            for mode in MODES:
                result = measure_mode(serve, genai, mode, n, tokens)
                if result is None:
                    continue
                samples[mode].setdefault(str(n), []).append(result["aggregate_tok_s"])
                per_stream[mode].setdefault(str(n), []).append(
                    statistics.mean(result["per_stream_tok_s"]))
                err.print(f"run {run + 1}/{runs} {mode:10s} {n} streams: "
                          f"{result['aggregate_tok_s']:.1f} tok/s")
        if run == 0:
            rss_four = cluster_rss_mb(pids)
    memory = round(max(rss_four - rss_one, 0.0) / (max(STREAM_COUNTS) - 1), 1)
    return samples, per_stream, memory


def medians(table: SampleTable, mode: str) -> dict[str, float]:
    """``mode``'s median per stream count."""
    return {n: round(statistics.median(v), 2) for n, v in table[mode].items()}


def microbatch_figures(samples: SampleTable, per_stream: SampleTable, memory_mb: float,
                       genai: bool) -> dict[str, Any]:
    """The cluster's aggregates, scaling and memory, and (``genai``) openvino_genai's."""
    cluster = medians(samples, "cluster")
    figures: dict[str, Any] = {
        "cluster_tok_s": cluster,
        "cluster_spec_tok_s": medians(samples, "lookup"),
        "cluster_per_stream_tok_s": medians(per_stream, "cluster"),
        "scaling": {n: round(v / cluster["1"], 3) for n, v in cluster.items()},
        "scaling_paired": {n: rounded(v) for n, v in paired_scaling(samples["cluster"]).items()},
        "memory_per_stream_mb": memory_mb,
        "samples": samples,
    }
    if genai:
        sequential = medians(samples, "genai_seq")
        figures.update({
            "baseline_tok_s": sequential["1"],  # one user on LLMPipeline
            "baseline_sequential_tok_s": sequential,
            "baseline_cb_tok_s": medians(samples, "genai_cb"),
            "ratio_to_baseline": {n: round(v / sequential["1"], 3) for n, v in cluster.items()},
        })
    return figures


def microbatch_table(result: dict[str, Any]) -> Table:
    """The table printed without --json: one row per stream count."""
    table = Table(title=f"aggregate decode tok/s, {result['stages']}-node local cluster, "
                        f"{result['model']} {result['weights']}")
    for column in ("streams", "cluster", "cluster + lookup", "scaling", "genai sequential",
                   "genai continuous batching"):
        table.add_column(column, justify="right")
    for n in map(str, STREAM_COUNTS):
        table.add_row(n, str(result["cluster_tok_s"][n]), str(result["cluster_spec_tok_s"][n]),
                      f"{result['scaling'][n]:.2f}x",
                      str(result.get("baseline_sequential_tok_s", {}).get(n, "-")),
                      str(result.get("baseline_cb_tok_s", {}).get(n, "-")))
    return table


def main(
    model: Model = "smollm2-135m",
    stages: Nodes = 2,
    weights: Weights = "int4",
    tokens: Annotated[int, typer.Option(help="new tokens per stream")] = 64,
    runs: Annotated[int, typer.Option(
        help="interleaved runs per configuration (median reported)")] = 3,
    precision: Precision = "f32",
    threads: Threads = 0,
    link_delay_ms: Annotated[float, typer.Option(
        help="emulated one-way latency on every cluster hop (the baseline has no hops)")] = 0.0,
    cpu_sets: CpuSets = "shared",
    layers: Annotated[str, typer.Option(
        help="layer split, e.g. 0-16,17-29 (default: --stages cost-balanced ranges)")] = "",
    row_groups: Annotated[int, typer.Option(
        help="coordinator --row-groups: batch decode steps into this many row groups (0: "
             "none; -1: the local default, see local_row_groups)")] = -1,
    baseline: Annotated[bool, typer.Option(help="also measure openvino_genai")] = True,
    as_json: Json = False,
) -> None:
    bench_model = BenchModel.resolve(model)
    export_dir = bench_model.export(stages, weights, layers=layers)
    stages = len(load_manifest(export_dir).stages)
    groups = local_row_groups(cpu_sets, stages, None if row_groups < 0 else row_groups,
                              link_delay_ms)
    props = plugin_properties(precision, threads)
    genai = genai_users(bench_model.hf_dir, export_dir, weights, props) if baseline else None
    with local_cluster(export_dir, stages, runtime_spec(
            props.get("INFERENCE_PRECISION_HINT"), threads or None, "CPU"),
            bench_model.cache / "bench-microbatch", link_delay_ms=link_delay_ms,
            cpu_sets=cpu_sets, row_groups=groups) as record:
        samples, per_stream, memory_mb = interleaved_runs(record.serve, record.pids, genai,
                                                          tokens, runs)
    result: dict[str, Any] = {
        "model": model, "stages": stages, "weights": weights, "tokens": tokens, "runs": runs,
        "properties": props, "link_delay_ms": link_delay_ms,
        "cpu_sets": cpu_sets, "row_groups": groups,
        "layers": [f"{st.layer_start}-{st.layer_end - 1}"
                   for st in load_manifest(export_dir).stages],
        **microbatch_figures(samples, per_stream, memory_mb, genai is not None),
    }
    if as_json:
        print(json.dumps(result))
        return
    Console().print(microbatch_table(result))
    Console().print(f"memory per extra stream: {result['memory_per_stream_mb']} MB")


if __name__ == "__main__":
    typer.run(main)
