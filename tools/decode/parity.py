"""Decode-throughput parity: our stage shards against the monolithic model users would pick.

Systems, interleaved run by run in one process with the same plugin hints (the baseline
opens and closes every run: ``bracketed_ratios`` holds each system's median over runs of
its tok/s over that run's two baseline figures, which cancels the drift between runs; the
``*_ratio`` fields are ratios of medians over all runs):
  baseline      openvino_genai LLMPipeline on an optimum-intel monolithic export
  stage1        our 1-stage shard (beam_idx Gather injected)
  stage1_nobeam our 1-stage shard without the Gather (the paper's ablation)
  stage2/3      2 and 3 stages chained in one process
  (and, stepped token by token against each other, stage2/stage3 over stage1:
  ``stage2_over_stage1`` is a stage boundary's cost without run-to-run drift)
Extra columns (``--extras``, on by default), for like-for-like reading:
  baseline_sdpa openvino_genai with ATTENTION_BACKEND=SDPA: the stateful-model path, the same
                kind of graph as our shards (the default LLMPipeline on CPU uses paged attention)
  baseline_thp  openvino_genai with its memory on huge pages, as zctl's stage runners put
                their compiled weights (dataplane.runtime.hugepages): the like-for-like baseline
  stage1_sync   our 1-stage shard stepped with a synchronous infer() on the calling thread
                (the runtime before it switched to start_async()+wait(), as genai does)
The plain ``baseline`` column stays what users would pick: a default LLMPipeline with the
same weights and precision hints; every ratio is against it.

    python -m tools.decode.parity [--model smollm2-135m|random-1b|DIR] [--weights int4] [--json]
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from tools.harness.greedy import paired_step_ms, timed_greedy
from tools.harness.models import PROMPT, BenchModel, plugin_properties
from tools.harness.options import Json, Model, Precision, Threads, Tokens, Weights
from tools.harness.report import err
from tools.harness.stats import paired_ratio, rounded
from zctl.engine.tokenizer import ChatTokenizer

SYSTEMS = ("baseline", "stage1", "stage1_nobeam", "stage2", "stage3")
EXTRA_SYSTEMS = ("baseline_sdpa", "baseline_thp", "stage1_sync")
System = Callable[[list[int], int], float]  # (prompt ids, tokens) -> decode tok/s


@dataclass(frozen=True)
class SyncInferConfig(RuntimeSpec):
    """The runtime's previous step path: a synchronous infer() on the calling thread."""

    async_infer = False


def chain_runner(export_dir: Path, config: RuntimeSpec) -> System:
    """A system running our stage chain of ``export_dir`` in this process (warmed up)."""
    chain = LocalChain.load(str(export_dir), config)

    def run(prompt_ids: list[int], tokens: int) -> float:
        return timed_greedy(chain, prompt_ids, tokens)[1].tok_s

    run(prompt_ids=[1, 2, 3], tokens=4)  # warm-up: first inference pays one-off costs
    return run


def ratios(medians: dict[str, float]) -> dict[str, float]:
    """Each system's median over the baseline's."""
    base = medians["baseline"]
    return {f"{name}_ratio": round(value / base, 3) for name, value in medians.items()
            if name != "baseline"}


def bracketed_ratios(samples: dict[str, list[float]], brackets: list[tuple[float, float]]
                     ) -> dict[str, float | None]:
    """Per system, the median over runs of its tok/s over the mean of the two baseline
    runs that bracket that run (measured first and last in it).

    Whole runs here drift by +-10% within seconds; the ratio of medians compares
    measurements up to a run's length apart, this one only within a run, where the
    drift is common to both sides and, when linear, cancels against the bracket."""
    bases = [(a + b) / 2 for a, b in brackets]
    return {name: paired_ratio(values, bases) for name, values in samples.items()
            if name != "baseline"}


def parity_exports(model: BenchModel, weights: str) -> dict[str, Path]:
    """Our systems' exports: 1 stage with and without beam_idx, 2 and 3 stages."""
    return {"stage1": model.export(1, weights),
            "stage1_nobeam": model.export(1, weights, beam_idx=False),
            "stage2": model.export(2, weights), "stage3": model.export(3, weights)}


def build_systems(exports: dict[str, Path], baseline_dir: Path, props: dict[str, Any],
                  config: RuntimeSpec, extras: bool) -> dict[str, System]:
    """Every system of the comparison, loaded and warmed up, the baseline first."""
    from tools.harness.baseline import BaselinePipeline

    def genai(pipeline: BaselinePipeline) -> System:
        return lambda ids, n: pipeline.generate_timed(ids, n)["tok_s"]

    systems = {"baseline": genai(BaselinePipeline(baseline_dir, props))}
    for key, export_dir in exports.items():
        systems[key] = chain_runner(export_dir, config)
    if extras:
        systems["baseline_sdpa"] = genai(BaselinePipeline(
            baseline_dir, {**props, "ATTENTION_BACKEND": "SDPA"}))
        systems["baseline_thp"] = genai(BaselinePipeline(baseline_dir, props, huge_pages=True))
        systems["stage1_sync"] = chain_runner(exports["stage1"], SyncInferConfig(**asdict(config)))
    return systems


