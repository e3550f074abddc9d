"""Scoring a prompt (echo, logprobs) against the fp32 model: perplexity, top-1, cost over prefill.

How near the cluster's scores of a prompt (``echo`` with ``logprobs``; the engine's
``prompt_logprobs``) are to the fp32 Hugging Face model's, and what scoring costs against
the same prompt's plain prefill.

A 2-node local cluster of the export, with fast numerics (the default: a u8 KV cache,
int8 activations where the CPU has them) and then with exact ones (``--exact``: f32
KV cache and activations), driven through the generation service as ``zctl serve``
drives it. The passages are the shipped prose's paragraphs (``exporter/quality_prose.txt``,
raw text with the tokenizer's special tokens, as a text completion sends it). Per
passage, in turn: a plain request (the prompt, one new token: its prefill), then a scored
one (``prompt_logprobs``, one new token). Each token's score is checked against the fp32
model's log-softmax at the position before it (one forward pass over the passage):

* ``ppl`` / ``ref_ppl``: the passages' perplexity from the cluster's scores and from the
  fp32 model's (``ppl_ratio``: the first over the second);
* ``mean_abs_diff`` / ``p99_abs_diff``: |cluster - fp32| per scored token, in nats;
* ``top1``: positions whose most likely token (the cluster's top alternative) is the fp32
  model's;
* ``scoring_cost``: a scored request's time over the plain one's, the median over
  passages (16-position steps that answer every position with float32 logits, against
  the prefill's one step).

    python -m tools.serving.scoring [--model smollm2-135m] [--weights int8] [--passages 6]
        [--cpu-sets shared] [--json]
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from tools.harness.models import BenchModel
from tools.harness.options import CpuSets, Json, Model, Weights, fail
from tools.harness.report import print_result, run_record
from tools.harness.stats import paired_ratio

NODES = 2
MIN_PARAGRAPH_CHARS = 200  # shorter paragraphs of the prose are headings and the like
NUMERICS = ("fast", "exact")


def passages(count: int) -> list[str]:
    """The first ``count`` paragraphs of the shipped prose (over MIN_PARAGRAPH_CHARS)."""
    from exporter.quality import PROSE_FILE

    paragraphs = [p.strip() for p in PROSE_FILE.read_text(encoding="utf-8").split("\n\n")]
    return [p for p in paragraphs if len(p) >= MIN_PARAGRAPH_CHARS][:count]


def score_figures(scores: Sequence[Sequence[float]], references: Sequence[np.ndarray],
                  ids: Sequence[Sequence[int]], tops: Sequence[Sequence[int]]
                  ) -> dict[str, float]:
    """Per passage: the cluster's ``scores`` (token i + 1's logprob, i = 0..), the fp32
    model's log-softmax rows ``references`` [T, V], the passage's token ``ids`` and the
    cluster's most likely token at each position (``tops``); the figures over them all."""
    diffs: list[float] = []
    total = ref_total = 0.0
    agree = count = 0
    for score, ref, toks, top in zip(scores, references, ids, tops, strict=True):
        want = [float(ref[i, toks[i + 1]]) for i in range(len(toks) - 1)]
        if len(score) != len(want) or len(top) != len(want):
            raise ValueError(f"{len(score)} scores and {len(top)} top tokens for "
                             f"{len(want)} positions")
        diffs += [abs(a - b) for a, b in zip(score, want, strict=True)]
        total, ref_total = total + sum(score), ref_total + sum(want)
        agree += sum(int(t == int(ref[i].argmax())) for i, t in enumerate(top))
        count += len(want)
    if not count:
        raise ValueError("no token was scored")
    ppl, ref_ppl = math.exp(-total / count), math.exp(-ref_total / count)
    return {"tokens": count, "ppl": ppl, "ref_ppl": ref_ppl, "ppl_ratio": ppl / ref_ppl,
            "mean_abs_diff": float(np.mean(diffs)),
            "p99_abs_diff": float(np.percentile(diffs, 99)), "top1": agree / count}


