"""The runner of a stage: which ``StageRuntime`` an export's stage runs on, by the export's
KV kind and the runtime spec."""

from __future__ import annotations

from pathlib import Path

import openvino as ov

from dataplane.runtime.base import StageRuntime
from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.paged import PagedStageRunner
from dataplane.runtime.stateful import StageRunner
from dataplane.runtime.static import StaticStageRunner
from zctl.manifest import ExportManifest, load_manifest


def load_runner(export_dir: Path | str, index: int, config: RuntimeSpec | None = None,
                manifest: ExportManifest | None = None, core: ov.Core | None = None,
                verify: bool = True, graph: ov.Model | None = None) -> StageRuntime:
    """The runner for stage ``index`` of an export: a StageRunner (stateful KV), a
    PagedStageRunner (``config.paged_attention``), or a StaticStageRunner for a static
    export (the NPU path). ``graph``: a stateful stage's model in memory, in place of the
    export's xml (``manifest`` then describes it)."""
    manifest = manifest or load_manifest(export_dir, verify_files=False)
    if manifest.static_kv is None and config is not None and config.paged_attention:
        return PagedStageRunner(export_dir, index, config, manifest=manifest, core=core,
                                verify=verify, graph=graph)
    if manifest.static_kv is None:
        return StageRunner(export_dir, index, config, manifest=manifest, core=core, verify=verify,
                           graph=graph)
    return StaticStageRunner(export_dir, index, config, manifest=manifest, core=core,
                             verify=verify)