def bracketed_runs(systems: dict[str, System], names: Sequence[str], prompt_ids: list[int],
                   tokens: int, runs: int) -> tuple[dict[str, list[float]],
                                                    list[tuple[float, float]]]:
    """``runs`` runs of every system: tok/s samples per system and each run's two
    baseline figures. The baseline opens and closes every run; the others alternate
    their order."""
    samples: dict[str, list[float]] = {key: [] for key in names}
    brackets: list[tuple[float, float]] = []
    others = [key for key in names if key != "baseline"]
    for run in range(runs):
        first = systems["baseline"](prompt_ids, tokens)
        for key in others if run % 2 == 0 else others[::-1]:
            samples[key].append(systems[key](prompt_ids, tokens))
        last = systems["baseline"](prompt_ids, tokens)
        brackets.append((first, last))
        samples["baseline"] += [first, last]
        err.print(f"run {run + 1}/{runs}: baseline {first:.1f}/{last:.1f}  " + "  ".join(
            f"{k} {samples[k][-1]:.1f}" for k in others))
    return samples, brackets


def stage_boundary_cost(exports: dict[str, Path], config: RuntimeSpec, prompt_ids: list[int],
                        tokens: int) -> tuple[dict[str, float], dict[str, float]]:
    """The chains against each other, token by token (the baseline cannot be stepped so):
    what a stage boundary costs, free of the drift between whole runs. (ms per step of
    each chain, stage2/stage3 over stage1.)"""
    chains = {key: LocalChain.load(str(exports[key]), config)
              for key in ("stage1", "stage2", "stage3")}
    step_ms = paired_step_ms(chains, prompt_ids, tokens * 2)
    paired = {f"{key}_over_stage1": round(step_ms["stage1"] / step_ms[key], 4)
              for key in ("stage2", "stage3")}
    return step_ms, paired


def median_tok_s(samples: dict[str, list[float]]) -> dict[str, float]:
    """Each system's median tok/s over its runs."""
    return {key: statistics.median(values) for key, values in samples.items()}


def parity_result(head: dict[str, Any], config: RuntimeSpec, samples: dict[str, list[float]],
                  brackets: list[tuple[float, float]], step_ms: dict[str, float],
                  paired: dict[str, float]) -> dict[str, Any]:
    """The --json object, from the measurements (``head``: the run's settings)."""
    medians = median_tok_s(samples)
    return {
        **head,
        "baseline": "openvino_genai LLMPipeline, default attention backend (paged attention on CPU)",
        "runtime": {"properties": config.properties(), "async_infer": config.async_infer},
        **{f"{key}_tok_s": round(value, 2) for key, value in medians.items()},
        **ratios(medians),
        "bracketed_ratios": {key: rounded(value)
                             for key, value in bracketed_ratios(samples, brackets).items()},
        "samples": {key: [round(v, 2) for v in values] for key, values in samples.items()},
        "paired_step_ms": {key: round(v, 3) for key, v in step_ms.items()}, **paired,
    }


def render(result: dict[str, Any], names: Sequence[str], medians: dict[str, float],
           paired: dict[str, float]) -> None:
    """The table and the paired figures printed without --json."""
    table = Table(title=f"decode tok/s, {result['model']} {result['weights']}, "
                        f"{result['tokens']} tokens, median of {result['runs']}")
    table.add_column("system")
    table.add_column("tok/s", justify="right")
    table.add_column("vs baseline", justify="right")
    for key in names:
        ratio = medians[key] / medians["baseline"]
        table.add_row(key, f"{medians[key]:.1f}", f"{ratio:.3f}x")
    Console().print(table)
    Console().print("run by run against the baseline runs bracketing them: " + ", ".join(
        f"{key} {value:.3f}x" for key, value in result["bracketed_ratios"].items()))
    Console().print("token by token against 1 stage: " + ", ".join(
        f"{key} {value:.3f}x" for key, value in paired.items()))


def main(
    model: Model = "smollm2-135m",
    weights: Weights = "int4",
    tokens: Tokens = 128,
    runs: Annotated[int, typer.Option(
        help="interleaved runs per system (the median is reported)")] = 5,
    precision: Precision = "f32",
    threads: Threads = 0,
    as_json: Json = False,
    extras: Annotated[bool, typer.Option(
        help="also run baseline_sdpa and stage1_sync (see above)")] = True,
) -> None:
    from tools.harness.baseline import export_baseline_like

    bench_model = BenchModel.resolve(model)
    exports = parity_exports(bench_model, weights)
    baseline_dir = export_baseline_like(bench_model.hf_dir, exports["stage1"], weights,
                                        console=err)
    props = plugin_properties(precision, threads)
    config = RuntimeSpec(precision=props.get("INFERENCE_PRECISION_HINT"),
                         num_threads=threads or None, performance_hint="LATENCY")
    prompt_ids = ChatTokenizer(exports["stage1"]).encode(PROMPT)
    names = SYSTEMS + (EXTRA_SYSTEMS if extras else ())
    systems = build_systems(exports, baseline_dir, props, config, extras)
    samples, brackets = bracketed_runs(systems, names, prompt_ids, tokens, runs)
    step_ms, paired = stage_boundary_cost(exports, config, prompt_ids, tokens)
    head = {"model": model, "weights": weights, "tokens": tokens, "runs": runs,
            "properties": props}
    result = parity_result(head, config, samples, brackets, step_ms, paired)
    if as_json:
        print(json.dumps(result))
        return
    render(result, names, median_tok_s(samples), paired)


if __name__ == "__main__":
    typer.run(main)
