"""The ``zctl`` command line: export, verify, benchmarks, the cluster and generation."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from exporter.balance import default_split
from zctl.cli.exports import AUTO, WEIGHTS_HELP, default_export_dir, quiet_ml_libraries, resolve_weights

app = typer.Typer(help="zctl: distributed LLM inference over OpenVINO stage shards.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
bench_app = typer.Typer(help="Benchmarks (ratios against a baseline measured in the same run).",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")

err = Console(stderr=True)
out = Console()


def fail(message: str, code: int = 1) -> NoReturn:
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True, highlight=False)
    raise typer.Exit(code)


@app.command()
def export(
    model: Annotated[str, typer.Argument(help="smollm2-135m, a .gguf file, an HF dir or hub id")] = (
        "smollm2-135m"
    ),
    stages: Annotated[int | None, typer.Option(
        help="split into N stages of about equal compute (the last one also runs the LM "
             "head, so it gets fewer layers)")] = None,
    layers: Annotated[str | None, typer.Option(help="explicit inclusive ranges, e.g. 0-14,15-29")] = None,
    weights: Annotated[str, typer.Option(help=WEIGHTS_HELP)] = AUTO,
    group_size: Annotated[int | None, typer.Option(help="INT4 group size (default: fits the model)")] = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="output directory")] = None,
    beam_idx: Annotated[
        bool, typer.Option("--beam-idx/--no-beam-idx", help="inject the beam_idx Gather")
    ] = True,
    force: Annotated[bool, typer.Option(help="replace an existing output directory")] = False,
    static: Annotated[bool, typer.Option(
        "--static", help="static, stateless shards for the NPU: past KV in, new KV out, the "
                         "host keeps the KV (no beam_idx)")] = False,
    context: Annotated[int, typer.Option(help="--static: KV slots per stream")] = 1024,
    chunk: Annotated[int, typer.Option(
        help="--static: tokens per multi-token step shape (prefill chunks, verification)")] = 16,
    kv_dtype: Annotated[str, typer.Option(
        help="--static: the host KV's type, f32 | f16 (half the memory; an NPU computes in "
             "f16)")] = "f32",
    exact_experts: Annotated[bool, typer.Option(
        "--exact-experts", help="keep a mixture of experts' MXFP4 weights (gpt-oss's) "
                                "exactly, as i8 codes with power-of-two scales per 32, where "
                                "--weights would round them again: about 1.06 bytes a weight "
                                "against INT4's 0.54, and faster on the CPU")] = False,
) -> None:
    """Cut a model into stage shards (OpenVINO IR with stateful KV) and write a manifest."""
    from exporter.export import ExportError, export_model
    from exporter.sources import SourceError, open_source
    from zctl.cli.export_view import RichExportProgress
    from zctl.manifest import ManifestError, StaticKV, parse_layer_spec

    if stages is not None and layers is not None:
        fail("give --stages or --layers, not both")
    quiet_ml_libraries()
    weights = resolve_weights(model, weights)
    try:
        from zctl.paths import source_cache_dir

        source = open_source(model, source_cache_dir())
        ranges = (parse_layer_spec(layers) if layers
                  else default_split(source, stages or 1))
        static_kv = StaticKV(context, chunk, kv_dtype) if static else None
        target = out_dir or default_export_dir(model, len(ranges), weights, static,
                                                exact_experts)
        with RichExportProgress(len(ranges), err) as progress:
            manifest, reports = export_model(source, ranges, weights, target, group_size=group_size,
                                             beam_idx=beam_idx, force=force, progress=progress,
                                             static_kv=static_kv, exact_experts=exact_experts)
    except (SourceError, ManifestError, ExportError, ValueError) as exc:
        fail(str(exc))
    total = sum(sum(r.timings.values()) for r in reports)
    experts = ", exact experts" if manifest.exact_experts else ""
    out.print(f"exported {manifest.model.name} ({manifest.weight_format}{experts}) in "
              f"{len(manifest.stages)} stages to {target} in {total:.1f}s")


@app.command()
def verify(
    export_dir: Annotated[Path, typer.Argument(help="an export directory")],
    max_new_tokens: Annotated[int, typer.Option(help="greedy tokens per prompt")] = 64,
    model: Annotated[str | None, typer.Option(help="reference model (default: the export's source)")] = None,
    prompt: Annotated[list[str] | None, typer.Option(help="prompt(s) to check (repeatable)")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="no chat template")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Check the stage chain (f32) against Hugging Face greedy decoding, token for token."""
    from exporter.sources import SourceError
    from exporter.verify import DEFAULT_PROMPTS, verify_export
    from zctl.manifest import ManifestError

    quiet_ml_libraries()
    try:
        from zctl.paths import source_cache_dir

        results = verify_export(export_dir, prompt or DEFAULT_PROMPTS, max_new_tokens, model,
                                chat=not raw, cache_dir=source_cache_dir())
    except (ManifestError, SourceError, ValueError) as exc:
        fail(str(exc))
    exact = sum(r.exact for r in results)
    if as_json:
        print(json.dumps({
            "export_dir": str(export_dir), "exact": exact, "prompts": len(results),
            "results": [{"prompt": r.prompt, "matched": r.matched, "total": len(r.reference),
                         "exact": r.exact} for r in results],
        }))
    else:
        table = Table(title=f"zctl verify {export_dir}")
        table.add_column("prompt")
        table.add_column("agreeing tokens", justify="right")
        table.add_column("exact")
        for r in results:
            table.add_row(r.prompt[:50], f"{r.matched}/{len(r.reference)}",
                          "[green]yes[/]" if r.exact else "[red]NO[/]")
        out.print(table)
        out.print(f"{exact}/{len(results)} prompts token-exact")
    if exact != len(results):
        raise typer.Exit(1)


