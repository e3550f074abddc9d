"""Long prompts: TTFT cold and on a follow-up turn, decode at context, streams under a long prefill.

``zctl serve`` on a 2-node local cluster (``--layouts shared,split``: every stage on every
core, then a core per node, a fresh cluster each) against openvino_genai's LLMPipeline and
ContinuousBatchingPipeline (prefix caching on) on an optimum-intel export of the same
model and weight format (the product's default, INT8 for SmolLM2), the plugin properties
zctl's stages get (LATENCY, f32) on both sides, in one run.

Prompts (tools.serving.prefill_prompts) are chat conversations of exactly N token ids as the
export's tokenizer renders them through the chat template, generation prompt included:
zctl gets the messages over HTTP (``usage.prompt_tokens`` is checked against N), genai the
ids zctl's engine makes of them. Every measurement uses a prompt neither system has seen
(its header names the layout, the kind of measurement, the repeat and the length), so a
prefix cache (genai's LLMPipeline keeps one between calls) only helps where it should.
Generation is greedy with EOS ignored, so lengths are equal on both sides.

Per prompt length, ``--repeats`` times, the systems in alternating order:

- TTFT cold: the first turn of a fresh conversation, ``--tokens`` (16) new tokens.
- TTFT on a repeated prefix: the second turn sent right after: the first turn's messages,
  its answer as the assistant's turn and one more user message, fitted to exactly the
  first turn's ids + the answer's tokens + ``--follow-up`` (32) tokens.
- Decode at context (``--decode-lengths``, 2,048 included): another fresh prompt, 64 new
  tokens: (tokens - 1) / (last token - first token), zctl against the LLMPipeline.

Then short streams under a long prefill (zctl and genai CB): ``--itl-streams`` (4) short
chat requests of ``--itl-tokens`` (128) tokens; once each has 16 tokens, alone: their
inter-token gaps until the first ends; with a ``--itl-length`` (4,096) token prompt sent
then: their gaps overlapping its prefill (request to first token). ``itl_ratio`` is the
p99 gap during / alone.

Medians over repeats, keyed by prompt length (as a string) in the JSON: ``ttft_ms``,
``genai_ttft_ms``, ``cached_ttft_ms``, ``genai_cached_ttft_ms``, ``decode_ratio`` and the
rest, for the first layout at the top and every layout under ``layouts``.

    python -m tools.serving.prefill [--lengths 256,1024,1660,4096] [--layouts shared,split]
        [--repeats 3] [--skip-genai] [--json]
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from tools.harness.cluster import exit_on_failure
from tools.harness.load import RequestRecord
from tools.harness.models import BenchModel
from tools.harness.options import Json, fail, parse_numbers
from tools.harness.report import err, print_result, run_record
from tools.serving.prefill_prompts import (
    Message,
    PromptBook,
    fixed_part,
    follow_up_floor,
    follow_up_turn,
)
from tools.serving.prefill_report import Samples, itl_figures, layout_result, print_report, report
from zctl.engine.requests import DEFAULT_MAX_STREAMS

LAYOUTS = ("shared", "split")
PROPS = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}  # cluster up's
WARM_TOKENS = 4


@dataclass(frozen=True)
class Plan:
    """What a run measures."""

    lengths: list[int]
    decode_lengths: list[int]
    repeats: int = 3
    tokens: int = 16
    decode_tokens: int = 64
    follow_up: int = 32
    itl_streams: int = 4
    itl_tokens: int = 128
    itl_length: int = 4096  # 0: no ITL measurement

    @property
    def itl_warm(self) -> int:
        """Tokens each short stream has before the long prompt is sent."""
        return max(1, min(16, self.itl_tokens // 4))

    def problem(self) -> str | None:
        """What is wrong with the plan whatever the model, or None."""
        checks = (
            (self.repeats >= 1, "--repeats must be >= 1"),
            (self.tokens >= 2 and self.decode_tokens >= 2,
             "--tokens and --decode-tokens must be >= 2"),
            (1 <= self.itl_streams <= 8, "--itl-streams must be in 1..8"),
            (self.itl_tokens >= 8, "--itl-tokens must be >= 8"),
            (self.itl_length >= 0, "--itl-length must be >= 0 (0: none)"),
        )
        return next((text for ok, text in checks if not ok), None)

    def model_problem(self, fixed: int, follow_floor: int, context: int) -> str | None:
        """What is wrong with the plan for a model whose prompts need ``fixed`` tokens, whose
        follow-up turns need ``follow_floor`` and whose context holds ``context``, or None."""
        longest = max(self.lengths) + 2 * self.tokens + self.follow_up
        checks = (
            (min(self.lengths + self.decode_lengths) >= fixed,
             f"prompt lengths must be >= {fixed} (the chat template, header and instruction)"),
            (self.itl_length == 0 or self.itl_length >= fixed,
             f"--itl-length must be 0 (none) or >= {fixed}"),
            (self.follow_up >= follow_floor + 4,
             f"--follow-up must be >= {follow_floor + 4} (the new turn's template and a few "
             "tokens of text)"),
            (longest <= context, f"a follow-up turn of {max(self.lengths)} tokens needs "
                                 f"{longest} tokens: the model's context is {context}"),
            (max(self.decode_lengths) + self.decode_tokens <= context,
             f"--decode-lengths + --decode-tokens exceed the model's context of {context}"),
            (self.itl_length + self.tokens <= context,
             f"--itl-length + --tokens exceed the model's context of {context}"),
        )
        return next((text for ok, text in checks if not ok), None)


def parse_layouts(text: str) -> list[str]:
    """Comma-separated layouts, each of LAYOUTS, none twice."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    bad = [n for n in names if n not in LAYOUTS]
    if not names or bad or len(set(names)) != len(names):
        fail(f"--layouts takes {' and/or '.join(LAYOUTS)}, comma-separated, each once; "
             f"got {text!r}")
    return names


