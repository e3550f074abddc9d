"""One-stream throughput of a local multi-node cluster against the monolithic baseline.

The cluster is the real thing: a coordinator process and node processes on distinct
loopback addresses, driven through the generation service exactly as ``zctl run``
drives it. The baseline (openvino_genai LLMPipeline on an optimum-intel export) runs in
this process; the two are interleaved run by run with the same plugin hints. Whole runs
drift by +-10% here, so the tool also steps the cluster's data plane and our 1-stage
chain token by token (``cluster_over_stage1_interleaved``): the cluster's cost over one
monolithic stage without that drift (tools.decode.parity relates the 1-stage chain to genai).
It leans in the cluster's favour: stepped in turn, the 1-stage chain also starts each
step after an idle gap (the cluster's step), which a monolithic model running alone never
has; tools/decode/idle_gap measures what such a gap costs. The cluster's extra cost per
token is mostly fixed (two hops, a second dispatch, framework), so the ratio rises with
the model: ``--model random-1b`` measures a Llama-3.2-1B-shaped model.

    python -m tools.decode.cluster [--model smollm2-135m] [--stages 2] [--json]
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from tools.harness.cluster import local_cluster
from tools.harness.greedy import paired_step_ms
from tools.harness.models import PROMPT, BenchModel, plugin_properties
from tools.harness.options import Json, Model, Nodes, Precision, Runs, Threads, Tokens, Weights
from tools.harness.report import err, metric_table
from tools.harness.service import generate_done
from tools.harness.stats import paired_ratio, rounded
from zctl.engine.tokenizer import ChatTokenizer
from zctl.launcher.processes import runtime_spec

if TYPE_CHECKING:
    from tools.harness.baseline import BaselinePipeline

CLUSTER = object()  # the cluster's turn in a run's order


def cluster_run(serve: str, prompt: str, tokens: int) -> dict[str, Any]:
    """One greedy request through the cluster's generation service: tok/s, TTFT, timings."""
    done = generate_done(serve, prompt, tokens)
    return {"tok_s": done.tok_s, "ttft_ms": done.ttft_ms, "timing": done.timing}


def interleaved(export_dir: Path, stage1_dir: Path, threads: int, props: dict[str, Any],
                prompt_ids: list[int], tokens: int, root: Path | None = None) -> dict[str, Any]:
    """The cluster's data plane (zctl.launcher.data_plane.local_data_plane: stage 0 in this
    process, the other stages as worker processes on their loopback addresses, logging
    under ``root``) and the 1-stage chain, stepped token by token in rotating order: their
    step-time ratio without the drift between whole runs (the 1-stage chain is what
    tools.decode.parity compares with openvino_genai)."""
    from dataplane.head.local_chain import LocalChain
    from dataplane.runtime.config import RuntimeSpec
    from zctl.launcher.data_plane import local_data_plane

    kv = props.get("KV_CACHE_PRECISION")
    config = RuntimeSpec(precision=props.get("INFERENCE_PRECISION_HINT"),
                         num_threads=threads or None, kv_cache_precision=kv)
    with local_data_plane(export_dir, RuntimeSpec(num_threads=threads or None,
                                                  kv_cache_precision=kv), root) as pipe:
        step_ms = paired_step_ms({"stage1": LocalChain.load(str(stage1_dir), config),
                                  "cluster": pipe}, prompt_ids, tokens)
    return {"interleaved_step_ms": {k: round(v, 3) for k, v in step_ms.items()},
            "cluster_over_stage1_interleaved": round(step_ms["stage1"] / step_ms["cluster"], 3)}


def time_per_token(cluster_tok_s: float, baseline_tok_s: float,
                   timing: dict[str, dict[str, float]], stages: int) -> dict[str, float]:
    """Where a cluster run's time per token went, beside its paired baseline run's: the
    stages' compute (sum of their p50s), the rest of a step (wire and framework, p50) and
    ``compute_over_baseline``, the stages' compute alone over the baseline's whole token
    (above 1, splitting the model cost more than every hop together)."""
    compute = sum(timing.get(f"stage{i}.compute", {}).get("p50", 0.0) for i in range(stages))
    step = timing.get("total", {}).get("p50", 0.0)
    baseline_ms = 1e3 / baseline_tok_s if baseline_tok_s > 0 else 0.0
    return {
        "baseline_ms": round(baseline_ms, 3),
        "cluster_ms": round(1e3 / cluster_tok_s if cluster_tok_s > 0 else 0.0, 3),
        "cluster_compute_ms": round(compute, 3),
        "cluster_wire_and_framework_ms": round(max(0.0, step - compute), 3),
        "compute_over_baseline": round(compute / baseline_ms, 3) if baseline_ms else 0.0,
    }


def alternated_runs(serve: str, baseline: BaselinePipeline, baseline_thp: BaselinePipeline | None,
                    prompt_ids: list[int], tokens: int, runs: int
                    ) -> tuple[list[float], list[dict[str, Any]], list[float]]:
    """``runs`` runs of the baseline, the cluster and (if any) the huge-page baseline, the
    baselines swapping sides of the cluster run every run (order effects): the baseline's
    tok/s, the cluster's runs, the huge-page baseline's tok/s."""
    base_runs: list[float] = []
    cluster_runs: list[dict[str, Any]] = []
    thp_runs: list[float] = []
    for run in range(runs):
        order = [baseline, CLUSTER, baseline_thp]
        for system in order if run % 2 == 0 else order[::-1]:
            if system is CLUSTER:
                cluster_runs.append(cluster_run(serve, PROMPT, tokens))
            elif system is baseline:
                base_runs.append(baseline.generate_timed(prompt_ids, tokens)["tok_s"])
            elif system is not None:
                thp_runs.append(system.generate_timed(prompt_ids, tokens)["tok_s"])
        err.print(f"run {run + 1}/{runs}: baseline {base_runs[-1]:.1f}  "
                  f"cluster {cluster_runs[-1]['tok_s']:.1f} tok/s")
    return base_runs, cluster_runs, thp_runs


