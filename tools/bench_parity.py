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
                their compiled weights (dataplane.hugepages): the like-for-like baseline
  stage1_sync   our 1-stage shard stepped with a synchronous infer() on the calling thread
                (the runtime before it switched to start_async()+wait(), as genai does)
The plain ``baseline`` column stays what users would pick: a default LLMPipeline with the
same weights and precision hints; every ratio is against it.

    python -m tools.bench_parity [--model smollm2-135m|random-1b|DIR] [--weights int4] [--json]
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from common.manifest import ManifestError, StaticKV, load_manifest
from dataplane.local_chain import LocalChain
from dataplane.runtime import RuntimeConfig
from engine.scheduler import generate_greedy
from engine.stats import GenerationStats
from engine.tokenizer import ChatTokenizer

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
SYSTEMS = ("baseline", "stage1", "stage1_nobeam", "stage2", "stage3")
EXTRA_SYSTEMS = ("baseline_sdpa", "baseline_thp", "stage1_sync")
err = Console(stderr=True)


def model_hf_dir(model: str, cache: Path) -> Path:
    """An HF directory for the model (the default GGUF dequantised; random-1b generated)."""
    from exporter.sources import DEFAULT_MODEL, default_model_hf_dir

    if model == DEFAULT_MODEL:
        return default_model_hf_dir(cache / "sources")
    if model == "random-1b":
        from tools.random_llama import write_random_llama

        path = cache / "sources" / "random-llama-3.2-1b"
        if not (path / "config.json").is_file():
            err.print("writing a random Llama-3.2-1B-shaped checkpoint ...")
            write_random_llama(path)
        return path
    return Path(model)


def export_name(model: str, hf_dir: Path) -> str:
    """The export cache's name for ``model``: a known model's short name, else its HF
    directory's name."""
    return model if model in ("smollm2-135m", "random-1b") else hf_dir.name


def model_export(model: str, stages: int, weights: str) -> Path:
    """The cached export of ``model`` in ``stages`` cost-balanced stages (with beam_idx),
    made on first use."""
    from common.paths import zctl_home

    cache = zctl_home()
    hf_dir = model_hf_dir(model, cache)
    return cached_export(hf_dir, export_name(model, hf_dir), stages, weights, True, cache)


def cached_export(hf_dir: Path, name: str, stages: int, weights: str, beam_idx: bool,
                  cache: Path, layers: str = "", static_kv: StaticKV | None = None) -> Path:
    """Export once per (model, stages or layer split, weights, beam_idx, static KV); reuse
    while the manifest verifies. ``layers`` ("0-16,17-29") overrides ``stages``'
    cost-balanced split (the one ``zctl export --stages`` makes)."""
    from common.manifest import parse_layer_spec
    from console.export_view import RichExportProgress
    from exporter.balance import default_split
    from exporter.export import export_model
    from exporter.sources import open_source

    split = f"L{layers.replace(',', '_')}" if layers else f"{stages}stages"
    kind = ("" if beam_idx else "-nobeam") + (
        f"-static{static_kv.context}x{static_kv.chunk}" if static_kv else "") + (
        "-f16" if static_kv and static_kv.kv_dtype == "f16" else "")
    out = cache / "exports" / "bench" / f"{name}-{weights}-{split}{kind}"
    try:
        load_manifest(out)
        return out
    except ManifestError:
        pass
    source = open_source(str(hf_dir))
    ranges = parse_layer_spec(layers) if layers else default_split(source, stages)
    with RichExportProgress(stages, err) as progress:
        export_model(source, ranges, weights, out, beam_idx=beam_idx, force=True, progress=progress,
                     static_kv=static_kv)
    return out


def plugin_properties(precision: str, threads: int) -> dict[str, Any]:
    props: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY"}
    if precision != "default":
        props["INFERENCE_PRECISION_HINT"] = precision
    if threads:
        props["INFERENCE_NUM_THREADS"] = threads
    return props


@dataclass(frozen=True)
class SyncInferConfig(RuntimeConfig):
    """The runtime's previous step path: a synchronous infer() on the calling thread."""

    async_infer = False