# -- the measurements -------------------------------------------------------------------------


def checked(turn: RequestRecord, expected: int) -> RequestRecord:
    """``turn``, marked failed when its prompt was not ``expected`` tokens long."""
    if turn.ok and turn.prompt_tokens is not None and turn.prompt_tokens != expected:
        turn.error = f"prompt of {turn.prompt_tokens} tokens, expected {expected}"
    return turn


def conversation(system: Any, book: PromptBook, plan: Plan, length: int,
                 key: str) -> tuple[RequestRecord, RequestRecord]:
    """A fresh first turn of ``length`` tokens, then its follow-up turn right after."""
    first = book.turn(length, key)
    one = checked(system.turn(first, plan.tokens), length)
    if not one.ok:
        return one, RequestRecord(error="the first turn failed")
    try:
        second = follow_up_turn(book.tokenizer, first, one.text, one.completion_tokens,
                                plan.follow_up)
    except ValueError as exc:  # an answer whose text re-encodes much longer
        return one, RequestRecord(error=f"no follow-up turn: {exc}")
    two = system.turn(second, plan.tokens)
    return one, checked(two, length + one.completion_tokens + plan.follow_up)


def measure_lengths(plan: Plan, systems: Sequence[Any], book: PromptBook,
                    layout: str) -> Samples:
    """Every prompt length, ``plan.repeats`` times, the systems' order reversed every
    other time (by length and repeat)."""
    samples = Samples()
    for i, length in enumerate(sorted({*plan.lengths, *plan.decode_lengths})):
        for r in range(plan.repeats):
            order = systems if (i + r) % 2 == 0 else list(reversed(systems))
            line = []
            for system in order:
                if length in plan.lengths:
                    one, two = conversation(system, book, plan, length, f"{layout}/chat/{r}")
                    samples.add(system.name, "ttft", length, one)
                    samples.add(system.name, "cached", length, two)
                    line.append(f"{system.name} {_ms(one.ttft_ms)} / {_ms(two.ttft_ms)} ms")
                if length in plan.decode_lengths and system.name != "genai_cb":
                    turn = checked(system.turn(book.turn(length, f"{layout}/decode/{r}"),
                                               plan.decode_tokens), length)
                    samples.add(system.name, "decode", length, turn)
                    rate = turn.decode_tok_s
                    line.append(f"{system.name} {'-' if rate is None else f'{rate:.1f}'} tok/s")
            err.print(f"{layout} cores: {length} tokens, run {r + 1}: {', '.join(line)}",
                      highlight=False, markup=False)
    return samples


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def short_prompts(n: int) -> list[list[Message]]:
    """The short streams' conversations."""
    from tools.harness.baseline import STREAM_PROMPTS

    return [[("user", p)] for p in STREAM_PROMPTS[:n]]


