"""Speculative decoding (paper §5-6): acceptance, speedup against its theory, rewind cost.

    python -m tools.spec.speedup [--stages 2] [--tokens 96] [--k auto|N] [--drafter both]
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
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.draft_model import ModelDrafter
from dataplane.runtime.stateful import StageRunner
from tools.harness.greedy import timed_greedy
from tools.harness.models import BenchModel
from tools.harness.options import Json, Model, Precision, Runs, Threads, Weights, fail, parse_k
from tools.harness.order import rotated
from tools.harness.report import err
from tools.spec.accounting import (
    Calibration,
    Generation,
    TimedDrafter,
    TimedPipeline,
    calibrate,
    filler_ids,
    time_rewinds,
)
from tools.spec.prompts import PROMPTS, BenchPrompt
from tools.spec.report import adaptive_cost_json, bench_summary, prompt_entry
from zctl.engine.drafting import LookupDrafter, StepCost
from zctl.engine.scheduler import generate_speculative
from zctl.engine.stats import SpeculativeStats

DRAFTERS = ("lookup", "draft")


# -- one generation of each system -------------------------------------------------------


def run_greedy(pipe: TimedPipeline, ids: list[int], tokens: int, stop_ids: Sequence[int],
               prefill_chunk: int) -> Generation:
    """One greedy generation, its steps logged."""
    pipe.log.clear()
    out, stats = timed_greedy(pipe, ids, tokens, stop_ids=stop_ids, prefill_chunk=prefill_chunk)
    return Generation(out, stats.tok_s, stats.decode_ms, pipe.decode_steps(len(ids)))


def run_speculative(pipe: TimedPipeline, ids: list[int], tokens: int, stop_ids: Sequence[int],
                    prefill_chunk: int, drafter: Any, k: int, cost: StepCost | None
                    ) -> Generation:
    """One speculative generation, its steps and proposals logged."""
    timed = TimedDrafter(drafter)
    pipe.log.clear()
    stats = SpeculativeStats()
    out = list(generate_speculative(pipe, ids, tokens, stop_ids, drafter=timed, k=k,
                                    stats=stats, prefill_chunk=prefill_chunk, cost=cost))
    return Generation(out, stats.tok_s, stats.decode_ms, pipe.decode_steps(len(ids)),
                      timed.log, stats.accepted, stats.proposed)


# -- the benchmark -----------------------------------------------------------------------


@dataclass
class Systems:
    """Greedy decoding and each drafter's speculative decoding, on one timed pipeline.
    ``ks[drafter]`` None: adaptive K (``adapt_k`` up to ``k_max`` on ``costs[drafter]``)."""

    pipe: TimedPipeline
    tokens: int
    stop_ids: Sequence[int]
    prefill_chunk: int
    draft_runner: StageRunner | None
    ks: dict[str, int | None]
    k_max: int
    costs: dict[str, StepCost | None] = field(default_factory=dict)

    def drafter(self, name: str, ids: list[int]) -> Any:
        """A fresh drafter for one generation of ``ids``."""
        if name == "lookup":
            return LookupDrafter()
        drafter = ModelDrafter(self.draft_runner)  # type: ignore[arg-type]
        drafter.propose(ids, 1)  # the draft model's prompt prefill, before the decode clock
        return drafter

    def run(self, system: str, ids: list[int], tokens: int | None = None) -> Generation:
        """One generation of ``ids`` by ``system`` ("greedy" or a drafter's name)."""
        tokens = self.tokens if tokens is None else tokens
        if system == "greedy":
            return run_greedy(self.pipe, ids, tokens, self.stop_ids, self.prefill_chunk)
        k = self.ks[system]
        return run_speculative(self.pipe, ids, tokens, self.stop_ids, self.prefill_chunk,
                               self.drafter(system, ids), self.k_max if k is None else k,
                               self.costs[system])


def adaptive_costs(cal: Calibration, drafters: Sequence[str], ks: dict[str, int | None],
                   k_max: int) -> dict[str, StepCost | None]:
    """The StepCost ``adapt_k`` works with, per drafter whose K is adaptive (None for a
    fixed K), fitted on calibration ``cal``."""
    fitted = cal.fit()
    switch_ms = max(cal.switched_ms(1) - cal.verify_ms(1), 0.0)  # a shape change
    return {name: None if ks[name] is not None else StepCost(
        fitted.step_ms, fitted.token_ms,
        cal.draft_ms(name)(1) / (max(k_max, 1) if name == "lookup" else 1), switch_ms)
        for name in drafters}


def interleaved_runs(systems: Systems, prompts: Sequence[tuple[BenchPrompt, list[int]]],
                     names: Sequence[str], runs: int, first_cal: Calibration,
                     recalibrate: Callable[[], Calibration], say: Callable[[str], None]
                     ) -> tuple[list[dict[str, list[Generation]]], list[Calibration]]:
    """``runs`` runs of every system on every prompt, the systems' order rotated from run
    to run, each run after its own calibration (the first: ``first_cal``). Per prompt,
    each system's generations; and the calibrations, one per run."""
    results: list[dict[str, list[Generation]]] = [{s: [] for s in names} for _ in prompts]
    calibrations: list[Calibration] = []
    for run in range(runs):
        calibrations.append(first_cal if run == 0 else recalibrate())
        for p, (prompt, ids) in enumerate(prompts):
            for system in rotated(names, run):
                results[p][system].append(systems.run(system, ids))
            line = "  ".join(f"{s} {results[p][s][-1].tok_s:.1f}" for s in names)
            say(f"run {run + 1}/{runs} {prompt.name}: {line} tok/s")
    return results, calibrations


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
    ids_all = [ids for _, ids in prompts]
    context_len = int(statistics.median(len(i) for i in ids_all)) + tokens // 2
    context = filler_ids(ids_all, context_len)
    ks = {"lookup": k, "draft": draft_k}
    max_fed = max(k_max if v is None else v for v in ks.values()) + 1
    draft_burst = max(1, k_max if draft_k is None else draft_k)

    def recalibrate() -> Calibration:
        return calibrate(chain, context, max_fed, calib_reps, draft_runner, k_max, draft_burst)

    systems = Systems(TimedPipeline(chain), tokens, stop_ids, prefill_chunk, draft_runner, ks, k_max)
    say("timing mask vs trim rewind ...")
    rewind = time_rewinds(chain, filler_ids(ids_all, rewind_slots), rewind_count, rewind_reps)
    systems.run("greedy", ids_all[0], min(tokens, 8))  # warm-up: every system once
    say("calibrating step costs ...")
    first_cal = recalibrate()
    systems.costs = adaptive_costs(first_cal, drafters, ks, k_max)
    for name in drafters:
        systems.run(name, ids_all[0])
    results, calibrations = interleaved_runs(systems, prompts, ["greedy", *drafters], runs,
                                             first_cal, recalibrate, say)
    reports = [prompt_entry(prompt, ids, res, drafters, ks, calibrations)
               for (prompt, ids), res in zip(prompts, results, strict=True)]
    entries = [entry for entry, _ in reports]
    ratios = {d: [r[d] for _, r in reports] for d in drafters}
    return {
        **bench_summary(entries, ratios, results, drafters),
        **{k_: v for k_, v in rewind.items()},
        "stages": chain.num_stages, "tokens": tokens, "runs": runs,
        "k": {d: (ks[d] if ks[d] is not None else "auto") for d in drafters}, "k_max": k_max,
        "adaptive_cost": {d: adaptive_cost_json(c, k_max) for d, c in systems.costs.items()},
        "calibration_context_slots": context_len,
        "step_costs": [c.as_json() for c in calibrations],
        "prompts": entries,
    }


# -- command line ------------------------------------------------------------------------


def truncated_source(hf_dir: Path, layers: int, cache: Path) -> Path:
    """An HF directory of the model's first ``layers`` layers (config changed, the weights
    symlinked: the exporter reads only the tensors of the layers it builds)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    if not 0 < layers < int(cfg["num_hidden_layers"]):
        fail(f"--draft-layers must be in 1..{cfg['num_hidden_layers'] - 1}")
    out = cache / "sources" / f"{hf_dir.name}-L{layers}"
    out.mkdir(parents=True, exist_ok=True)
    for path in hf_dir.iterdir():
        if path.name != "config.json" and not (out / path.name).exists():
            (out / path.name).symlink_to(path.resolve())
    cfg["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def render(result: dict[str, Any], drafters: Sequence[str]) -> None:
    """The table and the headline figures printed without --json."""
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


SELF_DRAFT_NOTE = ("the draft model is the target itself (all layers, 1 stage): its drafts "
                   "are accepted but each costs a full forward pass, so it cannot speed "
                   "decoding up; it shows model drafting is lossless and the accounting "
                   "holds. --draft-layers N drafts with the first N layers instead.")


def runtime_config(precision: str, threads: int, kv_cache_precision: str,
                   dynamic_quantization: bool) -> RuntimeSpec:
    """The target's and the draft model's runtime settings ('default': the plugin's)."""
    return RuntimeSpec(precision=None if precision == "default" else precision,
                       num_threads=threads or None, performance_hint="LATENCY",
                       kv_cache_precision=None if kv_cache_precision == "default"
                       else kv_cache_precision, dynamic_quantization=dynamic_quantization)


def draft_export(model: BenchModel, weights: str, draft_model: str, draft_layers: int) -> Path:
    """The draft model's 1-stage export: ``draft_model``, else the model's first
    ``draft_layers`` layers, else the whole model."""
    if draft_model:
        return Path(draft_model)
    if draft_layers:
        src = truncated_source(model.hf_dir, draft_layers, model.cache)
        return BenchModel(src.name, src, model.cache).export(1, weights)
    return model.export(1, weights)


def load_draft(draft_dir: Path, config: RuntimeSpec) -> tuple[StageRunner, dict[str, Any]]:
    """The draft model's runner, and what the JSON says of it."""
    runner = StageRunner(draft_dir, 0, config)
    spec = runner.manifest.stages[0]
    return runner, {"dir": str(draft_dir), "layers": spec.layer_end - spec.layer_start,
                    "target_layers": runner.manifest.model.num_layers}


def main(
    model: Model = "smollm2-135m",
    weights: Weights = "int4",
    stages: Annotated[int, typer.Option(help="target stages, chained in this process")] = 2,
    tokens: Annotated[int, typer.Option(help="new tokens per generation")] = 96,
    k: Annotated[str, typer.Option(
        help="draft length for lookup: an int, or 'auto' (adapt_k)")] = "auto",
    k_max: Annotated[int, typer.Option(help="largest K under 'auto'")] = 8,
    drafter: Annotated[str, typer.Option(help="lookup | draft | both")] = "both",
    draft_model: Annotated[str, typer.Option(
        help="a 1-stage export to draft with (default: the model itself as 1 stage, or "
             "--draft-layers)")] = "",
    draft_layers: Annotated[int, typer.Option(
        help="draft with the model's first N layers (exported once); 0: the whole model")] = 0,
    draft_k: Annotated[str, typer.Option(
        help="draft length for the draft model (int or 'auto')")] = "4",
    runs: Runs = 3,
    rewind_reps: Annotated[int, typer.Option(help="timed mask/trim rewinds per stage")] = 100,
    precision: Precision = "f32",
    threads: Threads = 0,
    kv_cache_precision: Annotated[str, typer.Option(
        help="KV_CACHE_PRECISION, or 'default' (the CPU plugin's u8: multi-token verify steps "
             "then round differently from 1-token steps, and near-ties can flip)")] = "f32",
    dynamic_quantization: Annotated[bool, typer.Option(
        help="let the CPU plugin quantize activations to int8 dynamically (its default on "
             "AVX-512-VNNI/AMX CPUs, ~40% faster there): verify steps then round differently "
             "from 1-token steps, and near-ties can flip")] = False,
    stop_at_eos: Annotated[bool, typer.Option(help="stop a generation at the model's EOS")] = True,
    as_json: Json = False,
) -> None:
    from zctl.engine.tokenizer import ChatTokenizer

    if drafter not in ("lookup", "draft", "both"):
        fail("--drafter must be lookup, draft or both")
    names = list(DRAFTERS) if drafter == "both" else [drafter]
    bench_model = BenchModel.resolve(model)
    target_dir = bench_model.export(stages, weights)
    config = runtime_config(precision, threads, kv_cache_precision, dynamic_quantization)
    chain = LocalChain.load(str(target_dir), config, rewind="mask")
    draft_runner, draft_desc = (load_draft(draft_export(bench_model, weights, draft_model,
                                                        draft_layers), config)
                                if "draft" in names else (None, None))
    tok = ChatTokenizer(target_dir)
    prompts = [(p, tok.encode(p.text)) for p in PROMPTS]
    eos = tok.eos_token_id
    result = run_bench(chain, prompts, tokens, drafters=names, draft_runner=draft_runner,
                       k=parse_k(k), k_max=k_max, draft_k=parse_k(draft_k), runs=runs,
                       stop_ids=[eos] if stop_at_eos and eos is not None else [],
                       rewind_reps=rewind_reps, progress=lambda s: err.print(s, highlight=False))
    result = {"model": model, "weights": weights, "target": str(target_dir),
              "properties": config.properties(), "draft_model": draft_desc, **result}
    if draft_desc is not None and draft_desc["layers"] >= chain.runners[-1].manifest.model.num_layers:
        result["note"] = SELF_DRAFT_NOTE
    if as_json:
        print(json.dumps(result))
        return
    render(result, names)


if __name__ == "__main__":
    typer.run(main)