def chain_runner(export_dir: Path, config: RuntimeConfig) -> Callable[[list[int], int], float]:
    chain = LocalChain.load(str(export_dir), config)

    def run(prompt_ids: list[int], tokens: int) -> float:
        stats = GenerationStats()
        for _ in generate_greedy(chain, prompt_ids, tokens, stats=stats):
            pass
        return stats.tok_s

    run(prompt_ids=[1, 2, 3], tokens=4)  # warm-up: first inference pays one-off costs
    return run


def paired_step_ms(chains: dict[str, LocalChain], prompt_ids: list[int], tokens: int,
                   stream: int = 7) -> dict[str, float]:
    """Median ms per greedy decode step of each chain, the chains stepped token by token
    in rotating order (each on its own stream): drift of the machine, which moves whole
    runs by +-10% here, hits every chain alike, so their ratios are exact to ~1%."""
    state: dict[str, tuple[int, int]] = {}
    for key, chain in chains.items():
        chain.open(stream)
        chain.reset(stream)
        reply = chain.step(stream, np.asarray(prompt_ids), np.arange(len(prompt_ids)))
        state[key] = (int(reply.tokens[-1]), len(prompt_ids))
    keys = list(chains)
    times: dict[str, list[float]] = {key: [] for key in keys}
    for i in range(tokens):
        for key in keys[i % len(keys):] + keys[:i % len(keys)]:
            token, position = state[key]
            start = time.perf_counter()
            reply = chains[key].step(stream, np.array([token]), np.array([position]))
            times[key].append((time.perf_counter() - start) * 1e3)
            state[key] = (int(reply.tokens[-1]), position + 1)
    return {key: statistics.median(values) for key, values in times.items()}


def ratios(medians: dict[str, float]) -> dict[str, float]:
    base = medians["baseline"]
    return {f"{name}_ratio": round(value / base, 3) for name, value in medians.items()
            if name != "baseline"}


def paired_ratio(values: list[float], bases: list[float]) -> float:
    """The median over runs of value / base, each pair measured moments apart."""
    return round(statistics.median(v / b for v, b in zip(values, bases, strict=True)), 3)


def bracketed_ratios(samples: dict[str, list[float]], brackets: list[tuple[float, float]]
                     ) -> dict[str, float]:
    """Per system, the median over runs of its tok/s over the mean of the two baseline
    runs that bracket that run (measured first and last in it).

    Whole runs here drift by +-10% within seconds; the ratio of medians compares
    measurements up to a run's length apart, this one only within a run, where the
    drift is common to both sides and, when linear, cancels against the bracket."""
    bases = [(a + b) / 2 for a, b in brackets]
    return {name: paired_ratio(values, bases) for name, values in samples.items()
            if name != "baseline"}