def cluster_figures(stages: int, base_runs: list[float], cluster_runs: list[dict[str, Any]]
                    ) -> dict[str, Any]:
    """The cluster against the baseline: ratios of medians and paired, and the median
    cluster run's time split (against the baseline run beside it)."""
    runs = len(cluster_runs)
    median_run = sorted(range(runs), key=lambda i: cluster_runs[i]["tok_s"])[runs // 2]
    best = cluster_runs[median_run]
    timing = best["timing"]
    cluster_tok_s = statistics.median(r["tok_s"] for r in cluster_runs)
    baseline_tok_s = statistics.median(base_runs)
    return {
        "cluster_tok_s": round(cluster_tok_s, 2), "baseline_tok_s": round(baseline_tok_s, 2),
        "ratio": round(cluster_tok_s / baseline_tok_s, 3),
        # each run's cluster figure over the baseline run beside it: free of the
        # drift between runs (+-10% here), which the ratio of medians mixes in
        "ratio_paired": rounded(paired_ratio([r["tok_s"] for r in cluster_runs], base_runs)),
        "overhead_ms_per_hop": round(timing.get("overhead", {}).get("p50", 0.0) / stages, 3),
        "step_ms_p50": round(timing.get("total", {}).get("p50", 0.0), 2),
        "compute_ms_p50": {f"stage{i}": round(timing.get(f"stage{i}.compute", {}).get("p50", 0.0), 2)
                           for i in range(stages)},
        "network_ms_p50": round(timing.get("network", {}).get("p50", 0.0), 3),
        "ms_per_token": time_per_token(best["tok_s"], base_runs[median_run], timing, stages),
    }


def thp_figures(cluster_runs: list[dict[str, Any]], thp_runs: list[float]) -> dict[str, Any]:
    """The cluster against openvino_genai on huge pages (nothing without those runs)."""
    if not thp_runs:
        return {}
    cluster_tok_s = statistics.median(r["tok_s"] for r in cluster_runs)
    thp_tok_s = statistics.median(thp_runs)
    return {"baseline_thp_tok_s": round(thp_tok_s, 2),
            "ratio_vs_thp_baseline": round(cluster_tok_s / thp_tok_s, 3),
            "ratio_vs_thp_baseline_paired": rounded(paired_ratio(
                [r["tok_s"] for r in cluster_runs], thp_runs))}


def main(
    model: Model = "smollm2-135m",
    stages: Nodes = 2,
    weights: Weights = "int4",
    tokens: Tokens = 128,
    runs: Runs = 5,
    precision: Precision = "f32",
    threads: Threads = 0,
    kv_cache_precision: Annotated[str, typer.Option(
        help="KV_CACHE_PRECISION on both sides: 'default' (the plugin's, u8 on CPU: what the "
             "cluster runs unless --exact), f32, u8, ...")] = "default",
    interleave: Annotated[bool, typer.Option(
        help="also step a cluster of the same stages and the 1-stage chain token by token in "
             "rotating order (cluster_over_stage1_interleaved: free of the drift between "
             "runs, but the 1-stage chain pays an idle gap too)")] = True,
    thp_baseline: Annotated[bool, typer.Option(
        help="also time openvino_genai with its memory on huge pages, as the stage runners' "
             "weights are (ratio_vs_thp_baseline)")] = True,
    as_json: Json = False,
) -> None:
    from tools.harness.baseline import BaselinePipeline, export_baseline_like

    bench_model = BenchModel.resolve(model)
    export_dir = bench_model.export(stages, weights)
    props = plugin_properties(precision, threads)
    if kv_cache_precision != "default":
        props["KV_CACHE_PRECISION"] = kv_cache_precision
    baseline_dir = export_baseline_like(bench_model.hf_dir, export_dir, weights, console=err)
    baseline = BaselinePipeline(baseline_dir, props)
    baseline_thp = BaselinePipeline(baseline_dir, props, huge_pages=True) if thp_baseline else None
    prompt_ids = ChatTokenizer(export_dir).encode(PROMPT)
    with local_cluster(export_dir, stages, runtime_spec(
            props.get("INFERENCE_PRECISION_HINT"), threads or None, "CPU", kv_cache_precision),
            bench_model.cache / "bench-cluster") as record:
        cluster_run(record.serve, PROMPT, 8)  # warm-up
        base_runs, cluster_runs, thp_runs = alternated_runs(
            record.serve, baseline, baseline_thp, prompt_ids, tokens, runs)
    result = {
        "model": model, "stages": stages, "weights": weights, "tokens": tokens, "runs": runs,
        "properties": props, **cluster_figures(stages, base_runs, cluster_runs),
        "samples": {"baseline": [round(v, 2) for v in base_runs],
                    "cluster": [round(r["tok_s"], 2) for r in cluster_runs],
                    **({"baseline_thp": [round(v, 2) for v in thp_runs]} if thp_runs else {})},
        **thp_figures(cluster_runs, thp_runs),
    }
    if interleave:
        result.update(interleaved(export_dir, bench_model.export(1, weights), threads, props,
                                  prompt_ids, tokens, bench_model.cache / "bench-cluster"))
    if as_json:
        print(json.dumps(result))
        return
    Console().print(metric_table(f"{stages}-node local cluster vs monolithic, {model} {weights}",
                                 result, skip=("samples", "properties")))


if __name__ == "__main__":
    typer.run(main)
