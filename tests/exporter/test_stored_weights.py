"""A compressed export of a 16-bit checkpoint keeps its weight matrices 16-bit while traced
and converted (half a float32 copy's memory), and compresses to exactly the weights the
float32 module gave: every Constant of the IR, in order, of the same type, shape and bytes,
and the same operations, as the export of the checkpoint widened to float32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
import pytest
import torch
from safetensors.torch import load_file, save_file

from dataplane.runtime.ov_core import shared_core
from exporter import graph
from exporter.compress import keeps_16bit
from exporter.export import export_model
from exporter.sources import open_source
from exporter.stage_module import StageModule
from tests.helpers.tiny_models import build_llama

MOE = dict(arch="qwen3_moe", head_dim=24, moe_intermediate_size=32, num_experts=8,
           num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[2], tied=False,
           norm_spread=0.3)
GPT_OSS = dict(arch="gpt_oss", layers=3, head_dim=16, intermediate=32, num_local_experts=8,
               num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.5, pad_token_id=None,
               tied=False, norm_spread=0.3, bias_spread=0.5)


def _stored_as(model_dir: Path, out_dir: Path, dtype: torch.dtype,
               rounded: torch.dtype | None = None) -> Path:
    """A copy of the checkpoint with every tensor in ``dtype`` (first rounded to ``rounded``)."""
    out_dir.mkdir(parents=True)
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors":
            (out_dir / path.name).write_bytes(path.read_bytes())
            continue
        tensors = load_file(path)
        if rounded is not None:
            tensors = {name: t.to(rounded) for name, t in tensors.items()}
        save_file({name: t.to(dtype).contiguous() for name, t in tensors.items()},
                  out_dir / path.name, metadata={"format": "pt"})
    return out_dir


def _constants(xml: Path) -> list[tuple[str, tuple[int, ...], bytes]]:
    model = shared_core().read_model(xml)
    return [(str(op.get_element_type()), tuple(op.get_output_shape(0)),
             np.asarray(op.data).tobytes())
            for op in model.get_ordered_ops() if op.get_type_name() == "Constant"]


def _operations(xml: Path) -> list[str]:
    return [op.get_type_name() for op in shared_core().read_model(xml).get_ordered_ops()]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "dtype", "weights", "split"), [
    ("llama", torch.bfloat16, "int4", [(0, 4)]),  # embedding, layers and LM head
    ("moe", torch.float16, "int8", [(0, 4)]),  # experts and router in the one INT8 pass
    ("gpt_oss", torch.bfloat16, "int4", [(0, 3)]),  # biases, sinks, a biased router
])
def test_a_16bit_checkpoint_compresses_to_its_float32_copys_weights(
        tmp_path: Path, family: str, dtype: torch.dtype, weights: str,
        split: list[tuple[int, int]]) -> None:
    options = {"llama": {}, "moe": MOE, "gpt_oss": GPT_OSS}[family]
    base = build_llama(tmp_path / "base", **options)  # type: ignore[arg-type]
    half = _stored_as(base, tmp_path / "half", dtype)
    single = _stored_as(base, tmp_path / "single", torch.float32, rounded=dtype)
    for source in (half, single):
        export_model(open_source(str(source)), split, weights, tmp_path / f"out-{source.name}")
    for index in range(len(split)):
        got, want = (tmp_path / f"out-{name}" / f"stage{index}.xml" for name in ("half", "single"))
        assert _operations(got) == _operations(want)
        constants = _constants(got)
        assert constants == _constants(want)
        # compressed: no weight is left in a 16-bit float type (f16 are NNCF's scales only)
        assert "<Type: 'bfloat16'>" not in {kind for kind, _, _ in constants}


def test_the_traced_stage_keeps_the_16bit_weights_16bit(tmp_path: Path) -> None:
    """The memory saving itself: the torch module and the converted model hold the decoder
    layers' weights in bf16; the norms are float32, and so are the embedding and the LM head
    (the INT8 pass's, in float32 for its smaller temporaries)."""
    half = _stored_as(build_llama(tmp_path / "base", tied=False), tmp_path / "half",
                      torch.bfloat16)
    source = open_source(str(half))
    shape = source.decoder_shape()

    def fetch(name: str) -> torch.Tensor | None:
        keep = keeps_16bit("int4", name)
        return source.get(name, keep) if name.endswith(".bias") else source.require(name, keep)

    module = StageModule(shape, 0, 4, True, True, fetch).eval()
    dtypes = {name: p.dtype for name, p in module.named_parameters()}
    assert dtypes["layers.0.qkv_proj.weight"] == torch.bfloat16
    assert dtypes["layers.3.down_proj.weight"] == torch.bfloat16
    assert dtypes["layers.0.input_norm.weight"] == torch.float32
    assert dtypes["embed.weight"] == dtypes["lm_head.weight"] == torch.float32
    model = graph.convert_stage(module, shape, 0, 4, True, True)
    bf16 = [op for op in model.get_ordered_ops()
            if op.get_type_name() == "Constant" and op.get_element_type() == ov.Type.bf16]
    assert len(bf16) == 4 * 4  # qkv, o, gate_up, down: 4 layers' worth, none widened


@pytest.mark.parametrize(("weights", "name", "kept"), [
    ("int4", "model.layers.3.self_attn.o_proj.weight", True),
    ("int8", "model.layers.0.mlp.experts.gate_up_proj", True),
    ("int4", "model.layers.0.mlp.gate_proj.weight", True),
    ("int4", "model.embed_tokens.weight", False),
    ("int8", "lm_head.weight", False),
    ("int4", "model.layers.7.mlp.gate.weight", False),  # Qwen3-MoE's router
    ("int4", "model.layers.7.mlp.router.weight", False),  # gpt-oss's
    ("fp16", "model.layers.3.self_attn.o_proj.weight", False),
    ("fp32", "model.layers.3.self_attn.o_proj.weight", False),
])
def test_which_weights_stay_16bit(weights: str, name: str, kept: bool) -> None:
    assert keeps_16bit(weights, name) is kept
