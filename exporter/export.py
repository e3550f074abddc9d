"""``zctl export``: build every stage (load, trace, convert, compress, save) into one directory.

Stages are built one at a time from lazily read weights and freed before the next,
so peak memory follows the largest stage. Output is written to a hidden temporary
directory and renamed into place only once every file and the manifest are complete.
"""

from __future__ import annotations

import gc
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import openvino as ov
import torch

from dataplane.runtime.stateful_graph import add_beam_idx, make_stateful
from exporter import graph
from exporter.compress import compress_stage, keeps_16bit
from exporter.exact_experts import InexactExpertsError
from exporter.int8_groups import UncheckedNncfError, check_nncf_version
from exporter.sources import ModelSource
from exporter.stage_module import StageModule
from zctl.engine.sampling_defaults import SamplingConfigError, model_sampling
from zctl.manifest import (
    MANIFEST_NAME,
    ExportManifest,
    ManifestError,
    ModelSpec,
    StageSpec,
    StaticKV,
    check_layer_cover,
    sha256_file,
    write_manifest,
)
from zctl.weights import INT8_CHANNELS, INT8_GROUPS, WEIGHT_FORMATS, pick_group_size

PHASES = ("load", "trace", "convert", "compress", "save")


class ExportError(RuntimeError):
    """The export cannot proceed; nothing was left behind as if complete."""


def int8_form_for(weight_format: str, static: bool) -> str | None:
    """The form of an export's INT8 weights (zctl.weights.INT8_FORMS), None if it has none.

    An int8 export is in symmetric i8 groups: as fast or faster than u8 per channel in
    whole stages, and closer to fp32 (docs/measurements/single-node.md). A static export
    (the NPU path) and an int4 export's embedding and head stay per channel: neither form
    was checked in groups (no NPU here; the INT4 stages' dynamic quantization group is
    theirs, not INT8's)."""
    if weight_format == "int8" and not static:
        return INT8_GROUPS
    return INT8_CHANNELS if weight_format in ("int4", "int8") else None


@dataclass
class StageReport:
    index: int
    timings: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: float = 0.0


class ExportProgress:
    """Receives phase events; the console turns them into Rich progress bars."""

    def stage_started(self, index: int, layers: tuple[int, int]) -> None: ...
    def phase(self, index: int, name: str) -> None: ...
    def stage_done(self, report: StageReport) -> None: ...
    def note(self, text: str) -> None: ...


def _rss_mb() -> float:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:  # pragma: no cover - psutil ships with the export extra
        return 0.0


def library_versions() -> dict[str, str]:
    import importlib.metadata as md

    versions = {"openvino": ov.get_version(), "torch": torch.__version__}
    for package in ("nncf", "transformers", "zctl"):
        try:
            versions[package] = md.version(package)
        except md.PackageNotFoundError:
            versions[package] = "unknown"
    return versions


def model_spec(source: ModelSource) -> ModelSpec:
    shape = source.decoder_shape()
    rope = source.rope()
    bos = getattr(source.config, "bos_token_id", None)
    return ModelSpec(
        name=source.name,
        architecture=source.architecture,
        num_layers=source.num_layers,
        hidden_size=shape.hidden_size,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab_size,
        rope_inv_freq=tuple(rope.inv_freq),
        rope_attention_scaling=rope.attention_scaling,
        max_position_embeddings=source.context_length(),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(source.eos_token_ids()),
        rope_local_inv_freq=tuple(rope.local_inv_freq),
        sliding_window=shape.sliding_window,
        sliding_layers=shape.sliding_layers,
        sliding_kv_trimmable=bool(shape.sliding_layers),  # (exporter.stage_module's graphs)
        experts=shape.experts,
        active_experts=shape.active_experts,
        expert_intermediate=shape.expert_intermediate,
        rope_long_inv_freq=tuple(rope.long_inv_freq),
        rope_short_context=rope.short_context,
    )