# ``zctl bench NAME`` runs ``python -m tools.<module>`` (e.g. tools/decode/parity.py). tools/
# is part of the source checkout, not of the installed product, so a benchmark is imported
# only when its command runs; the one-line summaries here are the first lines of the
# modules' docstrings.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "parity": ("decode.parity", "Decode-throughput parity: our stage shards against the "
                                "monolithic model users would pick."),
    "cluster": ("decode.cluster", "One-stream throughput of a local multi-node cluster "
                                  "against the monolithic baseline."),
    "spec": ("spec.speedup", "Speculative decoding (paper §5-6): acceptance, speedup against "
                             "its theory, rewind cost."),
    "pipespec": ("spec.pipelined", "Pipelined speculation against plain greedy, today's "
                                   "speculation and openvino_genai on one core."),
    "draft-ceiling": ("spec.draft_ceiling", "Prompt lookup's ceiling behind slow hops: the "
                                            "tokens a round trip yields, one guess or many."),
    "microbatch": ("decode.microbatch", "Micro-batching: aggregate decode throughput of 1, 2, "
                                        "4 concurrent streams on a local cluster."),
    "moe": ("moe.bench", "Mixture of experts against openvino_genai: decode tok/s of a "
                         "Qwen3-30B-A3B-shaped MoE."),
    "static": ("decode.static", "The static NPU path's cost: static, stateless shards (KV on "
                                "the host) against the stateful ones."),
    "quality": ("decode.quality", "Each weight format against the fp32 Hugging Face model: "
                                  "top-1 agreement, perplexity, speed."),
    "serve": ("serving.serve", "Serving: zctl serve under 1-16 concurrent clients against "
                               "openvino_genai's ContinuousBatchingPipeline."),
    "structured": ("serving.structured", "Structured output against free text: what holding "
                                         "the output to a JSON Schema costs."),
    "scoring": ("serving.scoring", "Scoring a prompt (echo, logprobs) against the fp32 model: "
                                   "perplexity, top-1, cost over prefill."),
    "prefill": ("serving.prefill", "Long prompts: TTFT cold and on a follow-up turn, decode at "
                                   "context, streams under a long prefill."),
    "repeatable": ("repeatable", "Repeatability: the same greedy request's tokens cold and "
                                 "cached, batched, speculative, healed."),
    "plan": ("plan", "Predicted against measured tok/s: each case predicted from its nodes' "
                     "profiles, then run."),
    "fleet": ("fleet", "A fleet that gains a slower node, and one of unequal nodes: planned "
                       "against controls."),
    "peers": ("peers.cli", "zctl against llama.cpp's RPC backend and llama-server on the same "
                           "PCs, side by side."),
    "chaos": ("robustness.chaos", "Chaos: faults mid-generation (kill, hang, link down, "
                                  "flapping, slow link, heal), and how each is survived."),
    "fuzz": ("robustness.fuzz", "Live fuzzing: hostile messages to every socket a running "
                                "local cluster listens on."),
    "soak": ("robustness.soak", "Soak: streams through the OpenAI API for minutes; memory of "
                                "every process, leaks, bounded queues."),
    "experiment": ("wan", "Scripted WAN experiments: `run FILE` measures a scenario's grid on "
                          "local clusters into CSV and plots."),
}