def measure(serve: str, texts: Sequence[str]) -> tuple[list[list[float]], list[list[int]],
                                                        list[list[int]], list[float], list[float]]:
    """Per passage: the scored request's prompt scores (token 1 on), its top tokens, the
    prompt's ids, and the plain request's and the scored one's times (s, back to back)."""
    from zctl.engine.requests import GenerationChunk, GenerationRequest
    from zctl.service.client import generate_stream

    def run(request: GenerationRequest) -> list[Any]:
        messages = list(generate_stream(serve, request))
        if messages[-1].error:
            raise RuntimeError(messages[-1].error)
        return messages

    run(GenerationRequest("warm-up", "a short warm-up prompt", 2, chat=False, temperature=0.0))
    scores, tops, ids, plain_s, scored_s = [], [], [], [], []
    for i, text in enumerate(texts):
        seconds = []
        plain = GenerationRequest(f"plain-{i}", text, 1, chat=False, ignore_eos=True,
                                  temperature=0.0)
        scored = GenerationRequest(f"scored-{i}", text, 1, chat=False, ignore_eos=True,
                                 temperature=0.0, logprobs=True, top_logprobs=1,
                                 prompt_logprobs=True)
        for request in (plain, scored):  # plain first: a scored prompt uses no cached prefix
            start = time.perf_counter()
            messages = run(request)
            seconds.append(time.perf_counter() - start)
        lps = next(m.prompt_logprobs for m in messages
                   if isinstance(m, GenerationChunk) and m.prompt_logprobs)
        ids.append([lp.token for lp in lps])
        scores.append([lp.logprob for lp in lps[1:]])
        tops.append([lp.top_tokens[0] for lp in lps[1:]])
        plain_s.append(seconds[0])
        scored_s.append(seconds[1])
    return scores, tops, ids, plain_s, scored_s


def numerics_run(bench_model: BenchModel, export_dir: Any, texts: Sequence[str],
                 numerics: str, cpu_sets: str, hf: Any) -> dict[str, Any]:
    """One cluster of the given numerics: its figures against the fp32 model ``hf``."""
    from exporter.quality import hf_logits
    from tools.harness.cluster import local_cluster
    from zctl.engine.sampling import log_softmax
    from zctl.launcher.processes import runtime_spec

    exact = numerics == "exact"
    spec = runtime_spec("f32" if exact else None, None, "CPU", "f32" if exact else None,
                        dynamic_quantization=not exact)
    with local_cluster(export_dir, NODES, spec, bench_model.cache / "bench-scoring",
                       cpu_sets=cpu_sets) as record:
        scores, tops, ids, plain_s, scored_s = measure(record.serve, texts)
    references = [log_softmax(hf_logits(hf, toks)) for toks in ids]
    return {"numerics": numerics, **score_figures(scores, references, ids, tops),
            # the scored request's time over the plain one's, paired passage by passage
            "scoring_cost": paired_ratio(scored_s, plain_s),
            "costs": [s / p for p, s in zip(plain_s, scored_s, strict=True)]}


def render(result: Mapping[str, Any], console: Console) -> None:
    table = Table(title=f"Prompt scores against fp32 Hugging Face ({result['model']} "
                        f"{result['weights']}, {result['runs'][0]['tokens']} tokens, "
                        f"{result['cpu']}, {result['commit']})")
    for column in ("numerics", "perplexity (fp32)", "ratio", "mean |diff|", "p99 |diff|",
                   "top-1 agreement", "scored / plain time"):
        table.add_column(column, justify="right")
    for run in result["runs"]:
        table.add_row(run["numerics"], f"{run['ppl']:.3f} ({run['ref_ppl']:.3f})",
                      f"{run['ppl_ratio']:.4f}x", f"{run['mean_abs_diff']:.4f}",
                      f"{run['p99_abs_diff']:.4f}", f"{run['top1']:.1%}",
                      f"{run['scoring_cost']:.2f}x")
    console.print(table)


def main(model: Model = "smollm2-135m", weights: Weights = "int8",
         count: Annotated[int, typer.Option("--passages", help="paragraphs of the shipped "
                                            "prose to score")] = 6,
         cpu_sets: CpuSets = "shared",
         numerics: Annotated[str, typer.Option(help="fast, exact, or both, comma-separated")]
         = "fast,exact",
         as_json: Json = False) -> None:
    from exporter.sources import open_source

    kinds = [k.strip() for k in numerics.split(",") if k.strip()]
    if not kinds or any(k not in NUMERICS for k in kinds):
        fail(f"--numerics takes {' and '.join(NUMERICS)}, comma-separated")
    texts = passages(count)
    if count < 1 or not texts:
        fail("--passages needs at least 1")
    bench_model = BenchModel.resolve(model)
    export_dir = bench_model.export(NODES, weights)
    hf = open_source(str(bench_model.hf_dir)).load_hf_model()
    runs = [numerics_run(bench_model, export_dir, texts, kind, cpu_sets, hf) for kind in kinds]
    result = {**run_record(), "model": model, "weights": weights, "passages": len(texts),
              "cpu_sets": cpu_sets, "runs": runs}
    print_result(result, as_json, render)


if __name__ == "__main__":
    typer.run(main)
