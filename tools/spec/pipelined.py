"""Pipelined speculation against plain greedy, today's speculation and openvino_genai on one core.

One stream (one user) on a 2-node local cluster, a core per node (``--cpu-sets split``,
as two PCs), driven through the generation service as ``zctl run`` drives it, over
tools.spec.speedup's prompts (tools.spec.prompts: code, extraction, chat, creative). Four
systems, interleaved prompt by prompt, their order rotated from run to run:

* ``plain``: greedy through the cluster (``speculative=""``);
* ``spec``: today's speculation, prompt lookup with adaptive K (``"lookup"``, k=0);
* ``pipelined``: pipelined speculation (``"pipelined"``, k=0: runs on guessed
  continuations, their width and depth in flight adaptive; zctl.engine.pipelined);
* ``genai``: openvino_genai's LLMPipeline on the monolithic export of the same model and
  weights (tools.harness.baseline), on ONE core (one PC): this process's thread confined to one
  core while the pipeline is built and while it generates, and INFERENCE_NUM_THREADS=1.
  It is fed the chat-templated token ids the cluster's engine feeds.

Decode throughput is tokens after the first over the time they took (prefill
excluded): the cluster's ``GenerationDone.tok_s`` (zctl.engine.stats), and for openvino_genai
(n - 1) / (wall - TTFT) (tools.harness.baseline.sequential_throughput), as
tools/decode/microbatch reports both. Per prompt: each system's median over runs, and
each ratio paired run by run (``paired_ratio``: the median over runs of a over b, both
measured moments apart). A mean ratio is the mean over prompts of the per-prompt ratio;
ratios are null where a system was not measured.

Both sides run exact numerics (f32 activations, an f32 KV cache, no dynamic
quantization: tools.spec.speedup's and the cluster tests' settings), so that speculation
reproduces greedy: ``identical`` is true only if every spec and pipelined output equals
the plain output of the same prompt and run, token for token. ``genai_identical`` says
the same of openvino_genai's output, for information only (another runtime may break a
near-tie the other way). ``--link-delay-ms`` delays every cluster hop (genai has none).
``--systems plain,spec,genai`` leaves systems out.

    python -m tools.spec.pipelined [--model smollm2-135m] [--weights int4] [--tokens 128]
        [--runs 3] [--cpu-sets split] [--link-delay-ms 0]
        [--systems plain,spec,pipelined,genai] [--pipelined-k 0] [--json]
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tools.harness.models import BenchModel
from tools.harness.options import CpuSets, Json, Model, Runs, Weights, fail
from tools.harness.order import rotated
from tools.harness.report import err, metric_table, print_result, run_record
from tools.harness.service import bench_request, generate_done
from tools.harness.stats import median, paired_ratio, rounded
from tools.spec.prompts import PROMPTS
from zctl.engine.requests import MAX_DRAFT_TOKENS

if TYPE_CHECKING:
    from tools.harness.baseline import BaselinePipeline

NODES = 2
SYSTEMS = ("plain", "spec", "pipelined", "genai")
SPECULATIVE = {"plain": "", "spec": "lookup", "pipelined": "pipelined"}  # cluster systems
COMPARED = ("spec", "pipelined")  # must reproduce plain's output
RATIOS = (("pipelined_over_plain", "pipelined", "plain"),
          ("pipelined_over_spec", "pipelined", "spec"),
          ("pipelined_over_genai_one_core", "pipelined", "genai"),
          ("spec_over_plain", "spec", "plain"),
          ("spec_over_genai_one_core", "spec", "genai"),
          ("plain_over_genai_one_core", "plain", "genai"))
SPEC_KEYS = ("acceptance", "tokens_per_step", "k_mean")  # of GenerationDone.spec
WARMUP_TOKENS = 16


@dataclass(frozen=True)
class Sample:
    """One generation: its decode tok/s, its tokens and (speculative) its figures."""

    tok_s: float
    tokens: list[int]
    spec: dict[str, float] = field(default_factory=dict)


Samples = dict[str, list[Sample]]  # system -> one sample per run (of one prompt)
Prompt = tuple[str, str, list[int]]  # name, text, chat-templated token ids


# -- the figures (pure) ----------------------------------------------------------------------


def parse_systems(text: str) -> list[str]:
    """``--systems``: known names, at least one, in SYSTEMS' order."""
    names = {part.strip() for part in text.split(",") if part.strip()}
    unknown = sorted(names - set(SYSTEMS))
    if unknown or not names:
        fail(f"--systems takes a comma-separated subset of {','.join(SYSTEMS)}, got {text!r}")
    return [s for s in SYSTEMS if s in names]


