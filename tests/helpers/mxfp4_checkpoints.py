"""Checkpoints whose experts are MXFP4 pairs (``..._blocks``, ``..._scales``), as gpt-oss
publishes them, and the same weights dense as transformers dequantizes them: written by
the tests from a tiny random model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from exporter.mxfp4 import quantize_experts


def write_checkpoint(source: Path, out: Path, tensors: dict[str, torch.Tensor],
                     quantization: dict | None) -> Path:
    """``source``'s directory copied to ``out`` with ``tensors`` as its weights and
    ``quantization`` as its config's quantization_config (None: none)."""
    shutil.copytree(source, out)
    save_file(tensors, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    if quantization is None:
        config.pop("quantization_config", None)
    else:
        config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config))
    return out


def mxfp4_and_dense(model: Path, root: Path, projections: list[str],
                    quantization: dict) -> tuple[Path, Path]:
    """``model`` with each of its stacked expert ``projections`` stored as an MXFP4 pair
    (blocks along its dimension 1, as gpt-oss's checkpoints hold them) under ``root /
    "mxfp4"`` (its config stating ``quantization``), and the same weights dense, as
    transformers' own dequantization reads the pairs, under ``root / "dense"``."""
    tensors = load_file(model / "model.safetensors")
    dense, packed = dict(tensors), dict(tensors)
    for name in projections:
        blocks, scales = quantize_experts(tensors[name])
        dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
    return (write_checkpoint(model, root / "mxfp4", packed, quantization),
            write_checkpoint(model, root / "dense", dense, None))
