"""``zctl run``: stream generations through the running cluster (or an embedded local one)
with a live per-stage dashboard, or print one JSON report."""

from __future__ import annotations

import json
import time
import uuid
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.live import Live

from controlplane.records import PredictionStatus
from zctl.cli.cluster import (
    DynamicQuantization,
    Exact,
    KvPrecision,
    Precision,
    _fail,
    _running_record,
    err,
    numerics,
    out,
)
from zctl.cli.dashboard import RunSnapshot, StageInfo, StreamView, render_run
from zctl.cli.exports import AUTO, WEIGHTS_HELP, ensure_export
from zctl.cli.signals import ends_as_on_ctrl_c
from zctl.engine.requests import GenerationRequest, Sampling
from zctl.launcher.embedded import EmbeddedCluster
from zctl.launcher.processes import runtime_spec
from zctl.launcher.record import ClusterError, ClusterRecord


def _stages_from_status(status: Any) -> list[StageInfo]:
    """The dashboard's stages: each one's host, layers and device, as the web page's cluster
    view shows them (zctl.service.cluster_view.stage_rows)."""
    from zctl.service.cluster_view import stage_rows

    return [StageInfo(row.index, row.host or "-", row.layers, row.device or "?")
            for row in stage_rows(status)]


def _stage_breakdown(stages: list[StageInfo], timing: dict[str, dict[str, float]]) -> list[dict]:
    rows = []
    for info in stages:
        i = info.index
        hop = f"hop{i}-{i + 1}"
        rows.append({"stage": i, "node": info.node, "layers": info.layers, "device": info.device,
                     **{f"{k}_ms": timing.get(name, {})
                        for k, name in [("compute", f"stage{i}.compute"), ("queue", f"{hop}.queue"),
                                        ("serialise", f"{hop}.serialise"),
                                        ("network", f"{hop}.network")]}})
    return rows


def parse_k(value: str) -> int:
    """``--k``: 'auto' (0: adaptive) or a draft length 1..MAX_DRAFT_TOKENS."""
    from zctl.engine.requests import MAX_DRAFT_TOKENS

    if value == "auto":
        return 0
    if not value.isdigit() or not 1 <= int(value) <= MAX_DRAFT_TOKENS:
        raise ValueError(f"--k must be 'auto' or a draft length 1..{MAX_DRAFT_TOKENS}, not {value!r}")
    return int(value)


def parse_speculative(value: str) -> str:
    """``--speculative``: '' (off), 'lookup', 'pipelined', or 'draft:PATH' with PATH made
    absolute (the coordinator loads it, possibly from another working directory)."""
    if value in ("", "off", "none"):
        return ""
    if value in ("lookup", "pipelined"):
        return value
    if value.startswith("draft:") and len(value) > 6:
        path = Path(value.removeprefix("draft:")).expanduser()
        if not path.is_dir():
            raise ValueError(f"draft model {path} is not a directory (export one with "
                             "zctl export MODEL --stages 1 --out DIR)")
        return f"draft:{path.resolve()}"
    raise ValueError(f"--speculative must be 'lookup', 'pipelined' or 'draft:PATH', not "
                     f"{value!r}")


def check_sampling(temperature: float | None, top_k: int | None, top_p: float | None,
                   seed: int | None, presence_penalty: float = 0.0,
                   frequency_penalty: float = 0.0, repetition_penalty: float | None = None,
                   min_p: float | None = None) -> dict[str, Any]:
    """The sampling options (None: the model's default), validated here so a bad one fails
    before a cluster starts (ValueError with the reason, as the engine gives it)."""
    fields = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
              "seed": seed, "presence_penalty": presence_penalty,
              "frequency_penalty": frequency_penalty, "repetition_penalty": repetition_penalty}
    problem = GenerationRequest("options", "-", **fields).problem()
    if problem is not None:
        raise ValueError(problem)
    return fields