def main(
    model: str = typer.Option("smollm2-135m", help="smollm2-135m, random-1b, or an HF directory"),
    weights: str = typer.Option("int4", help="int4 | int8 | fp16 | fp32"),
    tokens: int = typer.Option(128, help="new tokens per run"),
    runs: int = typer.Option(5, help="interleaved runs per system (the median is reported)"),
    precision: str = typer.Option("f32", help="INFERENCE_PRECISION_HINT on both sides, or 'default'"),
    threads: int = typer.Option(0, help="INFERENCE_NUM_THREADS on both sides (0: plugin default)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    extras: bool = typer.Option(True, help="also run baseline_sdpa and stage1_sync (see above)"),
) -> None:
    from common.paths import zctl_home
    from tools.baseline import BaselinePipeline, export_baseline

    cache = zctl_home()
    hf_dir = model_hf_dir(model, cache)
    name = export_name(model, hf_dir)
    exports = {
        "stage1": cached_export(hf_dir, name, 1, weights, True, cache),
        "stage1_nobeam": cached_export(hf_dir, name, 1, weights, False, cache),
        "stage2": cached_export(hf_dir, name, 2, weights, True, cache),
        "stage3": cached_export(hf_dir, name, 3, weights, True, cache),
    }
    group = load_manifest(exports["stage1"]).group_size
    baseline_dir = export_baseline(hf_dir, weights, group, console=err)
    props = plugin_properties(precision, threads)
    config = RuntimeConfig(precision=props.get("INFERENCE_PRECISION_HINT"),
                           num_threads=threads or None, performance_hint="LATENCY")
    prompt_ids = ChatTokenizer(exports["stage1"]).encode(PROMPT)
    baseline = BaselinePipeline(baseline_dir, props)
    systems: dict[str, Callable[[list[int], int], float]] = {
        "baseline": lambda ids, n: baseline.generate_timed(ids, n)["tok_s"],
    }
    for key, export_dir in exports.items():
        systems[key] = chain_runner(export_dir, config)
    names = SYSTEMS + (EXTRA_SYSTEMS if extras else ())
    if extras:
        baseline_sdpa = BaselinePipeline(baseline_dir, {**props, "ATTENTION_BACKEND": "SDPA"})
        systems["baseline_sdpa"] = lambda ids, n: baseline_sdpa.generate_timed(ids, n)["tok_s"]
        baseline_thp = BaselinePipeline(baseline_dir, props, huge_pages=True)
        systems["baseline_thp"] = lambda ids, n: baseline_thp.generate_timed(ids, n)["tok_s"]
        systems["stage1_sync"] = chain_runner(exports["stage1"], SyncInferConfig(**asdict(config)))
    samples: dict[str, list[float]] = {key: [] for key in names}
    brackets: list[tuple[float, float]] = []
    others = [key for key in names if key != "baseline"]
    for run in range(runs):
        # The baseline opens and closes every run; the others alternate their order.
        first = systems["baseline"](prompt_ids, tokens)
        for key in others if run % 2 == 0 else others[::-1]:
            samples[key].append(systems[key](prompt_ids, tokens))
        last = systems["baseline"](prompt_ids, tokens)
        brackets.append((first, last))
        samples["baseline"] += [first, last]
        err.print(f"run {run + 1}/{runs}: baseline {first:.1f}/{last:.1f}  " + "  ".join(
            f"{k} {samples[k][-1]:.1f}" for k in others))
    medians = {key: statistics.median(values) for key, values in samples.items()}
    bracketed = bracketed_ratios(samples, brackets)
    # The chains against each other, token by token (the baseline cannot be stepped so):
    # what a stage boundary costs, free of the drift between whole runs.
    chains = {key: LocalChain.load(str(exports[key]), config) for key in ("stage1", "stage2",
                                                                         "stage3")}
    step_ms = paired_step_ms(chains, prompt_ids, tokens * 2)
    paired = {f"{key}_over_stage1": round(step_ms["stage1"] / step_ms[key], 4)
              for key in ("stage2", "stage3")}
    result: dict[str, Any] = {
        "model": model, "weights": weights, "tokens": tokens, "runs": runs, "properties": props,
        "baseline": "openvino_genai LLMPipeline, default attention backend (paged attention on CPU)",
        "runtime": {"properties": config.properties(), "async_infer": config.async_infer},
        **{f"{key}_tok_s": round(value, 2) for key, value in medians.items()},
        **ratios(medians),
        "bracketed_ratios": bracketed,
        "samples": {key: [round(v, 2) for v in values] for key, values in samples.items()},
        "paired_step_ms": {key: round(v, 3) for key, v in step_ms.items()}, **paired,
    }
    if as_json:
        print(json.dumps(result))
        return
    table = Table(title=f"decode tok/s, {model} {weights}, {tokens} tokens, median of {runs}")
    table.add_column("system")
    table.add_column("tok/s", justify="right")
    table.add_column("vs baseline", justify="right")
    for key in names:
        ratio = medians[key] / medians["baseline"]
        table.add_row(key, f"{medians[key]:.1f}", f"{ratio:.3f}x")
    Console().print(table)
    Console().print("run by run against the baseline runs bracketing them: " + ", ".join(
        f"{key} {value:.3f}x" for key, value in bracketed.items()))
    Console().print("token by token against 1 stage: " + ", ".join(
        f"{key} {value:.3f}x" for key, value in paired.items()))


if __name__ == "__main__":
    typer.run(main)
