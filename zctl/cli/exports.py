"""Exports the console uses: where each lives by default, and made on first use."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from zctl.launcher.record import ClusterError

err = Console(stderr=True)


def quiet_ml_libraries() -> None:
    """Silence the export stack's own progress bars and warnings; zctl shows its own."""
    import logging
    import os
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore")
    logging.getLogger("nncf").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


# The weight format a model is exported in when --weights is "auto" (every command's
# default), chosen from the teacher-forced figures of docs/quality.md (zctl bench quality):
# SmolLM2-135M in INT4 agrees with its fp32 model on the next token at 70% of positions
# (perplexity 25.1 against 20.4) and repeats one line in greedy output; in INT8 at 96%
# (20.6), for ~0.85x INT4's decode speed. Gemma 3 270M in INT4 agrees at 61% and its
# chat replies loop on one line; in INT8 at 95%. Models not listed get
# AUTO_WEIGHTS_OTHERWISE (not measured; `zctl bench quality --model DIR` measures one);
# --weights overrides.
AUTO = "auto"
DEFAULT_WEIGHTS = {"smollm2-135m": "int8", "gemma3-270m": "int8"}
AUTO_WEIGHTS_OTHERWISE = "int4"
WEIGHTS_HELP = (f"auto | int4 | int8 | fp16 | fp32; auto: the model's default "
                f"({', '.join(f'{w} for {m}' for m, w in DEFAULT_WEIGHTS.items())}, else "
                f"{AUTO_WEIGHTS_OTHERWISE}; docs/quality.md)")


def resolve_weights(model: str, weights: str) -> str:
    """``weights`` itself, or for "auto" the model's default format (DEFAULT_WEIGHTS, keyed
    by the model argument as given)."""
    if weights != AUTO:
        return weights
    return DEFAULT_WEIGHTS.get(model, AUTO_WEIGHTS_OTHERWISE)


def is_export(model: str) -> bool:
    """Whether ``model`` names an export directory (used as it is)."""
    return (Path(model) / "manifest.json").is_file()


def planned_export_dir(model: str, weights: str, ranges: list[tuple[int, int]],
                       exact_experts: bool = False) -> Path:
    """Where ``cluster up`` keeps an export of the planner's layer ranges: the name holds
    them (``smollm2-135m-int8-layers-0-17_18-29``), so another split is another export, and
    ``-exact-experts`` when its experts are kept exact."""
    from controlplane.placement import layer_range
    from zctl.paths import export_cache_dir

    safe = model.replace("/", "--").replace(".gguf", "")
    layers = "_".join(layer_range(start, end) for start, end in ranges)
    kind = "-exact-experts" if exact_experts else ""
    return export_cache_dir() / (f"{Path(safe).name}-{resolve_weights(model, weights)}-"
                                 f"layers-{layers}{kind}")


def default_export_dir(model: str, stages: int, weights: str, static: bool = False,
                       exact_experts: bool = False) -> Path:
    """Where ``zctl export`` writes and ``zctl run``/``cluster up`` look by default.

    The name holds the weight format ("auto" resolved first, so the default format's
    export never shares a directory with another format's) and the split policy
    ("stages": cost-balanced, see ``exporter.balance.default_split``), so an export made
    under an older policy is not silently reused.
    """
    from zctl.paths import export_cache_dir

    safe = model.replace("/", "--").replace(".gguf", "")
    kind = ("-static" if static else "") + ("-exact-experts" if exact_experts else "")
    return export_cache_dir() / (f"{Path(safe).name}-{resolve_weights(model, weights)}-"
                                 f"{stages}stages{kind}")


def ensure_export(model: str, stages: int, weights: str = AUTO,
                  ranges: list[tuple[int, int]] | None = None,
                  exact_experts: bool = False) -> Path:
    """The cached export for (model, stages, weights, exact_experts); exported on first use
    with progress. A cached directory whose manifest names another weight format or form of
    experts is exported again. ``ranges``: the layer ranges of its stages (default:
    ``exporter.balance.default_split``). ClusterError when the model cannot be exported
    (nothing is left behind as if complete)."""
    from exporter.balance import default_split
    from zctl.manifest import ManifestError, load_manifest

    if is_export(model):
        manifest = load_manifest(model)  # an export directory is used as it is
        if exact_experts and not manifest.exact_experts:
            raise ClusterError(f"{model} is an export whose experts were not kept exact: "
                               "export the model with --exact-experts, or drop it")
        return Path(model)
    weights = resolve_weights(model, weights)
    target = (default_export_dir(model, stages, weights, exact_experts=exact_experts)
              if ranges is None else planned_export_dir(model, weights, ranges, exact_experts))
    try:
        found = load_manifest(target)
        if (found.weight_format, found.exact_experts) == (weights, exact_experts):
            return target
        held = found.weight_format + (" weights with exact experts" if found.exact_experts
                                      else " weights")
        err.print(f"{target} holds {held}, not as asked: exporting again")
    except ManifestError:
        pass
    experts = " with exact experts" if exact_experts else ""
    err.print(f"exporting {model} in {stages} {weights} stages{experts} (first use) to {target}")
    try:
        from exporter.export import ExportError, export_model
        from exporter.sources import SourceError, open_source
        from zctl.cli.export_view import RichExportProgress
        from zctl.paths import source_cache_dir
    except ImportError as exc:
        raise ClusterError(f"exporting needs the export extra (pip install 'zctl[export]'): {exc}") \
            from None
    quiet_ml_libraries()
    try:
        source = open_source(model, source_cache_dir())
        split = default_split(source, stages) if ranges is None else ranges
        with RichExportProgress(len(split), err) as progress:
            export_model(source, split, weights, target, force=True, progress=progress,
                         exact_experts=exact_experts)
    except (SourceError, ExportError) as exc:
        raise ClusterError(str(exc)) from None
    return target


