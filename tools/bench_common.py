"""What the benchmarks share: their models and cached exports, the greedy reference loop
stepped token by token, paired estimators, a request through a cluster, openvino_genai's
greedy settings, the refusals of bad options, and the Typer options that recur.

Every tool in tools/ imports these from here, so a fix lands once. Imports that cost time
(the exporter, the control plane, openvino_genai) happen inside the functions that need
them: ``--help`` of a benchmark stays quick.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

# One free-port helper for the repository (the local cluster's): tools may import console.
from zctl.launcher.local import free_port as free_port

if TYPE_CHECKING:
    from zctl.engine.executor import Executor
    from zctl.engine.requests import GenerationDone, GenerationRequest
    from zctl.engine.stats import GenerationStats
    from zctl.manifest import StaticKV

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
MODEL_HELP = "smollm2-135m, random-1b, random-tiny, or an HF directory"
RANDOM_MODELS = {"random-1b": "llama-3.2-1b", "random-tiny": "tiny"}  # name -> SHAPES key
err = Console(stderr=True)

# -- the Typer options that recur (each benchmark gives its own default) -----------------

Model = Annotated[str, typer.Option(help=MODEL_HELP)]
Weights = Annotated[str, typer.Option(help="int4 | int8 | fp16 | fp32")]
Precision = Annotated[str, typer.Option(
    help="INFERENCE_PRECISION_HINT (on both sides where a baseline runs), or 'default'")]
Threads = Annotated[int, typer.Option(
    help="INFERENCE_NUM_THREADS per stage (and baseline) (0: the plugin's default)")]
Tokens = Annotated[int, typer.Option(help="new tokens per run")]
Runs = Annotated[int, typer.Option(help="interleaved runs (the median is reported)")]
Nodes = Annotated[int, typer.Option(help="cluster nodes (= stages)")]
CpuSets = Annotated[str, typer.Option(
    help="shared: every stage may use every core | split: each node its own cores (as "
         "separate PCs)")]
Json = Annotated[bool, typer.Option("--json", help="print one JSON object")]


# -- numbers and refusals ------------------------------------------------------------------


def median(values: Sequence[float], empty: float = 0.0) -> float:
    """The median of ``values`` as a float; ``empty`` when there are none."""
    return float(statistics.median(values)) if len(values) else empty


def paired_ratio(values: Sequence[float], bases: Sequence[float]) -> float:
    """The median over runs of value / base, each pair measured moments apart."""
    return round(statistics.median(v / b for v, b in zip(values, bases, strict=True)), 3)


def fail(message: str) -> NoReturn:
    """Refuse a benchmark's options: Typer prints the usage and ``message``, exit 2."""
    raise typer.BadParameter(message)


def parse_k(value: str) -> int | None:
    """'auto' -> None, else a non-negative int."""
    if value.strip().lower() == "auto":
        return None
    k = int(value)
    if k < 0:
        fail(f"K must be >= 0 or 'auto', got {value}")
    return k


def parse_numbers(text: str, option: str, what: str, kind: type = int,
                  minimum: float = 1) -> list[Any]:
    """Comma-separated numbers of ``kind``, at least one and none below ``minimum``;
    ``option`` and ``what`` name them in the refusal."""
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        fail(f"{option} takes comma-separated {what}, got {text!r}")
    if not values or min(values) < minimum:
        fail(f"{option} needs {what} >= {minimum:g}, got {text!r}")
    return values


# -- models and their cached exports -------------------------------------------------------


def model_hf_dir(model: str, cache: Path) -> Path:
    """An HF directory for the model (the default GGUF dequantised; random-1b and
    random-tiny generated)."""
    from exporter.sources import DEFAULT_MODEL, default_model_hf_dir

    if model == DEFAULT_MODEL:
        return default_model_hf_dir(cache / "sources")
    if model in RANDOM_MODELS:
        from tools.random_llama import write_random_llama

        shape = RANDOM_MODELS[model]
        path = cache / "sources" / f"random-llama-{shape}"
        if not (path / "config.json").is_file():
            err.print(f"writing a random Llama checkpoint of shape {shape} ...")
            write_random_llama(path, shape)
        return path
    return Path(model)


def export_name(model: str, hf_dir: Path) -> str:
    """The export cache's name for ``model``: a known model's short name, else its HF
    directory's name."""
    return model if model == "smollm2-135m" or model in RANDOM_MODELS else hf_dir.name