def measure_itl(plan: Plan, systems: Sequence[Any], book: PromptBook,
                layout: str) -> dict[str, dict[str, Any]]:
    """Each system that serves streams at once: the short streams alone, then with the
    long prompt among them."""
    out: dict[str, dict[str, Any]] = {}
    if not plan.itl_length:
        return out
    shorts = short_prompts(plan.itl_streams)
    for system in systems:
        if not system.serves_streams:
            continue
        long = book.turn(plan.itl_length, f"{layout}/itl")
        alone = system.itl_run(shorts, plan.itl_tokens, plan.itl_warm, None, 0)
        during = system.itl_run(shorts, plan.itl_tokens, plan.itl_warm, long, plan.tokens)
        if during.long is not None:
            checked(during.long, plan.itl_length)
        out[system.name] = itl_figures(alone, during)
        it = out[system.name]
        err.print(f"{layout} cores: {system.name} ITL p99 alone {it['alone_ms']['p99']} ms, "
                  f"during a {plan.itl_length}-token prefill {it['during_ms']['p99']} ms "
                  f"({it['ratio_p99']}x)", highlight=False, markup=False)
    return out


def warm_up(system: Any, plan: Plan, book: PromptBook, key: str) -> None:
    """First requests of the shortest and the longest prompt, and of the short streams at
    once, unmeasured (one-off kernel compilation, first allocations)."""
    for length in (min(plan.lengths + plan.decode_lengths), max(plan.lengths)):
        system.turn(book.turn(length, f"{key}/warm"), WARM_TOKENS)
    if plan.itl_length and system.serves_streams:
        system.itl_run(short_prompts(plan.itl_streams), WARM_TOKENS * 2, 1, None, 0)


def run_layout(plan: Plan, layout: str, export_dir: Path, home: Path, genai: Sequence[Any],
               book: PromptBook, timeout: float) -> dict[str, Any]:
    """A fresh cluster with ``layout``'s cores and zctl serve on it; every measurement on it
    and on the genai pipelines."""
    from tools.harness.cluster import served_cluster
    from tools.serving.prefill_systems import ZctlHttp
    from zctl.launcher.processes import runtime_spec

    with served_cluster(export_dir, 2, runtime_spec("f32", None, "CPU"), home, timeout_s=timeout,
                        cpu_sets=layout,
                        max_streams=max(DEFAULT_MAX_STREAMS, plan.itl_streams + 1)) as served:
        zctl = ZctlHttp(served.api)
        warm_up(zctl, plan, book, f"{layout}/zctl")
        systems = [zctl, *genai]
        samples = measure_lengths(plan, systems, book, layout)
        itl = measure_itl(plan, systems, book, layout)
    return layout_result(samples, plan.lengths, plan.decode_lengths, itl)


def genai_systems(bench_model: BenchModel, export_dir: Path, weights: str, tokenizer: Any,
                  plan: Plan, book: PromptBook) -> list[Any]:
    """LLMPipeline and ContinuousBatchingPipeline on the optimum-intel export of the same
    source and weight format, warmed up."""
    from tools.harness.baseline import export_baseline_like
    from tools.serving.prefill_systems import GenaiCB, GenaiLLM

    model_dir = export_baseline_like(bench_model.hf_dir, export_dir, weights, console=err)
    systems = [GenaiLLM(model_dir, tokenizer, PROPS),
               GenaiCB(model_dir, tokenizer, PROPS, max_num_seqs=max(8, plan.itl_streams + 1))]
    for system in systems:
        warm_up(system, plan, book, f"genai/{system.name}")
    return systems