@contextmanager
def _staging_dir(out_dir: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary sibling directory; move it to out_dir only on success."""
    if out_dir.exists() and not force:
        raise ExportError(f"{out_dir} already exists (use --force to replace it)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)


def build_stage(
    source: ModelSource,
    index: int,
    layers: tuple[int, int],
    num_stages: int,
    weight_format: str,
    group_size: int | None,
    beam_idx: bool,
    out_dir: Path,
    progress: ExportProgress,
    rt_info: dict[str, str],
    static: StaticKV | None = None,
    fuse_projections: bool = True,
    int8_form: str | None = None,
    exact_experts: bool = False,
) -> tuple[StageSpec, StageReport]:
    """Build one stage into out_dir; returns its spec and timings. ``static``: a stateless
    stage whose present outputs hold only the new tokens' KV (see StaticKV);
    ``exact_experts``: the experts' weights in their exact i8 form (exporter.exact_experts)."""
    report = StageReport(index)
    first, last = index == 0, index == num_stages - 1
    start, end = layers
    shape = source.decoder_shape()
    clock = time.perf_counter()

    def mark(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        report.timings[name] = now - clock
        report.peak_rss_mb = max(report.peak_rss_mb, _rss_mb())
        clock = now

    def fetch(name: str) -> torch.Tensor | None:
        # a compressed export keeps a 16-bit checkpoint's weights 16-bit until NNCF compresses
        # them (the same compressed weights, half the memory: exporter.stored_weights)
        keep = keeps_16bit(weight_format, name)
        return source.get(name, keep) if name.endswith(".bias") else source.require(name, keep)

    progress.phase(index, "load")
    kv_dtype = torch.float16 if static is not None and static.kv_dtype == "f16" else None
    module = StageModule(shape, start, end, first, last, fetch, new_kv_only=static is not None,
                         kv_dtype=kv_dtype, fuse_projections=fuse_projections).eval()
    source.release()  # unmap the checkpoint: the pages of this stage must not pile up
    mark("load")
    progress.phase(index, "trace")
    model = graph.convert_stage(module, shape, start, end, first, last)
    # The converted model's 16-bit Constants share the module's tensors without keeping them
    # alive (OpenVINO's PyTorch frontend, 2026.4): the module goes once NNCF replaced them.
    shared = [module]
    del module

    def compressed_16bit() -> None:
        shared.clear()
        gc.collect()

    gc.collect()
    mark("trace")
    progress.phase(index, "convert")
    pairs = graph.kv_names(start, end)
    if static is not None:  # past KV in, new KV out: no state, no beam_idx (nothing to reorder)
        beam_idx = False
    else:
        if beam_idx:
            add_beam_idx(model, [past for past, _ in pairs])
        make_stateful(model, pairs, "input_ids" if first else "hidden_states")
    graph.stamp_rt_info(model, {**rt_info, "stage": str(index), "layers": f"{start}-{end - 1}"})
    mark("convert")
    progress.phase(index, "compress")
    try:
        model = compress_stage(model, weight_format, group_size, compressed_16bit,
                               int8_form or INT8_CHANNELS, exact_experts)
    except InexactExpertsError as exc:
        raise ExportError(f"{source.location}: {exc}") from None
    mark("compress")
    progress.phase(index, "save")
    xml = f"stage{index}.xml"
    ov.save_model(model, out_dir / xml, compress_to_fp16=weight_format == "fp16")
    inputs, outputs = graph.io_names(first, last)
    if static is not None:  # the KV is plain I/O: listed with the inputs and outputs, no state
        inputs += [past for past, _ in pairs]
        outputs += [present for _, present in pairs]
    del model
    gc.collect()
    mark("save")
    spec = StageSpec(
        index=index,
        layer_start=start,
        layer_end=end,
        xml=xml,
        bin=f"stage{index}.bin",
        inputs=tuple(inputs + (["beam_idx"] if beam_idx else [])),
        outputs=tuple(outputs),
        state_names=() if static is not None else tuple(past for past, _ in pairs),
        first=first,
        last=last,
    )
    return spec, report


def export_model(
    source: ModelSource,
    ranges: list[tuple[int, int]],
    weight_format: str,
    out_dir: Path | str,
    *,
    group_size: int | None = None,
    beam_idx: bool = True,
    force: bool = False,
    progress: ExportProgress | None = None,
    static_kv: StaticKV | None = None,
    fuse_projections: bool = True,
    exact_experts: bool = False,
) -> tuple[ExportManifest, list[StageReport]]:
    """Export ``source`` cut at ``ranges`` (half-open layer ranges) into ``out_dir``.

    ``static_kv`` makes the static, stateless export of the NPU path (no beam_idx).
    ``exact_experts`` keeps a mixture of experts' MXFP4 weights exactly, whatever
    ``weight_format`` the rest takes (exporter.exact_experts)."""
    out_dir = Path(out_dir)
    progress = progress or ExportProgress()
    if weight_format not in WEIGHT_FORMATS:
        raise ExportError(f"unknown weight format {weight_format!r}; expected one of {WEIGHT_FORMATS}")
    try:
        check_layer_cover(ranges, source.num_layers)
    except ManifestError as exc:
        raise ExportError(str(exc)) from None
    shape = source.decoder_shape()
    if static_kv is not None:
        # (a window that never slides within the static context is no obstacle: the
        # layers' masks then see every key, as a global layer's do)
        unstatic = [what for what, has in (
            ("attention sinks", shape.attention_sinks),
            ("sliding-window layers", shape.local_rope or (
                shape.sliding_layers and static_kv.context > shape.sliding_window)),
            # with every shape fixed, the CPU plugin no longer gathers the routed experts
            # (GatherMatmul) but computes all of them, every step
            ("a mixture of experts (every step would compute all its experts)",
             shape.experts)) if has]
        if unstatic:
            raise ExportError(f"{source.location}: a static export of a model with "
                              f"{' and '.join(unstatic)} is not supported (export it "
                              "without --static)")
    if exact_experts and not shape.experts:
        raise ExportError(f"{source.location}: exact experts keep a mixture of experts' "
                          "MXFP4 weights, and this model has no experts")
    int8_form = int8_form_for(weight_format, static_kv is not None)
    if int8_form == INT8_GROUPS:
        try:  # before any stage is built
            check_nncf_version()
        except UncheckedNncfError as exc:
            raise ExportError(str(exc)) from None
    if weight_format == "int4" and group_size is None:
        group_size = pick_group_size(
            [shape.hidden_size, shape.intermediate_size, shape.num_heads * shape.head_dim]
            + ([shape.expert_intermediate] if shape.experts else [])
        )
    spec = model_spec(source)
    generation = source.sampling_config()
    try:
        model_sampling(generation)  # a value zctl cannot sample with fails here, not when served
    except SamplingConfigError as exc:
        raise ExportError(f"{source.location}: {exc}") from None
    versions = library_versions()
    rt_info = {f"{k}_version": v for k, v in versions.items()}
    rt_info.update(model=source.name, weight_format=weight_format)
    stages: list[StageSpec] = []
    reports: list[StageReport] = []
    with _staging_dir(out_dir, force) as tmp:
        for index, layers in enumerate(ranges):
            progress.stage_started(index, layers)
            stage, report = build_stage(
                source, index, layers, len(ranges), weight_format, group_size, beam_idx, tmp,
                progress, rt_info, static=static_kv, fuse_projections=fuse_projections,
                int8_form=int8_form, exact_experts=exact_experts,
            )
            stages.append(stage)
            reports.append(report)
            progress.stage_done(report)
        progress.note("saving tokenizer")
        source.save_tokenizer(tmp)
        files = {
            path.name: sha256_file(path)
            for path in sorted(tmp.iterdir())
            if path.is_file() and path.name != MANIFEST_NAME
        }
        manifest = ExportManifest(
            model=spec,
            stages=tuple(stages),
            weight_format=weight_format,
            group_size=group_size if weight_format == "int4" else None,
            activation_dtype="f32",
            beam_idx=beam_idx and static_kv is None,
            versions=versions,
            files=files,
            source=source.location,
            created=datetime.now(UTC).isoformat(timespec="seconds"),
            static_kv=static_kv,
            generation_config=generation,
            int8_form=int8_form,
            exact_experts=exact_experts,
        )
        write_manifest(tmp, manifest)
    return manifest, reports
