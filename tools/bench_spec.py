"""Speculative decoding (paper §5-6): acceptance, speedup against its theory, rewind cost.

    python -m tools.bench_spec [--stages 2] [--tokens 96] [--k auto|N] [--drafter both]
                               [--draft-model DIR | --draft-layers N] [--runs 3] [--json]

One process, one target chain (``LocalChain``, mask rewind). Per prompt of a fixed set
(code, extraction, chat, creative; chat-templated), interleaved run by run with the
system order rotated: plain greedy, then speculative decoding with each drafter
(prompt lookup, a draft model). Every speculative output is compared token for token
with the greedy output of the same prompt and run: ``identical`` is true only if all
matched.

Accounting (every cost below is measured in the same run, before each run's prompts):

* ``c(f)``: ms of one ``pipeline.step`` feeding f tokens (f = 1 .. k_max + 1, with top-1
  at every position when f > 1) right after a step of the same f, on a stream holding
  about as many slots as the prompts will (median prompt length + tokens / 2), with mask
  rewind between steps; ``c'(f)``: the same right after a step of another size. On the
  CPU plugin a change of token count costs much more than a repeated one (measured:
  1 token after 1: 46 ms, after 5: 67 ms), and speculative steps change size whenever the
  draft length does, so each logged step is costed with ``c'`` when its fed count differs
  from the previous step's, else with ``c``. Greedy (always 1 token) is costed ``c(1)``.
* ``d(n)``: the drafter's cost for a proposal of n tokens: lookup, one ``propose`` call on
  a history of that length (independent of n); draft model, ``n * t_draft`` with
  ``t_draft`` one step of the draft runner (the mean of a burst of K right after a verify
  step, fed as ModelDrafter feeds after a full accept: 2 tokens, then 1 at a time), plus
  ``(r - 1) * c(n + 1)`` if a verify step right after draft-model steps is r > 1 times
  slower than one after target steps (the draft weights evicting the target's from the
  caches). The draft model's prompt prefill is done before the decode clock starts (like
  the target's, it belongs to the time to first token), by one ``propose(prompt, 1)``.
* The calibration interleaves all of these rep by rep (the order of the fed counts
  rotated from rep to rep) and keeps the median *ratio* of
  each to the same rep's ``c(1)`` (scaled by the median ``c(1)``): other processes on the
  cores move absolute times by tens of percent within seconds, ratios taken milliseconds
  apart much less. Only ratios enter the theoretical speedup.

Theoretical speedup of one generation, from its own step log (steps i, each feeding
``fed_i`` = 1 + drafts actually proposed; proposals j of ``n_j`` tokens; T = decoded
tokens after the first, the same T greedy needs T steps for)::

    theoretical = T * c(1) / (sum_i c_i(fed_i) + sum_j d(n_j)),  c_i = c' or c (above)

It uses the draft lengths actually proposed (lookup misses propose fewer than K or none,
and K is capped near the token budget), so it is what the cost model promises for exactly
these steps. ``achieved = spec tok/s / greedy tok/s`` (decode throughput, tokens after
the first), paired run by run (greedy and speculative of one prompt run back to back);
``ratio = achieved / theoretical`` per run; both reported as the median over runs. A ratio
below 1 is time the model does not account for (the loop's Python, verify steps or
drafting slower than calibrated) plus noise. The per-prompt ``time`` breakdown splits
measured decode time into verify steps, drafting and the rest (loop overhead), measured
and as modelled, so a low ratio can be traced.

For reference, the i.i.d. formula with per-token acceptance a = accepted / proposed and
K the largest draft length used: ``theoretical_iid = E(a, K) * c(1) / (c(K+1) + d(K))``
with ``E(a, K) = (1 - a^(K+1)) / (1 - a)`` (``expected_tokens``). It overstates the speedup
of lookup drafting, whose proposals are often shorter than K.

Rewind cost: ``StageRunner.mask_tail`` against ``trim_tail`` per call, rewinding
4 slots of a 200-slot stream on every target stage (``--rewind-reps`` calls each),
interleaved call by call (the slots are restored, untimed, between calls), median ms.

Exactness needs ``--kv-cache-precision f32`` (the default here): with the CPU plugin's
default u8 KV cache, K/V computed in a multi-token verify step are not bit-identical to
those of 1-token steps, and a near-tie in the logits (0.1 apart on ``fix-typo``) flips.
For the same reason it turns off the CPU plugin's dynamic int8 quantization of
activations (on by default on AVX-512-VNNI/AMX CPUs; ``--dynamic-quantization`` keeps it:
there 6 of the 8 prompts came out different from greedy).

The default draft model is a 1-stage export of the same model: its drafts are (nearly)
all accepted but each costs a full forward pass, so it cannot speed anything up; it shows
that model drafting is lossless and that the accounting holds. ``--draft-layers N``
exports the first N layers of the model (with its final norm and LM head) as a cheaper,
early-exit drafter.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from dataplane.draft_model import ModelDrafter
from dataplane.local_chain import LocalChain
from dataplane.runtime import RuntimeConfig, StageRunner
from engine.drafting import LookupDrafter, StepCost, adapt_k
from engine.scheduler import generate_greedy, generate_speculative
from engine.stats import GenerationStats, SpeculativeStats
from tools.spec_accounting import (
    Calibration,
    StepRecord,
    TimedDrafter,
    TimedPipeline,
    all_identical,
    calibrate,
    filler_ids,
    first_mismatch,
    median,
    theoretical_iid,
    theoretical_speedup,
    time_rewinds,
)
from tools.spec_prompts import PROMPTS, BenchPrompt

err = Console(stderr=True)
DRAFTERS = ("lookup", "draft")


# -- one generation of each system -------------------------------------------------------


@dataclass
class Generation:
    tokens: list[int]
    tok_s: float
    decode_ms: float
    steps: list[StepRecord]
    proposals: list[tuple[int, float]] = field(default_factory=list)
    accepted: int = 0
    proposed: int = 0


def run_greedy(pipe: TimedPipeline, ids: list[int], tokens: int, stop_ids: Sequence[int],
               prefill_chunk: int) -> Generation:
    pipe.log.clear()
    stats = GenerationStats()
    out = list(generate_greedy(pipe, ids, tokens, stop_ids, prefill_chunk=prefill_chunk,
                               stats=stats))
    return Generation(out, stats.tok_s, stats.decode_ms, pipe.decode_steps(len(ids)))


def run_speculative(pipe: TimedPipeline, ids: list[int], tokens: int, stop_ids: Sequence[int],
                    prefill_chunk: int, drafter: Any, k: int, cost: StepCost | None
                    ) -> Generation:
    timed = TimedDrafter(drafter)
    pipe.log.clear()
    stats = SpeculativeStats()
    out = list(generate_speculative(pipe, ids, tokens, stop_ids, drafter=timed, k=k,
                                    stats=stats, prefill_chunk=prefill_chunk, cost=cost))
    return Generation(out, stats.tok_s, stats.decode_ms, pipe.decode_steps(len(ids)),
                      timed.log, stats.accepted, stats.proposed)


# -- the benchmark -----------------------------------------------------------------------


def run_bench(
    chain: LocalChain,
    prompts: Sequence[tuple[BenchPrompt, list[int]]],
    tokens: int,
    *,
    drafters: Sequence[str] = DRAFTERS,
    draft_runner: StageRunner | None = None,
    k: int | None = None,
    k_max: int = 8,
    draft_k: int | None = 4,
    runs: int = 3,
    stop_ids: Sequence[int] = (),
    calib_reps: int = 6,
    rewind_slots: int = 200,
    rewind_count: int = 4,
    rewind_reps: int = 100,
    prefill_chunk: int = 256,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Everything the JSON reports (see the module docstring). ``k``/``draft_k`` None =
    adaptive (``adapt_k`` per step from a StepCost fitted on the first calibration, up to
    ``k_max``)."""
    say = progress or (lambda text: None)
    drafters = [d for d in DRAFTERS if d in drafters]
    if "draft" in drafters and draft_runner is None:
        raise ValueError("the draft-model drafter needs a draft_runner")
    if not prompts:
        raise ValueError("no prompts")
    pipe = TimedPipeline(chain)
    ids_all = [ids for _, ids in prompts]
    context_len = int(statistics.median(len(i) for i in ids_all)) + tokens // 2
    context = filler_ids(ids_all, context_len)
    ks = {"lookup": k, "draft": draft_k}
    max_fed = max(k_max if v is None else v for v in ks.values()) + 1
    ks_draft_burst = max(1, k_max if draft_k is None else draft_k)

    say("timing mask vs trim rewind ...")
    rewind = time_rewinds(chain, filler_ids(ids_all, rewind_slots), rewind_count, rewind_reps)
    # warm-up: every system once on the first prompt
    warm_ids = ids_all[0]
    run_greedy(pipe, warm_ids, min(tokens, 8), stop_ids, prefill_chunk)
    say("calibrating step costs ...")
    first_cal = calibrate(chain, context, max_fed, calib_reps, draft_runner, k_max, ks_draft_burst)
    fitted = first_cal.fit()
    switch_ms = max(first_cal.switched_ms(1) - first_cal.verify_ms(1), 0.0)  # a shape change
    costs: dict[str, StepCost | None] = {}
    for name in drafters:
        costs[name] = None if ks[name] is not None else StepCost(
            fitted.step_ms, fitted.token_ms,
            first_cal.draft_ms(name)(1) / (max(k_max, 1) if name == "lookup" else 1), switch_ms)

    def make_drafter(name: str, ids: list[int]) -> Any:
        if name == "lookup":
            return LookupDrafter()
        drafter = ModelDrafter(draft_runner)  # type: ignore[arg-type]
        drafter.propose(ids, 1)  # the draft model's prompt prefill, before the decode clock
        return drafter

    def spec(name: str, ids: list[int]) -> Generation:
        kk = ks[name]
        return run_speculative(pipe, ids, tokens, stop_ids, prefill_chunk,
                               make_drafter(name, ids), k_max if kk is None else kk, costs[name])

    for name in drafters:
        spec(name, warm_ids)

    systems = ["greedy", *drafters]
    results: list[dict[str, list[Generation]]] = [{s: [] for s in systems} for _ in prompts]
    calibrations: list[Calibration] = []
    for run in range(runs):
        cal = first_cal if run == 0 else calibrate(chain, context, max_fed, calib_reps,
                                                   draft_runner, k_max, ks_draft_burst)
        calibrations.append(cal)
        order = systems[run % len(systems):] + systems[:run % len(systems)]
        for p, (prompt, ids) in enumerate(prompts):
            for system in order:
                if system == "greedy":
                    gen = run_greedy(pipe, ids, tokens, stop_ids, prefill_chunk)
                else:
                    gen = spec(system, ids)
                results[p][system].append(gen)
            line = "  ".join(f"{s} {results[p][s][-1].tok_s:.1f}" for s in systems)
            say(f"run {run + 1}/{runs} {prompt.name}: {line} tok/s")

    # -- report ----------------------------------------------------------------------
    pairs: list[tuple[list[int], list[int]]] = []
    greedy_deterministic = True
    entries: list[dict[str, Any]] = []
    ratios: dict[str, list[float]] = {d: [] for d in drafters}
    for (prompt, ids), res in zip(prompts, results, strict=True):
        greedy = res["greedy"]
        greedy_deterministic &= all(g.tokens == greedy[0].tokens for g in greedy)
        greedy_tok_s = median([g.tok_s for g in greedy])
        entry: dict[str, Any] = {
            "name": prompt.name, "kind": prompt.kind, "prompt_tokens": len(ids),
            "new_tokens": len(greedy[0].tokens), "greedy_tok_s": round(greedy_tok_s, 2),
            "greedy_time": time_split(greedy, []),
        }
        same = True
        for name in drafters:
            gens = res[name]
            mismatches = []
            for g, s in zip(greedy, gens, strict=True):
                pairs.append((g.tokens, s.tokens))
                mismatches.append(first_mismatch(g.tokens, s.tokens))
            ok = all(m is None for m in mismatches)
            same &= ok
            first = gens[0]
            acceptance = first.accepted / first.proposed if first.proposed else 0.0
            decoded = len(first.tokens) - 1
            fed = [r.fed for r in first.steps]
            lengths = [n for n, _ in first.proposals]
            theo = [theoretical_speedup(decoded, [r.fed for r in g.steps], [n for n, _ in g.proposals],
                                        cal.verify_ms, cal.draft_ms(name), cal.step_ms)
                    for g, cal in zip(gens, calibrations, strict=True)]
            k_used = max(lengths, default=0)
            iid = [theoretical_iid(acceptance, k_used, cal.verify_ms, cal.draft_ms(name))
                   for cal in calibrations]
            spec_tok_s = median([g.tok_s for g in gens])
            # paired run by run (the same prompt, back to back), then the median: drift of
            # the machine between runs cancels out of each pair
            speedups = [s.tok_s / g.tok_s if g.tok_s else 0.0
                        for g, s in zip(greedy, gens, strict=True)]
            achieved = median(speedups)
            theoretical = median(theo)
            ratio = median([a / t if t else 0.0 for a, t in zip(speedups, theo, strict=True)])
            ratios[name].append(ratio)
            entry[name] = {
                "identical": ok,
                "first_mismatch": next((m for m in mismatches if m is not None), None),
                "acceptance": round(acceptance, 4),
                "k": ks[name] if ks[name] is not None else "auto",
                "k_max_used": k_used,
                "mean_draft_len": round(statistics.fmean(lengths), 3) if lengths else 0.0,
                "proposals": len(lengths), "empty_proposals": sum(1 for n in lengths if n == 0),
                "no_draft_steps": len(fed) - len(lengths),  # K was 0: the drafter not asked
                "steps": len(fed), "tokens_per_step": round(decoded / len(fed), 3) if fed else 0.0,
                "spec_tok_s": round(spec_tok_s, 2),
                "achieved_speedup": round(achieved, 4),
                "theoretical_speedup": round(theoretical, 4),
                "theoretical_iid": round(median(iid), 4),
                "achieved_over_theoretical": round(ratio, 4),
                "time": time_split(gens, calibrations, name),
                "samples_tok_s": [round(g.tok_s, 2) for g in gens],
                "samples_speedup": [round(x, 3) for x in speedups],
                "samples_theoretical": [round(x, 3) for x in theo],
            }
        entry["identical"] = same
        entries.append(entry)

    all_ratios = [r for values in ratios.values() for r in values]
    result: dict[str, Any] = {
        "identical": all_identical(pairs) and greedy_deterministic,
        "greedy_deterministic": greedy_deterministic,
        "achieved_over_theoretical": round(statistics.fmean(all_ratios), 4) if all_ratios else None,
        "achieved_over_theoretical_by_drafter": {
            d: round(statistics.fmean(v), 4) for d, v in ratios.items() if v},
        "mean_speedup_by_drafter": {
            d: round(statistics.fmean(e[d]["achieved_speedup"] for e in entries), 4)
            for d in drafters},
        **{k_: v for k_, v in rewind.items()},
        "stages": chain.num_stages, "tokens": tokens, "runs": runs,
        "k": {d: (ks[d] if ks[d] is not None else "auto") for d in drafters}, "k_max": k_max,
        "adaptive_cost": {d: (None if c is None else {
            "step_ms": round(c.step_ms, 3), "token_ms": round(c.token_ms, 3),
            "draft_ms": round(c.draft_ms, 4), "switch_ms": round(c.switch_ms, 3),
            # the K adapt_k picks at a few acceptance rates (0.5 is the first step's prior),
            # staying at a width and leaving 1-token steps (two shape changes)
            "k_at": {str(a): adapt_k(a, c, k_max=k_max) for a in (0.3, 0.5, 0.7, 0.9)},
            "k_at_from_1_token": {str(a): adapt_k(a, c, k_max=k_max, prev_fed=1)
                                  for a in (0.3, 0.5, 0.7, 0.9)}})
            for d, c in costs.items()},
        "calibration_context_slots": context_len,
        "step_costs": [c.as_json() for c in calibrations],
        "prompts": entries,
    }
    return result


