"""Mixture-of-experts models from GGUF files: a Qwen3-MoE file (llama.cpp's layout, as
its converter writes it) exports exactly at f32 and its Q8_0 weights come back as GGUF
dequantizes them, with the experts' width and routing the file states; a gpt-oss file,
which transformers' GGUF loader reads wrong, is refused by name before a stage is
written, and so is any file whose tensors the loader leaves unread."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from exporter.export import export_model
from exporter.sources import GGUFSource, SourceError, open_source
from exporter.verify import DEFAULT_PROMPTS, verify_export
from tests.exporter.tiny_gguf import write_gguf
from tests.helpers.tiny_models import build_llama

TOKENS = 32
EXPERTS, ACTIVE, EXPERT_WIDTH = 8, 2, 32
# every layer sparse (llama.cpp's qwen3moe has no dense layers); the routing weights
# renormalised, as llama.cpp's qwen3moe computes them
QWEN3_MOE = dict(arch="qwen3_moe", head_dim=24, moe_intermediate_size=EXPERT_WIDTH,
                 num_experts=EXPERTS, num_experts_per_tok=ACTIVE, norm_topk_prob=True)
SPLIT = [(0, 1), (1, 3), (3, 4)]
GPT_OSS = dict(arch="gpt_oss", layers=2, head_dim=16, intermediate=EXPERT_WIDTH,
               num_local_experts=EXPERTS, num_experts_per_tok=ACTIVE, sliding_window=8,
               pad_token_id=None)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama(tmp_path_factory.mktemp("qwen3_moe") / "model", tied=False,
                       norm_spread=0.3, **QWEN3_MOE)


@pytest.mark.slow
def test_a_qwen3_moe_gguf_file_exports_hfs_greedy_tokens(qwen3_moe: Path,
                                                         tmp_path: Path) -> None:
    """transformers' loader drops the experts' width (expert_feed_forward_length) and
    takes its config's 768: the source takes it from the file, and the f32 file cut in 3
    uneven stages gives the Hugging Face model's greedy tokens over 32 tokens for 5
    prompts."""
    source = open_source(str(write_gguf(qwen3_moe, tmp_path / "f32.gguf")))
    want = open_source(str(qwen3_moe))
    assert source.architecture == "qwen3_moe"
    assert replace(source.decoder_shape(), rms_norm_eps=0) == replace(want.decoder_shape(),
                                                                      rms_norm_eps=0)
    export_model(source, SPLIT, "fp32", tmp_path / "export")
    results = verify_export(tmp_path / "export", DEFAULT_PROMPTS, max_new_tokens=TOKENS,
                            hf_model=want.load_hf_model())
    assert [r.matched for r in results] == [TOKENS] * len(DEFAULT_PROMPTS)
    assert len(set(results[0].chain)) > 8  # not degenerate: a constant stream hides bugs


def test_a_q8_0_qwen3_moe_gguf_file_gives_its_dequantized_experts(qwen3_moe: Path,
                                                                 tmp_path: Path) -> None:
    """Every matrix of a Q8_0 file (the experts stacked gate rows first) comes back as
    GGUF dequantizes it: within Q8_0's rounding of the model's, not equal to it."""
    from gguf import GGMLQuantizationType, quants

    source = open_source(str(write_gguf(qwen3_moe, tmp_path / "q8.gguf", weights="Q8_0")))
    want = open_source(str(qwen3_moe))
    assert source.decoder_shape().expert_intermediate == EXPERT_WIDTH
    names = ["model.embed_tokens.weight", "lm_head.weight"] + [
        f"model.layers.{i}.{n}" for i in range(4) for n in (
            "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "self_attn.q_proj.weight",
            "self_attn.o_proj.weight")]
    for name in names:
        weights = want.require(name)
        q8 = quants.dequantize(quants.quantize(weights.numpy(), GGMLQuantizationType.Q8_0),
                               GGMLQuantizationType.Q8_0)
        got = source.require(name)
        assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(q8))), name
        assert not torch.equal(got, weights), name
    router = "model.layers.1.mlp.gate.weight"  # kept f32
    assert torch.equal(source.require(router), want.require(router))


def test_a_qwen3_moe_gguf_file_stating_no_experts_width_has_its_stored_experts(
        qwen3_moe: Path, tmp_path: Path) -> None:
    path = write_gguf(qwen3_moe, tmp_path / "f32.gguf", expert_width=False)
    assert open_source(str(path)).decoder_shape().expert_intermediate == EXPERT_WIDTH


@pytest.mark.parametrize("normalised", [True, False])
def test_a_qwen3_moe_gguf_file_stating_its_routing_is_read_so(qwen3_moe: Path, tmp_path: Path,
                                                              normalised: bool) -> None:
    """A file stating expert_weights_norm gets that routing (one stating none: llama.cpp's
    renormalised top-k, test above)."""
    path = write_gguf(qwen3_moe, tmp_path / "f32.gguf",
                      metadata={"expert_weights_norm": normalised})
    assert open_source(str(path)).decoder_shape().norm_topk_prob is normalised


def test_a_gguf_file_whose_tensors_the_loader_leaves_unread_is_refused(tmp_path: Path) -> None:
    """Whatever the architecture, a tensor transformers' loader does not read from the file
    (left at its random initial value) refuses the file, naming the tensors: here a
    gpt-oss file without YaRN given to transformers' loader (which open_source does not do:
    the exporter reads gpt-oss files itself, tests/exporter/test_gpt_oss_gguf.py)."""
    model_dir = build_llama(tmp_path / "model", tied=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                            **GPT_OSS)
    path = write_gguf(model_dir, tmp_path / "gpt-oss.gguf")
    with pytest.raises(SourceError, match="transformers' GGUF loader reads no model.layers.0."
                       "mlp.experts.down_proj, .* and \\d+ more from this gpt-oss file"):
        GGUFSource(path)
