"""The MoE benchmark's models: random Qwen3-MoE checkpoints of Qwen3-30B-A3B's layer shape
(tools.harness.random_moe), written once under the zctl home and exported through the
benchmarks' export cache (tools.harness.models)."""

from __future__ import annotations

from pathlib import Path

from tools.harness.models import BenchModel
from tools.harness.report import err

# name -> the checkpoint's shape: the model under test, twice its experts (the same 8
# active), and a dense model of as many MLP weights as the model under test
MOE_MODELS: dict[str, dict[str, int | bool]] = {
    "experts-128": {"experts": 128},
    "experts-256": {"experts": 256},
    "dense-equal": {"experts": 128, "dense": True},
}


def moe_model(name: str, layers: int, cache: Path) -> BenchModel:
    """The random checkpoint ``name`` (a key of MOE_MODELS) with ``layers`` decoder layers
    under ``cache``/sources, written on first use."""
    from tools.harness.random_moe import write_random_moe

    if name not in MOE_MODELS:
        raise ValueError(f"unknown MoE model {name!r}; one of {sorted(MOE_MODELS)}")
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    hf_dir = cache / "sources" / f"random-moe-{name}-{layers}l"
    if not (hf_dir / "config.json").is_file():
        err.print(f"writing a random Qwen3-MoE checkpoint {name}, {layers} layers ...")
        write_random_moe(hf_dir, layers=layers, **MOE_MODELS[name])  # type: ignore[arg-type]
    return BenchModel(hf_dir.name, hf_dir, cache)
