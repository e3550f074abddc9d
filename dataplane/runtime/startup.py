"""A runner's start: the stage it opens (checked against the export and the runtime
spec), and the scratch steps it warms up with.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dataplane.runtime.base import StageError, StageRuntime
from dataplane.runtime.config import DEVICES, RuntimeSpec, device_kind
from zctl.manifest import ExportManifest, StageSpec, load_manifest


def open_stage(export_dir: Path, index: int, config: RuntimeSpec | None,
               manifest: ExportManifest | None, static: bool
               ) -> tuple[ExportManifest, StageSpec, RuntimeSpec]:
    """The manifest, stage spec and runtime spec of stage ``index``, checked: the stage
    exists, the device is known, and the export's KV kind (static or stateful) is
    ``static``."""
    manifest = manifest or load_manifest(export_dir, verify_files=False)
    if (manifest.static_kv is not None) != static:
        raise StageError(
            f"{export_dir} is a static export: load it with StaticStageRunner" if not static
            else f"{export_dir} is a stateful export: load it with StageRunner")
    if not 0 <= index < len(manifest.stages):
        raise StageError(f"stage {index} does not exist: the export has {len(manifest.stages)} "
                         "stages")
    config = config or RuntimeSpec()
    if device_kind(config) not in DEVICES:
        raise StageError(f"unknown device {config.device!r}; expected one of {DEVICES}")
    return manifest, manifest.stages[index], config


def int4_group(manifest: ExportManifest) -> int | None:
    """The export's INT4 group size (None unless its weights are INT4): what its stages'
    activations are quantized in groups of (RuntimeSpec.properties)."""
    return manifest.group_size if manifest.weight_format == "int4" else None


def zero_input(runtime: StageRuntime, tokens: int) -> np.ndarray:
    """A scratch step's input for ``runtime``: ``tokens`` zero ids [1, T] on the first stage,
    zero hidden states [1, T, H] on the others."""
    if runtime.spec.first:
        return np.zeros((1, tokens), np.int64)
    return np.zeros((1, tokens, runtime.hidden_size), np.float32)


def warm_up_steps(runtime: StageRuntime, stream_id: int, prefill_tokens: int = 8) -> None:
    """Run a prefill-shaped and a decode-shaped step of ``runtime`` on a scratch stream,
    then drop it, so the first real request does not pay the plugin's first-inference
    costs."""
    runtime.open_stream(stream_id)
    try:
        for positions in (np.arange(prefill_tokens), np.arange(8, 9)):
            runtime.step(stream_id, zero_input(runtime, len(positions)), positions)
    finally:
        runtime.close_stream(stream_id)
