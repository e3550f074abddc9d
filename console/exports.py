"""Exports the console uses: where each lives by default, and made on first use."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from console.cluster_procs import ClusterError

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


def default_export_dir(model: str, stages: int, weights: str, static: bool = False) -> Path:
    """Where ``zctl export`` writes and ``zctl run``/``cluster up`` look by default.

    The suffix names the split policy ("stages": cost-balanced, see
    ``exporter.balance.default_split``), so an export made under an older policy is not
    silently reused.
    """
    from common.paths import export_cache_dir

    safe = model.replace("/", "--").replace(".gguf", "")
    kind = "-static" if static else ""
    return export_cache_dir() / f"{Path(safe).name}-{weights}-{stages}stages{kind}"


def ensure_export(model: str, stages: int, weights: str) -> Path:
    """The cached export for (model, stages, weights); exported on first use with progress."""
    from common.manifest import ManifestError, load_manifest
    from exporter.balance import default_split

    target = Path(model) if (Path(model) / "manifest.json").is_file() else default_export_dir(
        model, stages, weights)
    try:
        load_manifest(target)
        return target
    except ManifestError:
        if target == Path(model):
            raise
    err.print(f"exporting {model} in {stages} {weights} stages (first use) to {target}")
    try:
        from common.paths import source_cache_dir
        from console.export_view import RichExportProgress
        from exporter.export import export_model
        from exporter.sources import open_source
    except ImportError as exc:
        raise ClusterError(f"exporting needs the export extra (pip install 'zctl[export]'): {exc}") \
            from None
    quiet_ml_libraries()
    source = open_source(model, source_cache_dir())
    with RichExportProgress(stages, err) as progress:
        export_model(source, default_split(source, stages), weights, target, force=True,
                     progress=progress)
    return target