def ratio(samples: Mapping[str, Sequence[Sample]], a: str, b: str) -> float | None:
    """a over b, paired run by run (``paired_ratio``); None unless both were measured."""
    return paired_ratio([s.tok_s for s in samples.get(a, ())],
                        [s.tok_s for s in samples.get(b, ())])


def same_as(samples: Mapping[str, Sequence[Sample]], system: str,
            reference: str = "plain") -> bool | None:
    """Whether every run of ``system`` output the tokens of the same run of ``reference``;
    None unless both were measured."""
    if not samples.get(system) or not samples.get(reference):
        return None
    return all(s.tokens == r.tokens
               for s, r in zip(samples[system], samples[reference], strict=True))


def all_true(values: Sequence[bool | None]) -> bool | None:
    """True if every known value is, False if one is not, None if none is known."""
    known = [v for v in values if v is not None]
    return all(known) if known else None


def prompt_entry(name: str, samples: Mapping[str, Sequence[Sample]]) -> dict[str, Any]:
    """One prompt's row: median tok/s per system, the paired ratios, the identity checks
    and the speculative systems' figures (``spec_medians``)."""
    entry: dict[str, Any] = {"name": name, "tok_s": {
        s: round(median([x.tok_s for x in v]), 2) for s, v in samples.items() if v}}
    entry.update({key: rounded(ratio(samples, a, b)) for key, a, b in RATIOS})
    entry["identical"] = all_true([same_as(samples, s) for s in COMPARED])
    entry["identical_by_system"] = {s: same_as(samples, s) for s in COMPARED if samples.get(s)}
    entry["genai_identical"] = same_as(samples, "genai")
    entry["spec"] = {s: spec_medians(samples[s]) for s in COMPARED if samples.get(s)}
    return entry


def spec_medians(samples: Sequence[Sample], keys: Sequence[str] = SPEC_KEYS
                 ) -> dict[str, float | None]:
    """The median over runs of each of the service's speculation figures (None where the
    service reported none)."""
    figures = {key: [x.spec[key] for x in samples if key in x.spec] for key in keys}
    return {key: round(median(v), 3) if v else None for key, v in figures.items()}