def time_split(gens: Sequence[Generation], calibrations: Sequence[Calibration],
               drafter: str | None = None) -> dict[str, float]:
    """Median over runs of where decode time went, in ms per decoded token: verify steps
    (measured, and as the cost model predicts), drafting (measured, and predicted), and the
    rest of the loop."""
    rows: dict[str, list[float]] = {"decode": [], "verify": [], "draft": [], "other": [],
                                    "verify_model": [], "draft_model": []}
    for i, g in enumerate(gens):
        decoded = max(len(g.tokens) - 1, 1)
        verify = sum(r.ms for r in g.steps)
        draft = sum(ms for _, ms in g.proposals)
        rows["decode"].append(g.decode_ms / decoded)
        rows["verify"].append(verify / decoded)
        rows["draft"].append(draft / decoded)
        rows["other"].append((g.decode_ms - verify - draft) / decoded)
        if calibrations:
            cal = calibrations[i]
            rows["verify_model"].append(sum(cal.step_ms([r.fed for r in g.steps])) / decoded)
            if drafter is not None:
                dm = cal.draft_ms(drafter)
                rows["draft_model"].append(sum(dm(n) for n, _ in g.proposals) / decoded)
    return {f"{key}_ms_per_token": round(median(v), 3) for key, v in rows.items() if v}