def output_grammar(json_schema: str | None, regex: str | None, grammar: Path | None
                   ) -> dict[str, str]:
    """The request's grammar fields for ``--json-schema`` (a file, or ``object``: any JSON
    object), ``--regex`` or ``--grammar`` (a Lark or GBNF file), read and checked before a
    cluster starts (the coordinator compiles them: zctl.engine.constraints)."""
    given = [o for o, v in (("--json-schema", json_schema), ("--regex", regex),
                            ("--grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"give one of {', '.join(given)}")
    if json_schema is not None:
        text = '{"type": "object"}' if json_schema == "object" else Path(json_schema).read_text()
        try:
            json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--json-schema {json_schema} is not JSON: {exc}") from None
        return {"grammar_kind": "json_schema", "grammar": text}
    if regex is not None:
        return {"grammar_kind": "regex", "grammar": regex}
    if grammar is not None:
        return {"grammar_kind": "grammar", "grammar": grammar.read_text()}
    return {}


def sampling_report(req: GenerationRequest, used: Sampling | None) -> dict[str, Any] | None:
    """The sampling the run used (``used``: the engine's word; None: it did not say):
    greedy (temperature 0) or the sampling values and seed; the penalties; where the
    model's defaults came from (``defaults``: its generation config, or llama-server's)
    and which options the run gave itself (``given``), the rest being those defaults."""
    if used is None:
        return None
    own = {"temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p,
           "min_p": req.min_p, "repetition_penalty": req.repetition_penalty}
    drawn = {} if used.temperature == 0 else {
        "top_k": used.top_k, "top_p": used.top_p, "min_p": used.min_p, "seed": req.seed}
    return {"temperature": used.temperature, **drawn,
            "repetition_penalty": used.repetition_penalty,
            "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
            "defaults": used.defaults, "given": [name for name, v in own.items() if v is not None]}


def stream_run(record: ClusterRecord, prompts: list[str], max_tokens: int, chat: bool,
               as_json: bool, ignore_eos: bool = False, speculative: str = "",
               k: int = 0, sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """Send the prompts to the generation service (run concurrently, one stream each);
    live dashboard unless --json. Returns the run's report."""
    from controlplane.client import ClusterUnreachable, query_status
    from zctl.engine.requests import GenerationDone, GenerationRequest
    from zctl.launcher.record import control_curve
    from zctl.service.client import generate_many

    status = query_status(record.control, curve=control_curve(record))
    if speculative and not status.runtime.exact and not status.runtime.paged_attention:
        err.print("[yellow]note:[/] this cluster's stages keep their KV outside "
                  "PagedAttention and run fast numerics (a quantised KV cache or int8 "
                  "activations): speculative output can differ from greedy at near-tied "
                  "tokens; zctl cluster up --exact makes it identical", soft_wrap=True)
    sampling = sampling or {}
    seed = sampling.pop("seed", None)
    requests = [GenerationRequest(uuid.uuid4().hex[:16], p, max_tokens, chat, ignore_eos,
                                speculative, k, **sampling,
                                seed=None if seed is None else seed + i)  # streams differ
                for i, p in enumerate(prompts)]
    index = {r.request_id: i for i, r in enumerate(requests)}
    snapshot = RunSnapshot(_stages_from_status(status), [StreamView(p) for p in prompts])
    dones: dict[int, GenerationDone] = {}
    first_at: dict[int, float] = {}
    start = time.monotonic()
    live = None if as_json else Live(render_run(snapshot), console=out, refresh_per_second=8)
    try:
        if live is not None:
            live.start()
        # closing() ends the stream here on Ctrl-C: its generations are cancelled at once
        with closing(generate_many(record.serve, requests)) as messages:
            for msg in messages:
                i = index[msg.request_id]
                now = time.monotonic()
                first_at.setdefault(i, now)
                apply_message(snapshot, i, msg)
                if isinstance(msg, GenerationDone):
                    dones[i] = msg
                after_first = sum(max(v.tokens - 1, 0) for v in snapshot.streams)
                if len(prompts) > 1 and now > min(first_at.values()):
                    snapshot.aggregate_tok_s = after_first / (now - min(first_at.values()))
                if live is not None:
                    live.update(render_run(snapshot))
    finally:
        if live is not None:
            live.stop()
            if not out.is_terminal:  # Live ends a redirected dashboard without a newline
                out.line()
    errors = [d.error for d in dones.values() if d.error]
    if errors:
        raise ClusterError(errors[0])
    end = time.monotonic()
    report = run_report(snapshot, [dones[i] for i in range(len(prompts))], requests[0],
                        end - start, end - min(first_at.values(), default=start), speculative, k)
    try:  # the prediction as of now: profiles and links measured during the run count
        status = query_status(record.control, curve=control_curve(record))
    except ClusterUnreachable:
        pass
    measured = report["tok_s"] if len(prompts) == 1 else report["aggregate_tok_s"]
    report["prediction"] = prediction_report(status.prediction, len(prompts), measured)
    return report


def prediction_report(prediction: PredictionStatus | None, streams: int,
                      measured: float) -> dict[str, Any]:
    """The run's decode tok/s (one stream's, or all ``streams``' together) against what the
    cluster predicts for its placement: the relative error is (predicted - measured) /
    measured; ``no_prediction`` says why there is none."""
    from controlplane.planner.running import NoPrediction, relative_error, streams_prediction

    out: dict[str, Any] = {"streams": streams, "measured_tok_s": round(measured, 2)}
    try:
        if prediction is None:
            raise NoPrediction("the coordinator made none")
        predicted = streams_prediction(prediction, streams)
    except NoPrediction as exc:
        return {**out, "predicted_tok_s": None, "relative_error": None,
                "no_prediction": str(exc)}
    error = relative_error(predicted.tok_s, measured) if measured > 0 else None
    return {**out, "predicted_tok_s": round(predicted.tok_s, 2),
            "relative_error": None if error is None else round(error, 4),
            "row_groups": predicted.row_groups}


def apply_message(snapshot: RunSnapshot, i: int, msg: Any) -> None:
    """Show stream ``i``'s chunk or done in the dashboard's snapshot."""
    from zctl.engine.requests import GenerationDone

    view = snapshot.streams[i]
    view.ttft_ms, view.tok_s, view.spec = msg.ttft_ms, msg.tok_s, msg.spec
    snapshot.timing = msg.timing or snapshot.timing
    if isinstance(msg, GenerationDone):
        view.text, view.tokens = msg.text, len(msg.tokens)
        view.status = "error" if msg.error else f"done ({msg.stop_reason})"
        return
    view.text += msg.text
    view.tokens = msg.produced
    if msg.note:
        view.status = msg.note
        view.notes.append(msg.note)


def run_report(snapshot: RunSnapshot, dones: list[Any], first: Any, wall_s: float,
               since_first: float, speculative: str, k: int) -> dict[str, Any]:
    """The run's report (``--json``): each stream's figures, the stages' breakdown and the
    suggested split; one stream's figures at the top level."""
    from exporter.balance import suggest_layers

    streams = [{"tokens": len(d.tokens), "text": d.text, "ttft_ms": round(d.ttft_ms, 2),
                "tok_s": round(d.tok_s, 2), "prompt_tokens": d.prompt_tokens,
                "stop_reason": d.stop_reason, "spec": d.spec,
                "notes": snapshot.streams[i].notes} for i, d in enumerate(dones)]
    last = dones[-1].timing if len(dones) == 1 else snapshot.timing
    report: dict[str, Any] = {
        "streams": streams, "wall_s": round(wall_s, 3),
        "aggregate_tok_s": round(sum(max(s["tokens"] - 1, 0) for s in streams)
                                 / max(since_first, 1e-9), 2),
        "stages": _stage_breakdown(snapshot.stages, last),
        "suggested_layers": suggest_layers(
            [info.layers for info in snapshot.stages],
            [last.get(f"stage{info.index}.compute", {}).get("p50", 0.0) for info in snapshot.stages]),
        "overhead_ms": last.get("overhead", {}), "step_ms": last.get("total", {}),
        "speculative": speculative, "k": k or "auto",
        "sampling": sampling_report(first, dones[0].sampling),
        "grammar": first.grammar_kind or None}
    if len(streams) == 1:
        return {**streams[0], **report}
    report["tokens"] = sum(s["tokens"] for s in streams)
    return report


EmbeddedNodes = Annotated[int, typer.Option(
    help="processes of the embedded cluster (1: this PC runs every stage in one process)")]


def check_nodes(nodes: int, stages: int | None = None) -> None:
    """``--nodes`` and ``--stages``: ValueError unless at least one of each."""
    if nodes < 1:
        raise ValueError(f"--nodes must be >= 1 (the processes of the embedded cluster), not {nodes}")
    if stages is not None and stages < 1:
        raise ValueError(f"--stages must be >= 1, not {stages}")


def embedded_note(nodes: int) -> str:
    """What a command says as it starts an embedded cluster of ``nodes`` processes."""
    processes = "one process" if nodes == 1 else f"{nodes} processes"
    return (f"no cluster is up: starting an embedded local cluster of {processes} (it stops "
            "with this command)")


@ends_as_on_ctrl_c
def run(
    prompts: Annotated[list[str], typer.Argument(help="what to ask (several: one stream each)")],
    max_tokens: Annotated[int, typer.Option(help="new tokens at most, per stream")] = 128,
    chat: Annotated[bool, typer.Option("--chat/--raw", help="apply the chat template")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object, no dashboard")] = False,
    streams: Annotated[int, typer.Option(
        help="concurrent streams (the prompts are repeated to fill them); 0: one per prompt")] = 0,
    speculative: Annotated[str, typer.Option(
        help="speculative decoding: 'lookup' (prompt n-grams), 'pipelined' (prompt-n-gram "
             "guesses keep every stage busy for one stream) or 'draft:PATH' (a 1-stage export "
             "sharing the tokenizer); greedy output (--temperature 0) stays identical on "
             "paged stages (the default on CPUs) or with exact numerics")] = "",
    k: Annotated[str, typer.Option("--k", help="draft tokens per step, or 'auto'")] = "auto",
    temperature: Annotated[float | None, typer.Option(
        help="0: greedy; > 0 samples (speculation then keeps the model's distribution). "
             "Default: the model's (its generation config), else 0.8 as llama-server's",
        show_default=False)] = None,
    top_k: Annotated[int | None, typer.Option(
        help="sample among the k most likely tokens (0: all). Default: the model's, else 40",
        show_default=False)] = None,
    top_p: Annotated[float | None, typer.Option(
        help="nucleus sampling mass (1: all). Default: the model's, else 0.95",
        show_default=False)] = None,
    min_p: Annotated[float | None, typer.Option(
        help="keep the tokens at least this fraction as likely as the most likely (0: all). "
             "Default: the model's, else 0.05", show_default=False)] = None,
    seed: Annotated[int | None, typer.Option(
        help="sampling seed: a run with one repeats (stream i uses seed + i); without, runs "
             "vary")] = None,
    presence_penalty: Annotated[float, typer.Option(
        help="-2..2, taken off the logit of every token generated so far (greedy too)")] = 0.0,
    frequency_penalty: Annotated[float, typer.Option(
        help="-2..2, taken off a token's logit once per time it was generated")] = 0.0,
    repetition_penalty: Annotated[float | None, typer.Option(
        help="(0, 2]: the logit of every token of the prompt or output so far divided by it "
             "(multiplied when negative); 1: none. Default: the model's, else 1",
        show_default=False)] = None,
    model: Annotated[str, typer.Option(help="model for the embedded cluster")] = "smollm2-135m",
    stages: Annotated[int | None, typer.Option(
        help="stages of the export made for a model name (default: --nodes; an export "
             "directory has its own)", show_default=False)] = None,
    nodes: EmbeddedNodes = 1,
    weights: Annotated[str, typer.Option(help=WEIGHTS_HELP)] = AUTO,
    precision: Precision = "f32",
    exact: Exact = None,
    kv_cache_precision: KvPrecision = None,
    dynamic_quantization: DynamicQuantization = None,
    ignore_eos: Annotated[bool, typer.Option(help="always produce max-tokens tokens")] = False,
    json_schema: Annotated[str | None, typer.Option(
        help="hold the output to this JSON Schema (a file; 'object': any JSON object)")] = None,
    regex: Annotated[str | None, typer.Option(
        help="hold the output to this regular expression")] = None,
    grammar: Annotated[Path | None, typer.Option(
        help="hold the output to this grammar (a Lark or GBNF file)")] = None,
) -> None:
    """Stream a generation through the running cluster (or an embedded local one)."""
    embedded = ExitStack()  # the embedded cluster's lifetime, when this command starts one
    try:
        draft_k, mode = parse_k(k), parse_speculative(speculative)
        sampling = check_sampling(temperature, top_k, top_p, seed, presence_penalty,
                                  frequency_penalty, repetition_penalty, min_p)
        sampling.update(output_grammar(json_schema, regex, grammar))
        if streams < 0:
            raise ValueError(f"--streams must be >= 0, not {streams}")
        check_nodes(nodes, stages)
        wanted = streams or len(prompts)
        prompts = [prompts[i % len(prompts)] for i in range(wanted)]
        record = _running_record()
        told = exact is not None or kv_cache_precision is not None or dynamic_quantization is not None
        if record is not None and told:
            err.print("[yellow]note:[/] --exact/--fast, --kv-cache-precision and "
                      "--dynamic-quantization shape an embedded cluster; the running one keeps "
                      "its own (zctl cluster status)", soft_wrap=True)
        if record is None:
            # the cluster is this command's own: paged stages, whose speculative output
            # equals greedy token for token under the default numerics too
            kv, dq = numerics(exact if told else None,
                              kv_cache_precision, dynamic_quantization)
            rt = runtime_spec(None if precision == "default" else precision, None, "CPU", kv, dq)
            export_dir = ensure_export(model, stages or nodes, weights)
            err.print(embedded_note(nodes), soft_wrap=True)
            record = embedded.enter_context(EmbeddedCluster(export_dir, nodes, rt))
        result = stream_run(record, prompts, max_tokens, chat, as_json, ignore_eos, mode, draft_k,
                            sampling)
    except (ClusterError, ValueError, OSError) as exc:
        _fail(str(exc))
    except RuntimeError as exc:  # ClusterUnreachable and data-plane errors
        _fail(str(exc))
    finally:
        embedded.close()
    if as_json:
        print(json.dumps(result))
