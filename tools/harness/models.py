"""The benchmarks' models and their cached exports: SmolLM2-135M (the default), Gemma 3
270M (gemma3-270m: its GGUF, joined from the ``gemma3`` extra's packages), random
Llama checkpoints of known shapes (random-1b, random-8b, random-tiny) or an HF directory, exported
once per split, weight format and KV layout into the cache, and the plugin hints both
sides of a comparison get.

Imports that cost time (the exporter, openvino) happen inside the functions that need
them: ``--help`` of a benchmark stays quick.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tools.harness.report import err

if TYPE_CHECKING:
    from zctl.manifest import StaticKV

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
RANDOM_MODELS = {"random-1b": "llama-3.2-1b", "random-8b": "llama-3.1-8b",
                 "random-tiny": "tiny"}  # name -> SHAPES key


def model_hf_dir(model: str, cache: Path) -> Path:
    """An HF directory for the model (the default GGUF dequantised; random-1b and
    random-tiny generated), or gemma3-270m's GGUF file (joined once)."""
    from exporter.sources import (
        DEFAULT_MODEL,
        GEMMA3_270M,
        default_model_hf_dir,
        gemma3_270m_gguf_path,
    )

    if model == DEFAULT_MODEL:
        return default_model_hf_dir(cache / "sources")
    if model == GEMMA3_270M:
        return gemma3_270m_gguf_path(cache / "sources")
    if model in RANDOM_MODELS:
        from tools.harness.random_llama import write_random_llama

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
    named = ("smollm2-135m", "gemma3-270m", *RANDOM_MODELS)
    return model if model in named else hf_dir.name


def cached_export(hf_dir: Path, name: str, stages: int, weights: str, beam_idx: bool,
                  cache: Path, layers: str = "", static_kv: StaticKV | None = None) -> Path:
    """Export once per (model, stages or layer split, weights, beam_idx, static KV); reuse
    while the manifest verifies and its INT8 weights are in the form an export is written
    in now (an INT8 export made before i8 groups holds u8 channels: timing it would time
    the old form). ``layers`` ("0-16,17-29") overrides ``stages``' cost-balanced split
    (the one ``zctl export --stages`` makes)."""
    from exporter.balance import default_split
    from exporter.export import export_model, int8_form_for
    from exporter.sources import open_source
    from zctl.cli.export_view import RichExportProgress
    from zctl.manifest import ManifestError, load_manifest, parse_layer_spec

    split = f"L{layers.replace(',', '_')}" if layers else f"{stages}stages"
    kind = ("" if beam_idx else "-nobeam") + (
        f"-static{static_kv.context}x{static_kv.chunk}" if static_kv else "") + (
        "-f16" if static_kv and static_kv.kv_dtype == "f16" else "")
    out = cache / "exports" / "bench" / f"{name}-{weights}-{split}{kind}"
    try:
        if load_manifest(out).int8_form == int8_form_for(weights, static_kv is not None):
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
