"""A safetensors checkpoint whose experts are MXFP4 pairs (gpt-oss's ``..._blocks`` and
``..._scales``): the source serves each layer's stacked projection from its pair, as
transformers dequantizes it, one projection at a time; an export of it is the export of the
same weights stored dense; a quantization it does not read, an incomplete or misshapen pair,
or a pair of another tensor is refused when the source opens (before any stage is written).

Two tiny models: a gpt-oss, whose pairs are laid out as its published checkpoints' (blocks
along each projection's input dimension; transformers reads a pair as its rows transposed,
[E, in, out], as gpt-oss's model holds its experts), and a Qwen3-MoE, whose stacked experts
are [E, out, in]: the test stores each of its projections' transpose in MXFP4 (blocks along
the output rows), so the layouts agree through that transpose and Qwen3-MoE's many checks
of a checkpoint run on pairs too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from exporter.export import export_model
from exporter.mxfp4 import quantize_experts
from exporter.sources import SafetensorsSource, SourceError, open_source
from tests.helpers.mxfp4_checkpoints import mxfp4_and_dense, write_checkpoint
from tests.helpers.tiny_models import build_llama

EXPERTS, LAYERS = 4, 2
MOE = dict(arch="qwen3_moe", head_dim=16, moe_intermediate_size=32, num_experts=EXPERTS,
           num_experts_per_tok=2, norm_topk_prob=True)
PROJECTIONS = [f"model.layers.{layer}.mlp.experts.{p}"
               for layer in range(LAYERS) for p in ("gate_up_proj", "down_proj")]
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                    "model.layers.*.mlp.gate"]}


def _stacked(tensors: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """A layer's experts stored one by one, stacked as Hugging Face holds them (and removed)."""
    prefix = f"model.layers.{layer}.mlp.experts"
    take = [{part: tensors.pop(f"{prefix}.{e}.{part}.weight")
             for part in ("gate_proj", "up_proj", "down_proj")} for e in range(EXPERTS)]
    return {f"{prefix}.gate_up_proj": torch.stack([torch.cat((t["gate_proj"], t["up_proj"]))
                                                   for t in take]),
            f"{prefix}.down_proj": torch.stack([t["down_proj"] for t in take])}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The MXFP4 checkpoint, and the same weights dense: each projection as transformers'
    own dequantization reads the pair (its stacked [E, out, in] form)."""
    root = tmp_path_factory.mktemp("mxfp4")
    model = build_llama(root / "model", layers=LAYERS, tied=False, **MOE)
    tensors = load_file(model / "model.safetensors")
    dense, packed = dict(tensors), dict(tensors)
    for layer in range(LAYERS):
        for name, weight in _stacked(tensors, layer).items():
            blocks, scales = quantize_experts(weight)
            dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        for name in list(dense):
            if f"layers.{layer}.mlp.experts." in name and name.endswith(".weight"):
                del dense[name], packed[name]
    return (write_checkpoint(model, root / "mxfp4", packed, MXFP4_CONFIG),
            write_checkpoint(model, root / "dense", dense, None))


GPT_OSS = dict(arch="gpt_oss", head_dim=16, intermediate=32, num_local_experts=EXPERTS,
               num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.5, pad_token_id=None)


@pytest.fixture(scope="module")
def gpt_oss_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny gpt-oss with its experts in MXFP4 as gpt-oss publishes them, and the same
    weights dense as transformers' dequantization reads them."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    model = build_llama(root / "model", layers=LAYERS, tied=False, bias_spread=0.5, **GPT_OSS)
    mxfp4, dense = mxfp4_and_dense(model, root, PROJECTIONS, MXFP4_CONFIG)
    packed, weights = (load_file(path / "model.safetensors") for path in (mxfp4, dense))
    for name in PROJECTIONS:  # blocks along the input
        assert packed[name + "_blocks"].shape[-2] * 32 == weights[name].shape[1]
    return mxfp4, dense


def test_gpt_oss_pairs_read_and_export_as_its_dense_weights(
        gpt_oss_checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    mxfp4, dense = (open_source(str(path)) for path in gpt_oss_checkpoints)
    for name in PROJECTIONS:
        value = mxfp4.require(name)
        assert value.shape == mxfp4.stacked_experts_shape(name)
        assert value.shape == ((EXPERTS, 64, 64) if name.endswith("gate_up_proj")
                               else (EXPERTS, 32, 64))  # [E, hidden, 2 I], [E, I, hidden]
        assert torch.equal(value, dense.require(name)), name
    outs = []
    for path in gpt_oss_checkpoints:
        outs.append(tmp_path / path.name)
        export_model(open_source(str(path)), [(0, LAYERS)], "fp32", outs[-1])
    assert (outs[0] / "stage0.bin").read_bytes() == (outs[1] / "stage0.bin").read_bytes()


def _variant(checkpoints: tuple[Path, Path], tmp_path: Path, *, drop: str | None = None,
             change: tuple[str, torch.Tensor] | None = None, config: dict | None = None,
             quantization: dict | None = MXFP4_CONFIG) -> Path:
    """The MXFP4 checkpoint with one tensor dropped or changed, or config fields changed."""
    mxfp4, _ = checkpoints
    tensors = load_file(mxfp4 / "model.safetensors")
    if drop:
        del tensors[drop]
    if change:
        tensors[change[0]] = change[1]
    out = write_checkpoint(mxfp4, tmp_path / "variant", tensors, quantization)
    if config:
        raw = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**raw, **config}))
    return out


def test_pairs_read_as_transformers_dequantizes_them(checkpoints: tuple[Path, Path]) -> None:
    mxfp4, dense = (open_source(str(path)) for path in checkpoints)
    # the names list the tensors the pairs stand for beside the pairs' own
    assert {PROJECTIONS[0], PROJECTIONS[0] + "_blocks"} <= set(mxfp4.tensor_names())
    for name in PROJECTIONS:
        value = mxfp4.get(name)
        assert value is not None and value.dtype == torch.float32
        assert value.shape == mxfp4.stacked_experts_shape(name)
        assert torch.equal(value, dense.require(name)), name
    # the rest of the checkpoint is served as it was
    assert torch.equal(mxfp4.require("model.layers.1.self_attn.q_proj.weight"),
                       dense.require("model.layers.1.self_attn.q_proj.weight"))


def test_one_projection_reads_its_own_pair_only(checkpoints: tuple[Path, Path],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    source = open_source(str(checkpoints[0]))
    read: list[str] = []
    original = SafetensorsSource._read

    def spy(self: SafetensorsSource, name: str) -> torch.Tensor | None:
        read.append(name)
        return original(self, name)

    monkeypatch.setattr(SafetensorsSource, "_read", spy)
    source.require("model.layers.1.mlp.experts.down_proj")
    assert sorted(read) == ["model.layers.1.mlp.experts.down_proj_blocks",
                            "model.layers.1.mlp.experts.down_proj_scales"]


@pytest.mark.parametrize("weights", ["fp32", "int4"])
def test_its_export_is_the_dense_weights_export(checkpoints: tuple[Path, Path],
                                                tmp_path: Path, weights: str) -> None:
    """In INT4 too, where the experts stay bfloat16 until compressed (exactly their MXFP4
    values: exporter.stored_weights)."""
    outs = []
    for path in checkpoints:
        out = tmp_path / path.name
        export_model(open_source(str(path)), [(0, LAYERS)], weights, out)
        outs.append(out)
    assert (outs[0] / "stage0.bin").read_bytes() == (outs[1] / "stage0.bin").read_bytes()


@pytest.mark.parametrize("method", ["gptq", "fp8", "bitsandbytes"])
def test_another_quantization_is_refused_by_name(checkpoints: tuple[Path, Path],
                                                 tmp_path: Path, method: str) -> None:
    path = _variant(checkpoints, tmp_path, quantization={"quant_method": method, "bits": 4})
    with pytest.raises(SourceError, match=f"quantized with '{method}'"):
        open_source(str(path))
    dense = write_checkpoint(checkpoints[1], tmp_path / "dense", load_file(
        checkpoints[1] / "model.safetensors"), {"quant_method": method})
    with pytest.raises(SourceError, match=f"quantized with '{method}'"):  # dense weights too
        open_source(str(dense))


def test_pairs_need_an_mxfp4_config(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no quantization_config of quant_method 'mxfp4'"):
        open_source(str(_variant(checkpoints, tmp_path, quantization=None)))


def test_blocks_without_scales_are_refused(checkpoints: tuple[Path, Path],
                                           tmp_path: Path) -> None:
    path = _variant(checkpoints, tmp_path, drop="model.layers.1.mlp.experts.down_proj_scales")
    with pytest.raises(SourceError, match=r"down_proj_blocks has no model\.layers\.1\.mlp\."
                                          r"experts\.down_proj_scales beside it"):
        open_source(str(path))


def test_scales_of_another_shape_are_refused(checkpoints: tuple[Path, Path],
                                             tmp_path: Path) -> None:
    name = "model.layers.0.mlp.experts.gate_up_proj_scales"
    path = _variant(checkpoints, tmp_path,
                    change=(name, torch.zeros(EXPERTS, 64, 1, dtype=torch.uint8)))
    with pytest.raises(SourceError, match=r"gate_up_proj_scales has shape \[4, 64, 1\]"):
        open_source(str(path))


def test_a_pair_the_config_does_not_fit_is_refused(checkpoints: tuple[Path, Path],
                                                   tmp_path: Path) -> None:
    path = _variant(checkpoints, tmp_path, config={"moe_intermediate_size": 64})
    with pytest.raises(SourceError, match=r"layers\.0\.mlp\.experts\.down_proj reads as "
                                          r"\[4, 64, 32\].*config makes it \[4, 64, 64\]"):
        open_source(str(path))
    fewer = _variant(checkpoints, tmp_path / "fewer", config={"num_local_experts": 2})
    with pytest.raises(SourceError, match="layer 0 stores 4 experts"):
        open_source(str(fewer))


def test_a_pair_of_another_tensor_is_refused(checkpoints: tuple[Path, Path],
                                             tmp_path: Path) -> None:
    path = _variant(checkpoints, tmp_path, change=(
        "model.layers.0.self_attn.q_proj.weight_blocks", torch.zeros(64, 2, 16, dtype=torch.uint8)))
    with pytest.raises(SourceError, match=r"q_proj\.weight is stored in MXFP4.*experts' "
                                          "gate_up_proj and down_proj only"):
        open_source(str(path))


def test_weights_beyond_float32_are_refused_when_read(checkpoints: tuple[Path, Path],
                                                      tmp_path: Path) -> None:
    name = "model.layers.1.mlp.experts.down_proj"
    scales = load_file(checkpoints[0] / "model.safetensors")[name + "_scales"].clone()
    scales[0, 0, 0] = 255  # E8M0's NaN: 2**128
    source = open_source(str(_variant(checkpoints, tmp_path, change=(name + "_scales", scales))))
    with pytest.raises(SourceError, match="beyond float32's range"):
        source.get(name)
