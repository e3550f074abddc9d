"""Prompt lookup's ceiling behind slow hops: the tokens a round trip yields, one guess or many.

One guess per position is a chain, as today's speculation and pipelined speculation
draft; many are every continuation prompt lookup can find, a tree of branches in flight.

Behind slow hops every wrong draft costs a round trip before its correction is known,
whatever the drafts ride in (one wide step, or one-token runs in flight). So the tokens a
round trip yields, the accepted drafts plus the correction, bound what any scheme over
the same drafter can reach there. This tool counts them on the greedy output of
tools.spec.speedup's prompts (tools.spec.prompts, chat-templated), replayed position by position:
at each round trip the drafts are the ``--k``-token continuations after the history's
suffix, and the round trip yields the longest accepted prefix among them plus one token.

* ``chain``: ``zctl.engine.drafting.lookup_draft``'s one continuation (the most recent
  occurrence of the longest suffix n-gram, n = 3..1);
* ``branches B``: up to B distinct continuations (every earlier occurrence of every
  suffix n-gram, longest n first, most recent first); ``all`` takes every one.

The greedy outputs come from openvino_genai's LLMPipeline on the monolithic export of the
same model and weights (tools.harness.baseline) with exact numerics, the cluster's output for
these prompts. Nothing is timed: the figures are ratios of counts.

    python -m tools.spec.draft_ceiling [--model smollm2-135m] [--weights int4] [--tokens 128]
        [--k 12] [--branches 1,2,4,8,all] [--json]
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from tools.harness.models import BenchModel
from tools.harness.options import Json, Model, Weights, fail
from tools.harness.report import run_record
from tools.spec.prompts import PROMPTS
from zctl.engine.drafting import accept_prefix, lookup_draft, periodic_continuation, suffix_periods

Drafts = Callable[[list[int], int], list[list[int]]]  # (history, k) -> continuations
ALL = 0  # --branches "all"


def lookup_continuations(history: Sequence[int], k: int, max_ngram: int = 3) -> list[list[int]]:
    """Every distinct ``k``-token continuation after an earlier occurrence of the history's
    last n tokens, n from ``max_ngram`` down to 1, most recent occurrence first
    (``periodic_continuation``, as ``lookup_draft`` drafts)."""
    seq = np.asarray(history, dtype=np.int64)
    found: list[list[int]] = []
    for period in suffix_periods(seq, max_ngram):
        continuation = periodic_continuation(seq, period, k)
        if continuation not in found:
            found.append(continuation)
    return found


def drafts_for(branches: int) -> Drafts:
    """The drafts one round trip carries: lookup's chain (1), or up to ``branches``
    continuations (``ALL``: every one)."""
    if branches == 1:
        return lambda history, k: [lookup_draft(history, k)]
    return lambda history, k: lookup_continuations(history, k)[:branches or None]


def tokens_per_round_trip(prompt: Sequence[int], output: Sequence[int], drafts: Drafts,
                          k: int) -> float:
    """``output``'s tokens over the round trips it takes when each round trip yields the
    longest accepted prefix of its drafts, plus the target's own next token."""
    if not output:
        raise ValueError("an empty output takes no round trips")
    position, trips = 0, 0
    while position < len(output):
        truth = list(output[position:position + k])
        history = [*prompt, *output[:position]]
        accepted = max((accept_prefix(d[:len(truth)], truth) for d in drafts(history, k) if d),
                       default=0)
        position += accepted + 1
        trips += 1
    return len(output) / trips


def parse_branches(text: str) -> list[int]:
    """"1,2,all" -> [1, 2, ALL]; 1 (the chain) is always measured first."""
    values: list[int] = [1]
    for part in (p.strip() for p in text.split(",") if p.strip()):
        value = ALL if part == "all" else int(part) if part.isdigit() else -1
        if value < 0 or (value == 0 and part != "all"):
            fail(f"--branches takes positive integers and 'all', got {part!r}")
        if value not in values:
            values.append(value)
    return values


def greedy_outputs(model: str, weights: str, tokens: int) -> list[tuple[str, list[int], list[int]]]:
    """Each prompt's name, chat-templated ids and greedy output (openvino_genai, exact)."""
    from dataplane.runtime.config import RuntimeSpec
    from tools.harness.baseline import BaselinePipeline, export_baseline_like
    from zctl.engine.tokenizer import ChatTokenizer

    bench_model = BenchModel.resolve(model)
    export_dir = bench_model.export(2, weights)
    tokenizer = ChatTokenizer(export_dir)
    model_dir = export_baseline_like(bench_model.hf_dir, export_dir, weights)
    props = RuntimeSpec(precision="f32", kv_cache_precision="f32",
                        dynamic_quantization=False).properties()
    pipe = BaselinePipeline(model_dir, props)
    outputs = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt.text, chat=True)
        outputs.append((prompt.name, ids, pipe.generate_timed(ids, tokens)["tokens"]))
    return outputs


def ceiling(outputs: Sequence[tuple[str, list[int], list[int]]], branches: Sequence[int],
            k: int) -> dict[str, Any]:
    """Per prompt and on the mean: tokens per round trip for each branch count, and each
    over the chain's."""
    label = {b: "all" if b == ALL else str(b) for b in branches}
    prompts = []
    for name, prompt, output in outputs:
        per = {label[b]: tokens_per_round_trip(prompt, output, drafts_for(b), k)
               for b in branches}
        prompts.append({"prompt": name, "tokens_per_round_trip": per})
    mean = {label[b]: float(np.mean([p["tokens_per_round_trip"][label[b]] for p in prompts]))
            for b in branches}
    return {"tokens_per_round_trip": mean,
            "over_chain": {key: value / mean["1"] for key, value in mean.items()},
            "prompts": prompts}


def main(
    model: Model = "smollm2-135m",
    weights: Weights = "int4",
    tokens: Annotated[int, typer.Option(help="greedy tokens per prompt")] = 128,
    k: Annotated[int, typer.Option(help="tokens per drafted continuation")] = 12,
    branches: Annotated[str, typer.Option(
        help="continuations per round trip to compare with the chain (1), or 'all'")
    ] = "2,4,8,all",
    as_json: Json = False,
) -> None:
    if tokens < 1 or k < 1:
        fail("--tokens and --k need at least 1")
    counts = parse_branches(branches)
    result = {**ceiling(greedy_outputs(model, weights, tokens), counts, k), **run_record(),
              "model": model, "weights": weights, "tokens": tokens, "k": k}
    if as_json:
        print(json.dumps(result))
        return
    table = Table(title=f"tokens per round trip, prompt lookup, k={k}")
    table.add_column("prompt")
    keys = list(result["tokens_per_round_trip"])
    for key in keys:
        table.add_column("chain" if key == "1" else f"{key} branches", justify="right")
    for entry in result["prompts"]:
        table.add_row(entry["prompt"], *(f"{entry['tokens_per_round_trip'][key]:.2f}"
                                         for key in keys))
    table.add_row("mean", *(f"{result['tokens_per_round_trip'][key]:.2f}" for key in keys))
    table.add_row("over the chain", *(f"{result['over_chain'][key]:.3f}x" for key in keys))
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)
