"""tools.spec.speedup's report: per prompt and drafter, exactness against greedy and speedups
achieved and in theory, then the figures over all prompts. Pure functions of the timed
generations and the calibrations (tools.spec.accounting); tools.spec.speedup's docstring says
what each figure means.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from tools.harness.stats import median, paired_ratio
from tools.spec.accounting import (
    Calibration,
    Generation,
    all_identical,
    first_mismatch,
    theoretical_iid,
    theoretical_speedup,
)
from tools.spec.prompts import BenchPrompt
from zctl.engine.drafting import StepCost, adapt_k


def drafter_entry(name: str, k: int | None, greedy: Sequence[Generation],
                  gens: Sequence[Generation], calibrations: Sequence[Calibration]
                  ) -> tuple[dict[str, Any], float]:
    """One prompt's report for one drafter: exactness against greedy run by run,
    acceptance and draft lengths (of the first run), speedups achieved and in theory;
    and the median achieved / theoretical ratio unrounded."""
    mismatches = [first_mismatch(g.tokens, s.tokens) for g, s in zip(greedy, gens, strict=True)]
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
    # paired run by run (the same prompt, back to back), then the median (paired_ratio):
    # drift of the machine between runs cancels out of each pair
    achieved = paired_ratio([s.tok_s for s in gens], [g.tok_s for g in greedy])
    speedups = [s.tok_s / g.tok_s for g, s in zip(greedy, gens, strict=True)]
    ratio = paired_ratio(speedups, theo)
    if achieved is None or ratio is None:
        raise ValueError(f"{name}: no runs to report")
    return {
        "identical": all(m is None for m in mismatches),
        "first_mismatch": next((m for m in mismatches if m is not None), None),
        "acceptance": round(acceptance, 4),
        "k": k if k is not None else "auto",
        "k_max_used": k_used,
        "mean_draft_len": round(statistics.fmean(lengths), 3) if lengths else 0.0,
        "proposals": len(lengths), "empty_proposals": sum(1 for n in lengths if n == 0),
        "no_draft_steps": len(fed) - len(lengths),  # K was 0: the drafter not asked
        "steps": len(fed), "tokens_per_step": round(decoded / len(fed), 3) if fed else 0.0,
        "spec_tok_s": round(median([g.tok_s for g in gens]), 2),
        "achieved_speedup": round(achieved, 4),
        "theoretical_speedup": round(median(theo), 4),
        "theoretical_iid": round(median(iid), 4),
        "achieved_over_theoretical": round(ratio, 4),
        "time": time_split(gens, calibrations, name),
        "samples_tok_s": [round(g.tok_s, 2) for g in gens],
        "samples_speedup": [round(x, 3) for x in speedups],
        "samples_theoretical": [round(x, 3) for x in theo],
    }, ratio


def prompt_entry(prompt: BenchPrompt, ids: list[int], res: dict[str, list[Generation]],
                 drafters: Sequence[str], ks: dict[str, int | None],
                 calibrations: Sequence[Calibration]) -> tuple[dict[str, Any], dict[str, float]]:
    """One prompt's report: greedy's figures, then each drafter's (:func:`drafter_entry`);
    and each drafter's achieved / theoretical ratio."""
    greedy = res["greedy"]
    entry: dict[str, Any] = {
        "name": prompt.name, "kind": prompt.kind, "prompt_tokens": len(ids),
        "new_tokens": len(greedy[0].tokens),
        "greedy_tok_s": round(median([g.tok_s for g in greedy]), 2),
        "greedy_time": time_split(greedy, []),
    }
    ratios = {}
    for name in drafters:
        entry[name], ratios[name] = drafter_entry(name, ks[name], greedy, res[name], calibrations)
    entry["identical"] = all(entry[name]["identical"] for name in drafters)
    return entry, ratios


def adaptive_cost_json(cost: StepCost | None, k_max: int) -> dict[str, Any] | None:
    """An adaptive drafter's cost model, and the K ``adapt_k`` picks at a few acceptance
    rates (0.5 is the first step's prior), staying at a width and leaving 1-token steps
    (two shape changes)."""
    if cost is None:
        return None
    rates = (0.3, 0.5, 0.7, 0.9)
    return {"step_ms": round(cost.step_ms, 3), "token_ms": round(cost.token_ms, 3),
            "draft_ms": round(cost.draft_ms, 4), "switch_ms": round(cost.switch_ms, 3),
            "k_at": {str(a): adapt_k(a, cost, k_max=k_max) for a in rates},
            "k_at_from_1_token": {str(a): adapt_k(a, cost, k_max=k_max, prev_fed=1)
                                  for a in rates}}


def bench_summary(entries: list[dict[str, Any]], ratios: dict[str, list[float]],
                  results: Sequence[dict[str, list[Generation]]], drafters: Sequence[str]
                  ) -> dict[str, Any]:
    """The headline figures over all prompts: every speculative output identical to its
    greedy run (and greedy to itself), and achieved over theoretical speedups."""
    pairs = [(g.tokens, s.tokens) for res in results for name in drafters
             for g, s in zip(res["greedy"], res[name], strict=True)]
    deterministic = all(g.tokens == res["greedy"][0].tokens for res in results
                        for g in res["greedy"])
    all_ratios = [r for values in ratios.values() for r in values]
    return {
        "identical": all_identical(pairs) and deterministic,
        "greedy_deterministic": deterministic,
        "achieved_over_theoretical": round(statistics.fmean(all_ratios), 4) if all_ratios else None,
        "achieved_over_theoretical_by_drafter": {
            d: round(statistics.fmean(v), 4) for d, v in ratios.items() if v},
        "mean_speedup_by_drafter": {
            d: round(statistics.fmean(e[d]["achieved_speedup"] for e in entries), 4)
            for d in drafters},
    }


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
