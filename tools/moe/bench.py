"""Mixture of experts against openvino_genai: decode tok/s of a Qwen3-30B-A3B-shaped MoE.

A random Qwen3-MoE of Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts 768 wide, 8
active; ``--layers`` decoder layers, a 1024-token vocabulary), INT4, runs as:
  openvino_genai  LLMPipeline on optimum-intel's monolithic export of the same checkpoint
                  (tools.harness.baseline), in this process
  stage1          zctl's 1-stage shard, in this process (as tools.decode.parity runs it)
  cluster         zctl's 2 stages on a 2-node local cluster, through its generation service
                  (as tools.decode.cluster runs it); ``--placement split`` (the default)
                  gives each node its own cores and this process the first node's, as two
                  PCs against one of the same size (tools.moe.placement)
  experts-256     zctl's 1-stage shard of the same model with twice the experts (8 active)
  dense-equal     zctl's 1-stage shard of a dense model with as many MLP weights
All interleaved run by run with the same plugin hints: openvino_genai opens and closes every
run, the others rotate between. The targets (tools.moe.targets) are judged on paired
ratios. When optimum-intel cannot export the checkpoint, or openvino_genai cannot run it,
the reason is printed and the rest is measured.

    python -m tools.moe.bench [--layers 4] [--tokens 128] [--runs 9]
        [--placement split|shared] [--json]
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from tools.harness.models import PROMPT, plugin_properties
from tools.harness.options import Json, Precision, Runs, Threads, Tokens, fail
from tools.harness.order import rotated
from tools.harness.report import err, run_record
from tools.harness.stats import rounded
from tools.moe.models import moe_model
from tools.moe.placement import bench_placement
from tools.moe.targets import judge, median_tok_s, moe_ratios

System = Callable[[], float]  # one greedy run -> decode tok/s
# as many layers as a 24 GB PC exports: the 256-expert twin's export peaked at 11.6 GB
# resident with 2 layers and 18.0 GB with 4 (2026-12-08, Intel Xeon (Ice Lake)), ~3 GB a
# layer, so a fifth would leave no room on this 23 GB machine
DEFAULT_LAYERS = 4


def baseline_system(hf_dir: Path, stage1_dir: Path, props: dict[str, Any],
                    prompt_ids: list[int], tokens: int) -> tuple[System | None, str]:
    """openvino_genai on optimum-intel's export of ``hf_dir`` (loaded and warmed up) and
    what it is; None and the reason when the export or the pipeline fails."""
    from tools.harness.baseline import BaselinePipeline, export_baseline_like

    try:
        baseline_dir = export_baseline_like(hf_dir, stage1_dir, "int4", console=err)
    except RuntimeError as exc:
        return None, f"optimum-intel could not export the checkpoint: {exc}"
    try:
        pipeline = BaselinePipeline(baseline_dir, props)
    except Exception as exc:  # noqa: BLE001 (the reason is the result)
        return None, f"openvino_genai could not run optimum-intel's export: {exc}"
    return (lambda: pipeline.generate_timed(prompt_ids, tokens)["tok_s"],
            f"openvino_genai LLMPipeline on {baseline_dir}")


def chain_system(export_dir: Path, props: dict[str, Any], threads: int,
                 prompt_ids: list[int], tokens: int) -> System:
    """zctl's stage chain of ``export_dir`` in this process (warmed up)."""
    from dataplane.runtime.config import RuntimeSpec
    from tools.decode.parity import chain_runner

    run = chain_runner(export_dir, RuntimeSpec(
        precision=props.get("INFERENCE_PRECISION_HINT"), num_threads=threads or None,
        performance_hint="LATENCY"))
    return lambda: run(prompt_ids, tokens)