def main(
    lengths: Annotated[str, typer.Option(help="prompt lengths in tokens (after the chat "
                                              "template), comma-separated")] = "256,1024,1660,4096",
    decode_lengths: Annotated[str, typer.Option(
        help="prompt lengths of the decode-at-context runs")] = "256,1024,1660,2048,4096",
    layouts: Annotated[str, typer.Option(
        help="shared (every stage on every core) and/or split (a core per node)")] = "shared,split",
    repeats: Annotated[int, typer.Option(help="fresh prompts per length (medians)")] = 3,
    tokens: Annotated[int, typer.Option(help="new tokens of a TTFT turn")] = 16,
    decode_tokens: Annotated[int, typer.Option(help="new tokens of a decode run")] = 64,
    follow_up: Annotated[int, typer.Option(help="tokens the second turn appends")] = 32,
    itl_streams: Annotated[int, typer.Option(help="short streams under the long prefill")] = 4,
    itl_tokens: Annotated[int, typer.Option(help="new tokens of each short stream")] = 128,
    itl_length: Annotated[int, typer.Option(
        help="the long prompt's tokens (0: no ITL measurement)")] = 4096,
    model: Annotated[str, typer.Option(help="smollm2-135m, random-1b, or an HF directory")] = (
        "smollm2-135m"),
    weights: Annotated[str, typer.Option(help="auto (the product's default) | int4 | int8 | "
                                              "fp16 | fp32")] = "auto",
    skip_genai: Annotated[bool, typer.Option("--skip-genai", help="no openvino_genai")] = False,
    timeout: Annotated[float, typer.Option(help="seconds for the cluster and server to "
                                                "come up")] = 300.0,
    as_json: Json = False,
) -> None:
    from zctl.cli.exports import resolve_weights
    from zctl.engine.tokenizer import ChatTokenizer
    from zctl.manifest import load_manifest
    from zctl.weights import WEIGHT_FORMATS

    started = time.monotonic()
    plan = Plan(sorted(set(parse_numbers(lengths, "--lengths", "token counts"))),
                sorted(set(parse_numbers(decode_lengths, "--decode-lengths", "token counts"))),
                repeats,
                tokens, decode_tokens, follow_up, itl_streams, itl_tokens, itl_length)
    names = parse_layouts(layouts)
    if problem := plan.problem():
        fail(problem)
    if weights not in ("auto", *WEIGHT_FORMATS):
        fail(f"--weights takes auto, {', '.join(WEIGHT_FORMATS)}; got {weights!r}")
    weights = resolve_weights(model, weights)
    bench_model = BenchModel.resolve(model)
    export_dir = bench_model.export(2, weights)
    tokenizer = ChatTokenizer(export_dir)
    if problem := plan.model_problem(fixed_part(tokenizer), follow_up_floor(tokenizer),
                                     load_manifest(export_dir).model.max_position_embeddings):
        fail(problem)
    book = PromptBook(tokenizer)
    load_before = os.getloadavg()[0]
    with exit_on_failure():
        genai = [] if skip_genai else genai_systems(bench_model, export_dir, weights, tokenizer,
                                                    plan, book)
        results = {name: run_layout(plan, name, export_dir,
                                    bench_model.cache / "bench-prefill" / "home", genai, book,
                                    timeout) for name in names}
    settings = {**asdict(plan), "layouts": names, "model": model, "weights": weights,
                "export": str(export_dir), "properties": PROPS, "skip_genai": skip_genai,
                "prompts": "chat, exact token ids after the template", "ignore_eos": True,
                "elapsed_s": round(time.monotonic() - started, 1),
                "load_average_before_after": [round(load_before, 2),
                                              round(os.getloadavg()[0], 2)]}
    result = report(results, run_record(), settings)
    print_result(result, as_json, print_report)


if __name__ == "__main__":
    typer.run(main)