# -- command line ------------------------------------------------------------------------


def parse_k(value: str) -> int | None:
    """'auto' -> None, else a non-negative int."""
    if value.strip().lower() == "auto":
        return None
    k = int(value)
    if k < 0:
        raise typer.BadParameter(f"K must be >= 0 or 'auto', got {value}")
    return k


def truncated_source(hf_dir: Path, layers: int, cache: Path) -> Path:
    """An HF directory of the model's first ``layers`` layers (config changed, the weights
    symlinked: the exporter reads only the tensors of the layers it builds)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    if not 0 < layers < int(cfg["num_hidden_layers"]):
        raise typer.BadParameter(f"--draft-layers must be in 1..{cfg['num_hidden_layers'] - 1}")
    out = cache / "sources" / f"{hf_dir.name}-L{layers}"
    out.mkdir(parents=True, exist_ok=True)
    for path in hf_dir.iterdir():
        if path.name != "config.json" and not (out / path.name).exists():
            (out / path.name).symlink_to(path.resolve())
    cfg["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def render(result: dict[str, Any], drafters: Sequence[str]) -> None:
    console = Console()
    table = Table(title=f"speculative decoding, {result['stages']} stages, "
                        f"{result['tokens']} tokens, median of {result['runs']}")
    for col in ("prompt", "kind", "greedy tok/s"):
        table.add_column(col, justify="right" if "tok" in col else "left")
    for d in drafters:
        for col in ("acc", "K", "tok/s", "speedup", "theory", "ratio", "same"):
            table.add_column(f"{d} {col}", justify="right")
    for e in result["prompts"]:
        row = [e["name"], e["kind"], f"{e['greedy_tok_s']:.1f}"]
        for d in drafters:
            x = e[d]
            row += [f"{x['acceptance']:.2f}", f"{x['k']}/{x['mean_draft_len']:.1f}",
                    f"{x['spec_tok_s']:.1f}", f"{x['achieved_speedup']:.2f}x",
                    f"{x['theoretical_speedup']:.2f}x", f"{x['achieved_over_theoretical']:.2f}",
                    "[green]yes[/]" if x["identical"] else "[red]NO[/]"]
        table.add_row(*row)
    console.print(table)
    console.print(f"identical: {result['identical']}   achieved/theoretical (mean): "
                  f"{result['achieved_over_theoretical']}   by drafter: "
                  f"{result['achieved_over_theoretical_by_drafter']}")
    console.print(f"rewind per call ({result['rewind_count']} of {result['rewind_slots']} slots): "
                  f"mask {result['mask_rewind_ms']:.4f} ms, trim {result['trim_rewind_ms']:.4f} ms")
    if result.get("note"):
        console.print(result["note"])


def main(
    model: str = typer.Option("smollm2-135m", help="smollm2-135m, random-1b, or an HF directory"),
    weights: str = typer.Option("int4", help="int4 | int8 | fp16 | fp32"),
    stages: int = typer.Option(2, help="target stages, chained in this process"),
    tokens: int = typer.Option(96, help="new tokens per generation"),
    k: str = typer.Option("auto", help="draft length for lookup: an int, or 'auto' (adapt_k)"),
    k_max: int = typer.Option(8, help="largest K under 'auto'"),
    drafter: str = typer.Option("both", help="lookup | draft | both"),
    draft_model: str = typer.Option("", help="a 1-stage export to draft with (default: the "
                                    "model itself as 1 stage, or --draft-layers)"),
    draft_layers: int = typer.Option(0, help="draft with the model's first N layers (exported "
                                     "once); 0: the whole model"),
    draft_k: str = typer.Option("4", help="draft length for the draft model (int or 'auto')"),
    runs: int = typer.Option(3, help="interleaved runs (medians reported)"),
    rewind_reps: int = typer.Option(100, help="timed mask/trim rewinds per stage"),
    precision: str = typer.Option("f32", help="INFERENCE_PRECISION_HINT, or 'default'"),
    threads: int = typer.Option(0, help="INFERENCE_NUM_THREADS (0: plugin default)"),
    kv_cache_precision: str = typer.Option(
        "f32", help="KV_CACHE_PRECISION, or 'default' (the CPU plugin's u8: multi-token "
        "verify steps then round differently from 1-token steps, and near-ties can flip)"),
    dynamic_quantization: bool = typer.Option(
        False, help="let the CPU plugin quantize activations to int8 dynamically (its default "
        "on AVX-512-VNNI/AMX CPUs, ~40% faster there): verify steps then round differently "
        "from 1-token steps, and near-ties can flip"),
    stop_at_eos: bool = typer.Option(True, help="stop a generation at the model's EOS"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    from common.paths import zctl_home
    from engine.tokenizer import ChatTokenizer
    from tools.bench_common import cached_export, export_name, model_hf_dir

    if drafter not in ("lookup", "draft", "both"):
        raise typer.BadParameter("--drafter must be lookup, draft or both")
    names = list(DRAFTERS) if drafter == "both" else [drafter]
    cache = zctl_home()
    hf_dir = model_hf_dir(model, cache)
    name = export_name(model, hf_dir)
    target_dir = cached_export(hf_dir, name, stages, weights, True, cache)
    config = RuntimeConfig(precision=None if precision == "default" else precision,
                           num_threads=threads or None, performance_hint="LATENCY",
                           kv_cache_precision=None if kv_cache_precision == "default"
                           else kv_cache_precision, dynamic_quantization=dynamic_quantization)
    chain = LocalChain.load(str(target_dir), config, rewind="mask")
    draft_runner = None
    draft_desc = None
    if "draft" in names:
        if draft_model:
            draft_dir = Path(draft_model)
        elif draft_layers:
            src = truncated_source(hf_dir, draft_layers, cache)
            draft_dir = cached_export(src, src.name, 1, weights, True, cache)
        else:
            draft_dir = cached_export(hf_dir, name, 1, weights, True, cache)
        draft_runner = StageRunner(draft_dir, 0, config)
        spec = draft_runner.manifest.stages[0]
        draft_desc = {"dir": str(draft_dir), "layers": spec.layer_end - spec.layer_start,
                      "target_layers": draft_runner.manifest.model.num_layers}
    tok = ChatTokenizer(target_dir)
    prompts = [(p, tok.encode(p.text)) for p in PROMPTS]
    eos = tok.eos_token_id
    result = run_bench(chain, prompts, tokens, drafters=names, draft_runner=draft_runner,
                       k=parse_k(k), k_max=k_max, draft_k=parse_k(draft_k), runs=runs,
                       stop_ids=[eos] if stop_at_eos and eos is not None else [],
                       rewind_reps=rewind_reps, progress=lambda s: err.print(s, highlight=False))
    result = {"model": model, "weights": weights, "target": str(target_dir),
              "properties": config.properties(),
              "draft_model": draft_desc, **result}
    if draft_desc is not None and draft_desc["layers"] >= chain.runners[-1].manifest.model.num_layers:
        result["note"] = ("the draft model is the target itself (all layers, 1 stage): its drafts "
                          "are accepted but each costs a full forward pass, so it cannot speed "
                          "decoding up; it shows model drafting is lossless and the accounting "
                          "holds. --draft-layers N drafts with the first N layers instead.")
    if as_json:
        print(json.dumps(result))
        return
    render(result, names)


if __name__ == "__main__":
    typer.run(main)