def fleet_export_ranges(model: str, fleet: Path, weights: str, objective: str = "latency",
                        streams: int = 0, exact_experts: bool = False
                        ) -> tuple[list[tuple[int, int]], str]:
    """The layer ranges of the planner's best placement of ``model`` on the PCs of the
    fleet file ``fleet`` for ``objective`` (as ``zctl plan --fleet`` shows it; throughput
    judged at ``streams`` streams; its experts sized and timed exact with
    ``exact_experts``), and what they come from; ValueError when the file is bad, the
    model has no experts to keep exact, or it fits none of its placements."""
    from controlplane.placement import layer_range
    from controlplane.planner.fleet import load_fleet
    from controlplane.planner.search import PLAN_STREAMS, PlanRequest, plan
    from controlplane.planner.shape_sources import resolve_shape

    weights = resolve_weights(model, weights)
    shape = resolve_shape(model)
    if exact_experts and not shape.moe:
        raise ValueError(f"{shape.name} has no experts to keep exact: drop --exact-experts")
    pcs = load_fleet(fleet)
    streams = streams if objective == "throughput" and streams else PLAN_STREAMS
    best = plan(PlanRequest(shape, weights, pcs.profiles(shape, weights, exact_experts),
                            pcs.links(), objective=objective, streams=streams, head=pcs.head,
                            top=1, exact_experts=exact_experts)).placements[0]
    stages = ", ".join(f"{s.node} {layer_range(s.start, s.end)}" for s in best.stages)
    speed = (f"{best.tok_s:.3g} tok/s for one stream" if objective == "latency" else
             f"{best.streams.tok_s:.3g} tok/s for {best.streams.streams} streams")
    return best.ranges(), (f"the planner's best placement on {fleet} ({stages}; predicted "
                           f"{speed})")


def local_export_ranges(model: str, processes: int, weights: str, device: str,
                        memory_mb: int = 0, exact_experts: bool = False
                        ) -> tuple[list[tuple[int, int]] | None, str]:
    """The planner's layer ranges for a ``cluster up --local`` cluster of ``processes``
    processes sharing this machine (``controlplane.planner.local_split``), from this
    machine's profile as ``zctl node profile`` kept it (of exact experts with
    ``exact_experts``), else the ``xeon-core`` reference; and what they come from. (None,
    why) when the planner cannot choose them: the export then splits by
    ``exporter.balance``."""
    from dataclasses import replace

    from controlplane.nodeinfo import ram
    from controlplane.placement import PlacementError
    from controlplane.planner.local_split import local_ranges
    from controlplane.planner.measured import profile_of
    from controlplane.planner.profile import ProfileError
    from controlplane.planner.references import derive_profile, reference_speed
    from controlplane.planner.shape import ShapeError
    from controlplane.planner.shape_sources import resolve_shape
    from controlplane.profile_store import ProfileStore
    from zctl.paths import zctl_home

    weights = resolve_weights(model, weights)
    try:
        shape = resolve_shape(model)
        free = ram()[1]  # the processes share what is free, each lending memory_mb at most
        free = min(free, processes * (memory_mb << 20)) if memory_mb else free
        record, why = ProfileStore(zctl_home() / "node").load(
            shape, weights, device, exact_experts=exact_experts)
        if record is not None:
            profile, source = profile_of(record), "this machine's profile (zctl node profile)"
        else:
            profile = derive_profile(reference_speed("xeon-core"), shape, weights, free,
                                     exact_experts=exact_experts)
            source = f"the xeon-core reference profile (this machine: {why})"
        ranges = local_ranges(shape, weights, replace(profile, free_memory=free), processes)
    except (ShapeError, ProfileError, PlacementError, OSError) as exc:
        return None, f"split by cost, not by the planner: {exc}"
    return ranges, f"the planner's split for {processes} processes from {source}"