class ClusterSystem:
    """Greedy runs through a local cluster's generation service, each run's step timing
    kept (``split``: where the median run's time per token went)."""

    def __init__(self, serve: str, tokens: int) -> None:
        self.serve = serve
        self.tokens = tokens
        self.runs: list[dict[str, Any]] = []

    def __call__(self) -> float:
        from tools.decode.cluster import cluster_run

        self.runs.append(cluster_run(self.serve, PROMPT, self.tokens))
        return self.runs[-1]["tok_s"]

    def split(self, stages: int) -> dict[str, float]:
        """The median run's p50 per token: each stage's compute and the rest of a step
        (the hops and the framework around them), in ms."""
        median_run = sorted(self.runs, key=lambda run: run["tok_s"])[len(self.runs) // 2]
        timing = median_run["timing"]
        compute = {f"stage{i}_compute_ms": round(timing.get(f"stage{i}.compute", {})
                                                 .get("p50", 0.0), 3) for i in range(stages)}
        step = timing.get("total", {}).get("p50", 0.0)
        return {"step_ms": round(step, 3), **compute,
                "wire_and_framework_ms": round(max(0.0, step - sum(compute.values())), 3)}


def interleaved_runs(systems: dict[str, System], runs: int) -> dict[str, list[float]]:
    """``runs`` runs of every system: the baseline (if any) first and last in each run, the
    others in an order turning by one every run."""
    samples: dict[str, list[float]] = {name: [] for name in systems}
    others = [name for name in systems if name != "baseline"]
    for run in range(runs):
        order = rotated(others, run)
        if "baseline" in systems:
            order = ["baseline", *order, "baseline"]
        for name in order:
            samples[name].append(systems[name]())
        err.print(f"run {run + 1}/{runs}: " + "  ".join(
            f"{name} {values[-1]:.1f}" for name, values in samples.items()))
    return samples


def moe_result(head: dict[str, Any], samples: dict[str, list[float]]) -> dict[str, Any]:
    """The --json object: the settings, each system's median tok/s, the ratios, the
    targets and the samples."""
    ratios = moe_ratios(samples)
    return {**head, "tok_s": median_tok_s(samples),
            "ratios": {name: rounded(value) for name, value in ratios.items()},
            "targets": judge(ratios),
            "samples": {name: [round(v, 2) for v in values] for name, values in samples.items()}}


def render(result: dict[str, Any]) -> None:
    """The tables printed without --json."""
    console = Console()
    tok_s = Table(title=f"decode tok/s, random Qwen3-MoE ({result['layers']} layers) INT4, "
                        f"{result['tokens']} tokens, median of {result['runs']} runs")
    tok_s.add_column("system")
    tok_s.add_column("tok/s", justify="right")
    for name, value in result["tok_s"].items():
        tok_s.add_row(name, "-" if value is None else f"{value:.1f}")
    console.print(tok_s)
    console.print(f"baseline: {result['baseline']}", highlight=False)
    if "cluster_split" in result:
        console.print(f"cluster, median run, p50 per token: {result['cluster_split']}",
                      highlight=False)
    targets = Table(title="targets (paired ratios, median over runs)")
    for column in ("target", "value", "bound", "met"):
        targets.add_column(column)
    for name, verdict in result["targets"].items():
        sign = ">=" if verdict["kind"] == "at_least" else "<"
        targets.add_row(name, "-" if verdict["value"] is None else f"{verdict['value']:.3f}",
                        f"{sign} {verdict['target']}",
                        {True: "[green]yes[/]", False: "[red]no[/]", None: "-"}[verdict["met"]])
    console.print(targets)


def main(layers: Annotated[int, typer.Option(
             help="decoder layers of each model (>= 2: the cluster has 2 stages); 4, the "
                  "most a 24 GB PC exports: the 256-expert twin's export peaks at 18 GB")]
         = DEFAULT_LAYERS,
         tokens: Tokens = 128, runs: Runs = 9, precision: Precision = "f32",
         threads: Threads = 0, as_json: Json = False,
         cluster: Annotated[bool, typer.Option(help="also run the 2-node local cluster")]
         = True,
         placement: Annotated[str, typer.Option(
             help="split: each node its own cores, as 2 PCs, and openvino_genai and the "
                  "1-stage shards on the first node's (one such PC) | shared: every "
                  "process on every core")] = "split") -> None:
    from tools.decode.cluster import cluster_run
    from tools.harness.cluster import local_cluster
    from zctl.engine.tokenizer import ChatTokenizer
    from zctl.launcher.cpusets import confine_to
    from zctl.launcher.processes import runtime_spec
    from zctl.paths import zctl_home

    if layers < 1:
        fail(f"--layers must be >= 1, got {layers}")
    if layers < 2 and cluster:
        fail("--layers must be >= 2 for the 2-node cluster (or pass --no-cluster)")
    if tokens < 2 or runs < 1:
        fail("--tokens must be >= 2 and --runs >= 1")
    try:
        place = bench_placement(placement, sorted(os.sched_getaffinity(0)))
    except ValueError as exc:
        fail(str(exc))
    cache = zctl_home()
    moe = moe_model("experts-128", layers, cache)
    stage1_dir = moe.export(1, "int4")
    props = plugin_properties(precision, threads)
    prompt_ids = ChatTokenizer(stage1_dir).encode(PROMPT)
    head = {"run": run_record(), "model": "random Qwen3-MoE, Qwen3-30B-A3B layer shape",
            "layers": layers, "weights": "int4", "tokens": tokens, "runs": runs,
            "properties": props, "placement": place.mode,
            "cpus": {"bench": place.bench_cpus, "nodes": list(place.node_cpus)}}
    with ExitStack() as stack:
        # the cluster's processes start before this one is confined (they inherit its
        # cores and confine themselves to theirs), and this one before it loads a plugin
        # (OpenVINO sizes its threads from the cores it may use)
        record = stack.enter_context(local_cluster(
            moe.export(2, "int4"), 2, runtime_spec(props.get("INFERENCE_PRECISION_HINT"),
                                                   threads or None, "CPU"),
            cache / "bench-moe-cluster", cpu_sets=place.mode, cpus=list(place.node_cpus))
        ) if cluster else None
        if place.bench_cpus is not None:
            confine_to(place.bench_cpus)
        systems: dict[str, System] = {}
        baseline, head["baseline"] = baseline_system(moe.hf_dir, stage1_dir, props,
                                                     prompt_ids, tokens)
        if baseline is not None:
            systems["baseline"] = baseline
        else:
            err.print(f"[yellow]no baseline:[/] {head['baseline']}", highlight=False)
        systems["stage1"] = chain_system(stage1_dir, props, threads, prompt_ids, tokens)
        for name in ("experts-256", "dense-equal"):
            systems[name] = chain_system(moe_model(name, layers, cache).export(1, "int4"),
                                         props, threads, prompt_ids, tokens)
        cluster_system = None
        if record is not None:
            cluster_system = ClusterSystem(record.serve, tokens)
            cluster_run(record.serve, PROMPT, 8)  # warm-up
            systems["cluster"] = cluster_system
        samples = interleaved_runs(systems, runs)
    if cluster_system is not None:
        head["cluster_split"] = cluster_system.split(2)
    result = moe_result(head, samples)
    if as_json:
        print(json.dumps(result))
        return
    render(result)


if __name__ == "__main__":
    typer.run(main)