def run_benchmark(module: str, args: list[str]) -> NoReturn:
    """Become ``python -m tools.<module> ARGS``: the benchmark replaces this process (so
    nothing is left behind when it is signalled), run from the checkout zctl was installed
    from (an editable install) or the one the current directory is in, with that checkout
    on the child's PYTHONPATH. Without tools/ (an installed zctl outside a source
    checkout), one error line and exit 1."""
    checkout = _checkout_with_tools()
    if checkout is None:
        fail(f"benchmarks run from a source checkout: tools/ is not installed with zctl; run "
             f"`zctl bench` (or `python -m tools.{module}`) in a clone of the zctl repository")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout), env.get("PYTHONPATH")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", f"tools.{module}", *args], env)


def _checkout_with_tools() -> Path | None:
    """The source checkout holding tools/: where this package lives (an editable install),
    or the current directory."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (root / "tools" / "__init__.py").is_file() and (root / "zctl").is_dir():
            return root
    return None


def _bench_command(name: str, module: str, summary: str, parent: typer.Typer = bench_app) -> None:
    """Register ``zctl bench NAME`` (or NAME under ``parent``): every argument, --help
    included, goes to the benchmark's own command line."""

    def command(ctx: typer.Context) -> None:
        run_benchmark(module, list(ctx.args))

    parent.command(name, help=summary, add_help_option=False, context_settings={
        "allow_extra_args": True, "ignore_unknown_options": True})(command)


def _register() -> None:
    from zctl.cli import cluster as cluster_cli
    from zctl.cli import discovery, doctor, node_profile, pairing
    from zctl.cli import plan as plan_cli
    from zctl.cli import run as run_cli
    from zctl.cli import serve as serve_cli

    for name, (module, summary) in BENCHMARKS.items():
        _bench_command(name, module, summary)
    _bench_command("experiment", *BENCHMARKS["experiment"], parent=app)  # zctl experiment run
    cluster_cli.cluster_app.command("ls")(discovery.cluster_ls)
    cluster_cli.cluster_app.command("pair")(pairing.cluster_pair)
    app.add_typer(cluster_cli.cluster_app, name="cluster")
    cluster_cli.node_app.command("profile")(node_profile.profile_command)
    app.add_typer(cluster_cli.node_app, name="node")
    app.command("run")(run_cli.run)
    app.command("doctor")(doctor.doctor)
    app.command("serve")(serve_cli.serve)
    app.command("plan")(plan_cli.plan_command)


_register()


def main() -> None:  # pragma: no cover
    sys.exit(app())