def cached_export(hf_dir: Path, name: str, stages: int, weights: str, beam_idx: bool,
                  cache: Path, layers: str = "", static_kv: StaticKV | None = None) -> Path:
    """Export once per (model, stages or layer split, weights, beam_idx, static KV); reuse
    while the manifest verifies. ``layers`` ("0-16,17-29") overrides ``stages``'
    cost-balanced split (the one ``zctl export --stages`` makes)."""
    from exporter.balance import default_split
    from exporter.export import export_model
    from exporter.sources import open_source
    from zctl.cli.export_view import RichExportProgress
    from zctl.manifest import ManifestError, load_manifest, parse_layer_spec

    split = f"L{layers.replace(',', '_')}" if layers else f"{stages}stages"
    kind = ("" if beam_idx else "-nobeam") + (
        f"-static{static_kv.context}x{static_kv.chunk}" if static_kv else "") + (
        "-f16" if static_kv and static_kv.kv_dtype == "f16" else "")
    out = cache / "exports" / "bench" / f"{name}-{weights}-{split}{kind}"
    try:
        load_manifest(out)
        return out
    except ManifestError:
        pass
    source = open_source(str(hf_dir))
    ranges = parse_layer_spec(layers) if layers else default_split(source, stages)
    with RichExportProgress(stages, err) as progress:
        export_model(source, ranges, weights, out, beam_idx=beam_idx, force=True, progress=progress,
                     static_kv=static_kv)
    return out


@dataclass(frozen=True)
class BenchModel:
    """A benchmark's model: its HF directory, its exports' name and the cache they live in."""

    name: str
    hf_dir: Path
    cache: Path

    @classmethod
    def resolve(cls, model: str, cache: Path | None = None) -> BenchModel:
        """``model`` (smollm2-135m, random-1b, an HF directory) under ``cache`` (ZCTL_HOME)."""
        from zctl.paths import zctl_home

        cache = zctl_home() if cache is None else cache
        hf_dir = model_hf_dir(model, cache)
        return cls(export_name(model, hf_dir), hf_dir, cache)

    def export(self, stages: int, weights: str, *, beam_idx: bool = True, layers: str = "",
               static_kv: StaticKV | None = None) -> Path:
        """The cached export in ``stages`` cost-balanced stages (or ``layers``)."""
        return cached_export(self.hf_dir, self.name, stages, weights, beam_idx, self.cache,
                             layers, static_kv)


def export_or_cached(model: str, stages: int, weights: str) -> Path:
    """``model`` as it is when it is an export directory (it holds a manifest.json), else
    its cached export in ``stages`` stages (``model_export``)."""
    path = Path(model).expanduser()
    if (path / "manifest.json").is_file():
        return path
    return model_export(model, stages, weights)


def model_export(model: str, stages: int, weights: str) -> Path:
    """The cached export of ``model`` in ``stages`` cost-balanced stages (with beam_idx),
    made on first use."""
    return BenchModel.resolve(model).export(stages, weights)


def plugin_properties(precision: str, threads: int) -> dict[str, Any]:
    """The OpenVINO plugin hints both sides of a comparison get."""
    props: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY"}
    if precision != "default":
        props["INFERENCE_PRECISION_HINT"] = precision
    if threads:
        props["INFERENCE_NUM_THREADS"] = threads
    return props


# -- the greedy reference loop ---------------------------------------------------------------


def start_stream(chain: Executor, stream: int, prompt_ids: Sequence[int]) -> tuple[int, int]:
    """Open ``stream`` afresh on ``chain`` and prefill the prompt: (the greedy next token,
    its position)."""
    chain.open(stream)
    chain.reset(stream)
    reply = chain.step(stream, np.asarray(prompt_ids), np.arange(len(prompt_ids)))
    return int(reply.tokens[-1]), len(prompt_ids)


def greedy_step(chain: Executor, stream: int, token: int, position: int) -> tuple[int, int]:
    """Feed ``token`` at ``position``: (the greedy next token, its position)."""
    reply = chain.step(stream, np.array([token]), np.array([position]))
    return int(reply.tokens[-1]), position + 1


def paired_step_ms(chains: Mapping[str, Executor], prompt_ids: Sequence[int], tokens: int,
                   stream: int = 7) -> dict[str, float]:
    """Median ms per greedy decode step of each chain, the chains stepped token by token
    in rotating order (each on its own stream): drift of the machine, which moves whole
    runs by +-10% here, hits every chain alike, so their ratios are exact to ~1%."""
    state = {key: start_stream(chain, stream, prompt_ids) for key, chain in chains.items()}
    keys = list(chains)
    times: dict[str, list[float]] = {key: [] for key in keys}
    for i in range(tokens):
        for key in keys[i % len(keys):] + keys[:i % len(keys)]:
            start = time.perf_counter()
            state[key] = greedy_step(chains[key], stream, *state[key])
            times[key].append((time.perf_counter() - start) * 1e3)
    return {key: statistics.median(values) for key, values in times.items()}


