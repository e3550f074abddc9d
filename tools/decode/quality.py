"""Each weight format against the fp32 Hugging Face model: top-1 agreement, perplexity, speed.

Teacher-forced top-1 agreement, perplexity and KL on a fixed text, a greedy sample, and
decode speed relative to int4.

Each format's export (made once, cached as the other benchmarks' are) runs through zctl's
own stage chain (LocalChain, 2 stages by default as ``zctl run`` serves them) over the
fixed evaluation text shipped with exporter/quality.py (English prose and a short chat),
teacher-forced: every position's logits against those of the fp32 Hugging Face model on
the same source weights and token ids (exporter/quality.py defines the figures). Two
numerics:
  fast    what ``zctl run`` serves by default: f32 precision hint, the plugin's u8 KV
          cache and int8 dynamic quantization of activations (on VNNI/AMX CPUs)
  exact   f32 activations and KV cache: the weight format's own effect
The greedy sample (chat template, fast numerics, up to --sample-tokens, stops at EOS) is
of "Write a short poem about the sea."; speed is the median decode step of each format's
chain, the chains stepped token by token in turn, given as tok/s over int4's (ratios only:
absolute figures drift +-20% between runs here), the median over --runs runs.

    python -m tools.decode.quality [--model smollm2-135m] [--formats int4,int8,fp16,fp32] [--json]
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from tools.harness.greedy import paired_step_ms
from tools.harness.models import BenchModel
from tools.harness.options import Json, Model, fail
from tools.harness.report import err, run_record
from tools.harness.stats import paired_ratio, rounded

POEM = "Write a short poem about the sea."
FORMATS = "int4,int8,fp16,fp32"
SPEED_BASE = "int4"


def parse_formats(text: str) -> list[str]:
    """``--formats``: comma-separated weight formats, each known and named once."""
    from zctl.weights import WEIGHT_FORMATS

    formats = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [f for f in formats if f not in WEIGHT_FORMATS]
    if not formats or unknown or len(set(formats)) != len(formats):
        fail(f"--formats takes distinct formats among {', '.join(WEIGHT_FORMATS)}, got {text!r}")
    return formats


def until_stop(tokens: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """``tokens`` up to (without) the first stop token."""
    out: list[int] = []
    for token in tokens:
        if token in stop_ids:
            break
        out.append(token)
    return out


def reference_figures(hf_dir: Path, passages: Sequence[Any], prompt_ids: list[int],
                      sample_tokens: int) -> tuple[dict[str, Any], list[int]]:
    """The fp32 Hugging Face model's logits per passage and its greedy sample's tokens."""
    from exporter.quality import hf_logits
    from exporter.sources import open_source
    from exporter.verify import hf_greedy

    model = open_source(str(hf_dir)).load_hf_model()
    logits = {p.name: hf_logits(model, p.token_ids) for p in passages}
    return logits, hf_greedy(model, prompt_ids, sample_tokens)


def format_figures(export_dir: Path, passages: Sequence[Any], reference: Mapping[str, Any],
                   chunk: int, prompt_ids: list[int], sample_tokens: int) -> tuple[dict, Any]:
    """One format's figures (fast numerics at the top, exact under "exact", fast per
    passage under "passages") and its fast chain, kept for the speed comparison."""
    from dataplane.head.local_chain import LocalChain
    from dataplane.runtime.config import RuntimeSpec
    from exporter.quality import measure_chain
    from exporter.verify import EXACT_CONFIG
    from zctl.engine.scheduler import generate_greedy
    from zctl.engine.tokenizer import ChatTokenizer

    exact = measure_chain(LocalChain.load(str(export_dir), EXACT_CONFIG), passages, reference,
                          chunk)
    chain = LocalChain.load(str(export_dir), RuntimeSpec(precision="f32"))
    fast = measure_chain(chain, passages, reference, chunk)
    tokenizer = ChatTokenizer(export_dir)
    stops = [t for t in (tokenizer.eos_token_id,) if t is not None]
    sample = list(generate_greedy(chain, prompt_ids, sample_tokens, stop_ids=stops))
    figures = {**fast.pop("all").rounded(), "exact": exact["all"].rounded(),
               "passages": {name: a.rounded() for name, a in fast.items()},
               "greedy_sample": tokenizer.decode(until_stop(sample, stops))}
    return figures, chain


def speed_runs(chains: Mapping[str, Any], prompt_ids: list[int], tokens: int, runs: int
               ) -> tuple[str, dict[str, list[float]]]:
    """The base format (int4, else the first) and each chain's decode step ms in each of
    ``runs`` runs of ``tokens`` steps where the chains are stepped token by token in turn
    (tools.harness.greedy.paired_step_ms)."""
    base = SPEED_BASE if SPEED_BASE in chains else next(iter(chains))
    step_ms: dict[str, list[float]] = {key: [] for key in chains}
    for _ in range(runs):
        for key, ms in paired_step_ms(chains, prompt_ids, tokens).items():
            step_ms[key].append(ms)
    return base, step_ms


def quality_report(exports: Mapping[str, Path], hf_dir: Path, *, chunk: int = 0,
                   limit: int = 0, sample_tokens: int = 48, tokens: int = 128,
                   runs: int = 3) -> dict[str, Any]:
    """The figures of every export in ``exports`` (format -> directory, one tokenizer)
    against the fp32 model in ``hf_dir``."""
    from exporter.quality import eval_passages
    from zctl.engine.tokenizer import ChatTokenizer

    first = next(iter(exports.values()))
    passages = eval_passages(first, limit)
    tokenizer = ChatTokenizer(first)
    prompt_ids = tokenizer.encode(POEM)
    stops = [t for t in (tokenizer.eos_token_id,) if t is not None]
    err.print(f"reference: fp32 Hugging Face over {sum(len(p.token_ids) for p in passages)} "
              "tokens ...")
    reference, ref_sample = reference_figures(hf_dir, passages, prompt_ids, sample_tokens)
    formats: dict[str, Any] = {}
    chains: dict[str, Any] = {}
    for name, export_dir in exports.items():
        start = time.perf_counter()
        formats[name], chains[name] = format_figures(export_dir, passages, reference, chunk,
                                                     prompt_ids, sample_tokens)
        err.print(f"{name}: top-1 agreement {formats[name]['top1_agreement']:.2%} "
                  f"({time.perf_counter() - start:.0f} s)")
    base, step_ms = speed_runs(chains, prompt_ids, tokens, runs)
    for name, ms in step_ms.items():  # tok/s over the base's: its step time over this one's
        formats[name]["tok_s_ratio"] = rounded(paired_ratio(step_ms[base], ms))
        formats[name]["tok_s_ratio_runs"] = [round(b / m, 3) for b, m in zip(
            step_ms[base], ms, strict=True)]
    return {"text": {p.name: len(p.token_ids) for p in passages}, "chunk": chunk,
            "speed_base": base, "decode_tokens": tokens, "speed_runs": runs, "prompt": POEM,
            "reference_sample": tokenizer.decode(until_stop(ref_sample, stops)),
            "formats": formats}


def render(result: dict[str, Any]) -> None:
    """The table, then the greedy samples."""
    from rich.markup import escape

    console = Console()
    table = Table(title=escape(
        f"{result['model']} ({result['stages']} stages) against fp32 Hugging Face, teacher-"
        f"forced over {sum(result['text'].values())} tokens; {result['cpu']}, "
        f"{result['date'][:10]}, {result['commit']}"))
    for column in ("format", "top-1", "ppl", "KL", "exact top-1", "exact ppl",
                   f"tok/s vs {result['speed_base']}"):
        table.add_column(column, justify="left" if column == "format" else "right")
    for name, f in result["formats"].items():
        table.add_row(name, f"{f['top1_agreement']:.2%}", f"{f['perplexity']:.3f}",
                      f"{f['kl']:.3g}", f"{f['exact']['top1_agreement']:.2%}",
                      f"{f['exact']['perplexity']:.3f}", f"{f['tok_s_ratio']:.2f}x")
    console.print(table)
    ref_ppl = next(iter(result["formats"].values()))["ref_perplexity"]
    console.print(f"top-1 agreement with fp32 Hugging Face, perplexity (fp32 Hugging Face: "
                  f"{ref_ppl:.3f}) and KL (nats a token) under fast numerics (zctl run's "
                  "default); exact: f32 activations and KV cache")
    console.print(f"greedy {result['prompt']!r}:", highlight=False)
    console.print(f"  hf fp32: {result['reference_sample']!r}", highlight=False)
    for name, f in result["formats"].items():
        console.print(f"  {name}: {f['greedy_sample']!r}", highlight=False)


def main(
    model: Model = "smollm2-135m",
    formats: Annotated[str, typer.Option(help="weight formats to measure")] = FORMATS,
    stages: Annotated[int, typer.Option(help="stages of each export")] = 2,
    chunk: Annotated[int, typer.Option(
        help="teacher-forced tokens per step (0: a passage in one step; 1: as decode "
             "reads the KV cache)")] = 0,
    limit: Annotated[int, typer.Option(help="at most this many tokens per passage (0: all)")] = 0,
    sample_tokens: Annotated[int, typer.Option(help="greedy sample length at most")] = 48,
    tokens: Annotated[int, typer.Option(help="decode steps per format and run for the speed "
                                             "ratios")] = 128,
    runs: Annotated[int, typer.Option(help="speed runs (the median ratio is reported)")] = 3,
    as_json: Json = False,
) -> None:
    names = parse_formats(formats)
    if chunk < 0 or limit < 0 or limit == 1 or min(sample_tokens, tokens, runs) < 1:
        fail("--chunk >= 0, --limit 0 or >= 2, --sample-tokens, --tokens and --runs >= 1")
    from zctl.cli.exports import quiet_ml_libraries

    quiet_ml_libraries()
    bench_model = BenchModel.resolve(model)
    exports = {name: bench_model.export(stages, name) for name in names}
    result = {"model": model, "stages": stages, **run_record(),
              **quality_report(exports, bench_model.hf_dir, chunk=chunk, limit=limit,
                               sample_tokens=sample_tokens, tokens=tokens, runs=runs)}
    if as_json:
        print(json.dumps(result))
        return
    render(result)


if __name__ == "__main__":
    typer.run(main)
