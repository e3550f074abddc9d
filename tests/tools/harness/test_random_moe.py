"""The MoE benchmark's random checkpoints read as the shapes they claim: experts stacked,
or a dense MLP of as many weights."""

from __future__ import annotations

from pathlib import Path

from exporter.sources import open_source
from tools.harness.random_moe import LAYER_SHAPE, write_random_moe


def test_a_random_moe_reads_as_qwen3_moe_of_its_experts(tmp_path: Path) -> None:
    source = open_source(str(write_random_moe(tmp_path / "moe", experts=8)))
    shape = source.decoder_shape()
    assert (source.architecture, shape.experts, shape.active_experts, shape.sparse_layers) == (
        "qwen3_moe", 8, LAYER_SHAPE["num_experts_per_tok"], (0,))
    assert tuple(source.require("model.layers.0.mlp.experts.down_proj").shape) == (8, 2048, 768)


def test_its_dense_twin_has_as_many_mlp_weights(tmp_path: Path) -> None:
    source = open_source(str(write_random_moe(tmp_path / "dense", experts=8, dense=True)))
    shape = source.decoder_shape()
    assert (shape.experts, shape.sparse_layers, shape.intermediate_size) == (0, (), 8 * 768)
    assert tuple(source.require("model.layers.0.mlp.down_proj.weight").shape) == (2048, 8 * 768)