def timed_greedy(pipeline: Executor, prompt_ids: Sequence[int], tokens: int,
                 **options: Any) -> tuple[list[int], GenerationStats]:
    """One greedy generation through the engine's loop: its tokens and figures."""
    from zctl.engine.scheduler import generate_greedy
    from zctl.engine.stats import GenerationStats

    stats = GenerationStats()
    out = list(generate_greedy(pipeline, list(prompt_ids), tokens, stats=stats, **options))
    return out, stats


# -- a local cluster's generation service ------------------------------------------------------


def bench_request(prompt: str, tokens: int, **fields: Any) -> GenerationRequest:
    """A chat-templated request for exactly ``tokens`` tokens (EOS ignored)."""
    from zctl.engine.requests import GenerationRequest

    return GenerationRequest(uuid.uuid4().hex[:16], prompt, tokens, True, ignore_eos=True,
                           **fields)


def generate_done(serve: str, prompt: str, tokens: int, **fields: Any) -> GenerationDone:
    """One request through the service at ``serve``: its closing message (an error the
    service reports is raised)."""
    from zctl.engine.requests import GenerationDone
    from zctl.service.client import generate_stream

    stream = generate_stream(serve, bench_request(prompt, tokens, **fields))
    done = [m for m in stream if isinstance(m, GenerationDone)][-1]
    if done.error:
        raise RuntimeError(done.error)
    return done


def generate_together(serve: str, requests: Sequence[GenerationRequest],
                      first_timeout: float = 120.0) -> tuple[list[GenerationDone], float]:
    """Send ``requests`` at once through the service at ``serve``: each one's closing
    message, in the requests' order, and the seconds from the first answer to the last
    (an error the service reports is raised)."""
    from zctl.engine.requests import GenerationDone
    from zctl.service.client import generate_many

    first: float | None = None
    dones: dict[str, GenerationDone] = {}
    for msg in generate_many(serve, list(requests), first_timeout=first_timeout):
        first = time.monotonic() if first is None else first
        if isinstance(msg, GenerationDone):
            if msg.error:
                raise RuntimeError(msg.error)
            dones[msg.request_id] = msg
    span = time.monotonic() - first if first is not None else 0.0
    return [dones[r.request_id] for r in requests], span


# -- openvino_genai, the baseline ---------------------------------------------------------------


def genai_greedy_config(genai: Any, max_new_tokens: int) -> Any:
    """An openvino_genai GenerationConfig for exactly ``max_new_tokens`` greedy tokens."""
    cfg = genai.GenerationConfig()
    cfg.max_new_tokens = max_new_tokens
    cfg.do_sample = False
    cfg.ignore_eos = True
    return cfg


def genai_token_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of ``prompt`` as an openvino_genai tokenizer makes them (no chat template)."""
    return [int(t) for t in tokenizer.encode(prompt).input_ids.data[0]]


# -- output ------------------------------------------------------------------------------------


# The instruction sets that change what the CPU plugin runs (int8 dynamic quantization on
# VNNI/AMX, bf16 where the hint allows it): a figure names the ones its CPU has.
CPU_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), which every published figure names, with the
    CPU_FEATURES it has in brackets."""
    import platform

    name, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    features = [f for f in CPU_FEATURES if f in flags]
    return f"{name} [{' '.join(features)}]" if features else name


def run_record() -> dict[str, Any]:
    """Where and when a benchmark ran: CPU model and count, UTC date, the checkout's commit
    (with "-dirty" when it has uncommitted changes; "unknown" outside a git checkout)."""
    import os
    import subprocess
    from datetime import UTC, datetime

    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                  text=True, timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if commit != "unknown" and git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    return {"cpu": cpu_model(), "cpus": os.cpu_count(),
            "date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": commit}



def print_result(result: Mapping[str, Any], as_json: bool,
                 render: Callable[[Mapping[str, Any], Console], None]) -> None:
    """A benchmark's result: one JSON object on stdout (``--json``), else ``render``'s
    tables."""
    if as_json:
        print(json.dumps(result))
    else:
        render(result, Console())


def metric_table(title: str, result: Mapping[str, Any], skip: Sequence[str] = ()) -> Table:
    """A two-column table of ``result``'s figures (the keys in ``skip`` left out)."""
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.items():
        if key not in skip:
            table.add_row(key, str(value))
    return table