def mean_of(entries: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """The mean over prompts of ``key``; None if a prompt lacks it."""
    values = [e.get(key) for e in entries]
    if not values or any(v is None for v in values):
        return None
    return round(statistics.mean(values), 3)


def summary(entries: Sequence[Mapping[str, Any]], systems: Sequence[str]) -> dict[str, Any]:
    """The headline figures: identity over every prompt, each mean ratio, the mean tok/s."""
    return {
        "identical": all_true([e["identical"] for e in entries]),
        "genai_identical": all_true([e["genai_identical"] for e in entries]),
        **{key: mean_of(entries, key) for key, _, _ in RATIOS},
        "mean_tok_s": {s: round(statistics.mean(e["tok_s"][s] for e in entries), 2)
                       for s in systems if entries and all(s in e["tok_s"] for e in entries)},
    }


# -- the systems (side effects) ----------------------------------------------------------------


@contextmanager
def on_cores(cpus: set[int]) -> Iterator[None]:
    """Run the block with this thread (and the threads it starts) confined to ``cpus``;
    the thread's own affinity is restored after it."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@dataclass
class GenaiOneCore:
    """openvino_genai's LLMPipeline built and run on one core, one inference thread."""

    pipe: BaselinePipeline
    core: int

    @classmethod
    def load(cls, bench_model: BenchModel, export_dir: Path, weights: str,
             props: dict[str, Any], core: int) -> GenaiOneCore:
        """The monolithic export of the same model and weights (tools.harness.baseline's, cached),
        its pipeline built on ``core`` (OpenVINO sizes its threads from the affinity)."""
        from tools.harness.baseline import BaselinePipeline, export_baseline_like

        model_dir = export_baseline_like(bench_model.hf_dir, export_dir, weights, console=err)
        with on_cores({core}):
            return cls(BaselinePipeline(model_dir, props), core)

    def run(self, ids: Sequence[int], tokens: int) -> Sample:
        """One greedy generation of exactly ``tokens`` tokens from ``ids``."""
        from tools.harness.baseline import sequential_throughput

        with on_cores({self.core}):
            result = self.pipe.generate_timed(ids, tokens)
        return Sample(sequential_throughput([result])["aggregate_tok_s"], result["tokens"])


def genai_properties() -> dict[str, Any]:
    """The stages' exact numerics (EXACT's plugin properties) on one inference thread."""
    from dataplane.runtime.config import RuntimeSpec

    return RuntimeSpec(precision="f32", num_threads=1, kv_cache_precision="f32",
                       dynamic_quantization=False).properties()


def cluster_run(serve: str, text: str, tokens: int, speculative: str, k: int = 0) -> Sample:
    """One request through the cluster's generation service (k=0: lookup's adaptive K,
    pipelined's adaptive run width; else that many drafts per step or run)."""
    done = generate_done(serve, text, tokens, speculative=speculative, k=k)
    return Sample(done.tok_s, list(done.tokens), dict(done.spec))


def run_system(system: str, serve: str, genai: GenaiOneCore | None, text: str,
               ids: Sequence[int], tokens: int, pipelined_k: int = 0) -> Sample:
    """One generation of ``system`` (genai from ``ids``, the cluster from ``text``)."""
    if system == "genai":
        assert genai is not None
        return genai.run(ids, tokens)
    return cluster_run(serve, text, tokens, SPECULATIVE[system],
                       pipelined_k if system == "pipelined" else 0)


def interleaved_runs(serve: str, genai: GenaiOneCore | None, prompts: Sequence[Prompt],
                     systems: Sequence[str], tokens: int, runs: int, pipelined_k: int = 0
                     ) -> list[Samples]:
    """Every system once on the first prompt (warm-up), then ``runs`` runs of every
    prompt by every system, the systems' order rotated run by run: per prompt, each
    system's samples."""
    _, text, ids = prompts[0]
    for system in systems:
        run_system(system, serve, genai, text, ids, min(tokens, WARMUP_TOKENS), pipelined_k)
    results: list[Samples] = [{s: [] for s in systems} for _ in prompts]
    for run in range(runs):
        for p, (name, text, ids) in enumerate(prompts):
            for system in rotated(systems, run):
                results[p][system].append(run_system(system, serve, genai, text, ids, tokens,
                                                     pipelined_k))
            line = "  ".join(f"{s} {results[p][s][-1].tok_s:.1f}" for s in systems)
            err.print(f"run {run + 1}/{runs} {name}: {line} tok/s", highlight=False)
    return results


def refused(systems: Sequence[str]) -> str:
    """Why the engine refuses one of the cluster systems' requests ("" when none)."""
    for system in systems:
        if system in SPECULATIVE:
            problem = bench_request("x", 1, speculative=SPECULATIVE[system]).problem()
            if problem:
                return f"--systems {system}: the engine refuses it: {problem}"
    return ""


def measure(bench_model: BenchModel, export_dir: Path, weights: str, systems: Sequence[str],
            settings: Mapping[str, Any]) -> list[Samples]:
    """Build the one-core baseline (before the cluster: OpenVINO first loads in this
    process confined to its core), start the cluster, run everything, stop the cluster:
    the samples per prompt."""
    from tools.harness.cluster import local_cluster
    from zctl.engine.tokenizer import ChatTokenizer
    from zctl.launcher.processes import runtime_spec

    tokenizer = ChatTokenizer(export_dir)
    prompts = [(p.name, p.text, tokenizer.encode(p.text, chat=True)) for p in PROMPTS]
    genai = None if settings["genai_core"] is None else GenaiOneCore.load(
        bench_model, export_dir, weights, settings["genai_properties"], settings["genai_core"])
    err.print(f"starting a {NODES}-node local cluster (--cpu-sets {settings['cpu_sets']}) ...")
    with local_cluster(
            export_dir, NODES, runtime_spec("f32", None, "CPU", "f32", dynamic_quantization=False),
            bench_model.cache / "bench-pipespec", link_delay_ms=settings["link_delay_ms"],
            cpu_sets=settings["cpu_sets"]) as record:
        return interleaved_runs(record.serve, genai, prompts, systems, settings["tokens"],
                                settings["runs"], settings["pipelined_k"])


# -- output ------------------------------------------------------------------------------------


def _cell(value: Any, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "[green]yes[/]" if value else "[red]NO[/]"
    return f"{value:.2f}{suffix}" if isinstance(value, float) else str(value)


def render(result: Mapping[str, Any], console: Console) -> None:
    """The per-prompt table, its mean row, and where and how it ran."""
    systems = result["systems"]
    ratios = [key for key, a, b in RATIOS if a in systems and b in systems]
    table = Table(title=f"decode tok/s, one stream, {NODES}-node local cluster (--cpu-sets "
                        f"{result['cpu_sets']}, {result['link_delay_ms']} ms a hop), "
                        f"{result['model']} {result['weights']}, {result['tokens']} tokens, "
                        f"median of {result['runs']}")
    table.add_column("prompt")
    for column in [*systems, *map(ratio_label, ratios), "identical"]:
        table.add_column(column, justify="right")
    for e in result["prompts"]:
        table.add_row(e["name"], *(_cell(e["tok_s"].get(s)) for s in systems),
                      *(_cell(e[key], "x") for key in ratios), _cell(e["identical"]))
    table.add_row("mean", *(_cell(result["mean_tok_s"].get(s)) for s in systems),
                  *(_cell(result[key], "x") for key in ratios), _cell(result["identical"]),
                  style="bold")
    console.print(table)
    skip = {"prompts", "mean_tok_s", "systems", *(key for key, _, _ in RATIOS)}
    console.print(metric_table("run", {k: escape(str(v)) for k, v in result.items()
                                       if k not in skip}))  # the CPU's [flags] are no markup


def ratio_label(key: str) -> str:
    """A ratio's column: pipelined_over_genai_one_core -> pipe/genai1c."""
    return key.replace("pipelined", "pipe").replace("_one_core", "1c").replace("_over_", "/")


def main(
    model: Model = "smollm2-135m",
    weights: Weights = "int4",
    tokens: Annotated[int, typer.Option(help="new tokens per generation")] = 128,
    runs: Runs = 3,
    cpu_sets: CpuSets = "split",
    link_delay_ms: Annotated[float, typer.Option(
        help="emulated one-way latency on every cluster hop (genai has no hops)")] = 0.0,
    systems: Annotated[str, typer.Option(
        help=f"comma-separated, of {','.join(SYSTEMS)}")] = ",".join(SYSTEMS),
    pipelined_k: Annotated[int, typer.Option(
        help="drafts per pipelined run after its first token; 0: adaptive (one-token runs "
             "on a LAN)")] = 0,
    as_json: Json = False,
) -> None:
    names = parse_systems(systems)
    if tokens < 2 or runs < 1 or link_delay_ms < 0 or not 0 <= pipelined_k <= MAX_DRAFT_TOKENS:
        fail("--tokens needs at least 2, --runs at least 1, --link-delay-ms at least 0, "
             f"--pipelined-k 0..{MAX_DRAFT_TOKENS}")
    if problem := refused(names):
        fail(problem)
    bench_model = BenchModel.resolve(model)
    export_dir = bench_model.export(NODES, weights)
    genai = "genai" in names
    settings: dict[str, Any] = {
        "model": model, "weights": weights, "tokens": tokens, "runs": runs,
        "cpu_sets": cpu_sets, "link_delay_ms": link_delay_ms, "systems": names,
        "pipelined_k": pipelined_k,
        "export": str(export_dir), "stage_runtime": "exact (f32, f32 KV, no dynamic quant.)",
        "genai_core": max(os.sched_getaffinity(0)) if genai else None,
        "genai_properties": genai_properties() if genai else None}
    results = measure(bench_model, export_dir, weights, names, settings)
    entries = [prompt_entry(p.name, samples) for p, samples in zip(PROMPTS, results, strict=True)]
    result = {**summary(entries, names), **run_record(), **settings, "prompts": entries}
    print_result(result, as_json, render)


if __name__ == "__main__":
    typer.run(main)
