"""gpt-oss from GGUF files in llama.cpp's layout (the `gguf` package's names, its
converter's de-interleaved experts): the exporter reads them itself. An F32 file gives the
Hugging Face model's tensors and greedy tokens, cut in 3 uneven stages; a file with MXFP4
(or Q8_0) experts gives them as GGUF dequantizes them, and the greedy tokens of the model
built from them; the config is the one the metadata states; a file whose tensors do not
match its metadata, or of a type the exporter does not read, is refused before a stage is
written."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from exporter.export import export_model
from exporter.gguf_gpt_oss import SWIGLU_LIMIT, interleave
from exporter.sources import GptOssGGUFSource, SourceError, open_source
from exporter.verify import DEFAULT_PROMPTS, hf_greedy, verify_export
from tests.exporter.exactness import one_torch_thread, runner_chains  # noqa: F401 - its fixture
from tests.exporter.tiny_gguf import write_gguf
from tests.helpers.tiny_models import build_llama
from zctl.engine.scheduler import generate_greedy
from zctl.engine.tokenizer import ChatTokenizer

TOKENS = 32
LAYERS, EXPERTS, ACTIVE, EXPERT_WIDTH, LIMIT, WINDOW = 4, 8, 2, 32, 1.5, 8
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}
GPT_OSS = dict(arch="gpt_oss", layers=LAYERS, head_dim=16, intermediate=EXPERT_WIDTH,
               num_local_experts=EXPERTS, num_experts_per_tok=ACTIVE, sliding_window=WINDOW,
               swiglu_limit=LIMIT, rope_parameters=YARN, pad_token_id=None)
# the file states the model's SwiGLU clamp (llama.cpp's key; gpt-oss's files rely on its 7)
STATED = {"swiglu_clamp_exp": [LIMIT] * LAYERS}
SPLIT = [(0, 1), (1, 3), (3, 4)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Norms not all ones, every bias and sink well away from zero (one read wrong, or
    left at its initial value, changes the tokens)."""
    return build_llama(tmp_path_factory.mktemp("gpt_oss") / "model", tied=False,
                       norm_spread=0.3, bias_spread=0.5, **GPT_OSS)


def _gguf(model_dir: Path, path: Path, **options: object) -> GptOssGGUFSource:
    source = open_source(str(write_gguf(model_dir, path, **{"metadata": STATED, **options})))
    assert isinstance(source, GptOssGGUFSource)
    return source


def test_the_config_is_the_one_the_metadata_states(model_dir: Path, tmp_path: Path) -> None:
    """YaRN (gpt-oss's beta fast and slow, not truncated), the window over every other
    layer from the first, the experts, the clamp: the same decoder shape and RoPE as the
    Hugging Face directory's (rms_norm_eps stored in float32)."""
    source = _gguf(model_dir, tmp_path / "f32.gguf")
    want = open_source(str(model_dir))
    assert source.config.rope_parameters == YARN
    assert source.config.layer_types == want.config.layer_types
    assert replace(source.decoder_shape(), rms_norm_eps=0) == replace(want.decoder_shape(),
                                                                      rms_norm_eps=0)
    assert source.rope() == want.rope()
    assert source.eos_token_ids() == want.eos_token_ids()
    unstated = _gguf(model_dir, tmp_path / "unstated.gguf", metadata={})
    assert unstated.decoder_shape().clamped_swiglu.limit == SWIGLU_LIMIT == 7.0


def test_a_file_stating_its_sliding_layers_has_them(model_dir: Path, tmp_path: Path) -> None:
    pattern = {**STATED, "attention.sliding_window_pattern": [False, True, True, False]}
    source = _gguf(model_dir, tmp_path / "f32.gguf", metadata=pattern)
    assert source.decoder_shape().sliding_layers == (1, 2)


@pytest.mark.parametrize("fused", [False, True])
def test_an_f32_file_gives_the_models_tensors(model_dir: Path, tmp_path: Path,
                                              fused: bool) -> None:
    """Every tensor, gate and up interleaved again from the experts stored apart (or fused,
    gate rows first), the expert weights transposed back, equals the model's."""
    source = _gguf(model_dir, tmp_path / "f32.gguf", fused_experts=fused)
    want = open_source(str(model_dir))
    assert sorted(source.tensor_names()) == sorted(want.tensor_names())
    for name in want.tensor_names():
        assert torch.equal(source.require(name), want.require(name)), name


def test_a_file_storing_no_lm_head_ties_it_to_the_embedding(model_dir: Path,
                                                             tmp_path: Path) -> None:
    """llama.cpp runs a model without ``output.weight`` on its token embedding."""
    source = _gguf(model_dir, tmp_path / "tied.gguf", leave_out=("output.weight",))
    assert source.config.tie_word_embeddings
    embedding = source.require("model.embed_tokens.weight")
    assert torch.equal(source.require("lm_head.weight"), embedding)
    assert torch.equal(source.load_hf_model().lm_head.weight, embedding)


@pytest.mark.parametrize("weights", ["Q8_0", "MXFP4"])
def test_quantized_experts_come_back_as_gguf_dequantizes_them(model_dir: Path, tmp_path: Path,
                                                             weights: str) -> None:
    """A layer's experts stored in Q8_0 or MXFP4 come back as the gguf package's round trip
    of the model's (gate and up quantized apart, as stored): within its rounding, not equal;
    the router stays f32."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[weights]

    def round_trip(stored: torch.Tensor) -> torch.Tensor:
        values = quants.dequantize(quants.quantize(stored.contiguous().numpy(), qtype), qtype)
        return torch.from_numpy(np.ascontiguousarray(values))

    source = _gguf(model_dir, tmp_path / "q.gguf", weights=weights)
    want = open_source(str(model_dir))
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}.mlp."
        gate_up = want.require(prefix + "experts.gate_up_proj").transpose(1, 2)
        expected = interleave(round_trip(gate_up[:, ::2]), round_trip(gate_up[:, 1::2]))
        got = source.require(prefix + "experts.gate_up_proj")
        assert torch.equal(got, expected.transpose(1, 2)), layer
        down = want.require(prefix + "experts.down_proj")
        assert torch.equal(source.require(prefix + "experts.down_proj"),
                           round_trip(down.transpose(1, 2)).transpose(1, 2)), layer
        assert not torch.equal(got, want.require(prefix + "experts.gate_up_proj"))
        assert torch.equal(source.require(prefix + "router.weight"),
                           want.require(prefix + "router.weight"))


@pytest.mark.slow
def test_an_f32_file_exports_hfs_greedy_tokens(model_dir: Path, tmp_path: Path) -> None:
    """The F32 file cut in 3 uneven stages gives the Hugging Face directory's model's greedy
    tokens over 32 tokens for 5 prompts."""
    export_model(_gguf(model_dir, tmp_path / "f32.gguf"), SPLIT, "fp32", tmp_path / "export")
    results = verify_export(tmp_path / "export", DEFAULT_PROMPTS, max_new_tokens=TOKENS,
                            hf_model=open_source(str(model_dir)).load_hf_model())
    assert [r.matched for r in results] == [TOKENS] * len(DEFAULT_PROMPTS)
    assert len(set(results[0].chain)) > 8  # not degenerate: a constant stream hides bugs


@pytest.mark.slow
def test_an_mxfp4_file_exports_its_models_greedy_tokens(model_dir: Path,
                                                        tmp_path: Path) -> None:
    """The file with MXFP4 experts (as gpt-oss's released files), cut in 3 uneven stages,
    gives the greedy tokens of the Hugging Face model built from its weights over 32 tokens
    for 5 prompts, on the stateful runner (rewinding by mask and by trimming) and the paged
    one; tokens of their own, not the f32 model's. Its experts are exported exact
    (exporter.exact_experts: i8 codes), as the file's weights are MXFP4 values."""
    source = _gguf(model_dir, tmp_path / "mxfp4.gguf", weights="MXFP4")
    export_model(source, SPLIT, "fp32", tmp_path / "export", exact_experts=True)
    hf = source.load_hf_model()
    tokenizer = ChatTokenizer(tmp_path / "export")
    prompts = [tokenizer.encode(p, chat=True) for p in DEFAULT_PROMPTS]
    references = [hf_greedy(hf, ids, TOKENS) for ids in prompts]
    for runner, chain in runner_chains(tmp_path / "export").items():
        for ids, reference in zip(prompts, references, strict=True):
            assert list(generate_greedy(chain, ids, TOKENS)) == reference, runner
    f32 = open_source(str(model_dir)).load_hf_model()
    assert hf_greedy(f32, prompts[0], TOKENS) != references[0]


def _refused(path: Path, out: Path, match: str) -> None:
    with pytest.raises(SourceError, match=match):
        export_model(open_source(str(path)), SPLIT, "fp32", out)
    assert not out.exists()


@pytest.mark.parametrize(("options", "match"), [
    ({"expert_width": False, "metadata": {"expert_feed_forward_length": 48}},
     r"do not match its metadata .*blk\.0\.ffn_down_exps\.weight is \[8, 64, 32\], its "
     r"metadata makes it \[8, 64, 48\]"),
    ({"leave_out": ("blk.2.attn_sinks.weight",)},
     r"do not match its metadata .*: no blk\.2\.attn_sinks\.weight"),
    ({"fused_experts": True, "leave_out": ("blk.1.ffn_gate_up_exps.bias",)},
     r"no blk\.1\.ffn_gate_up_exps\.bias"),
    ({"metadata": {"swiglu_clamp_exp": [1.0, 2.0, 1.0, 1.0]}},
     r"swiglu_clamp_exp .* is not one limit for its 4 layers"),
    ({"metadata": {**STATED, "rope.scaling.yarn_log_multiplier": 0.1}},
     r"it states rope\.scaling\.yarn_log_multiplier, which the exporter does not read"),
    ({"rotated": 8}, r"its RoPE turns 8 of a head's 16 dimensions"),
    ({"tensor_types": {"blk.1.ffn_gate_inp.bias": "I8"}},
     r"a GGML type the exporter does not read: blk\.1\.ffn_gate_inp\.bias \(I8\) \(it "
     r"reads the types the gguf package dequantizes"),
])
def test_a_file_the_exporter_cannot_read_is_refused_before_a_stage_is_written(
        model_dir: Path, tmp_path: Path, options: dict, match: str) -> None:
    """Tensors of other shapes than the metadata makes, a tensor missing, a clamp per layer,
    a YaRN key gpt-oss's config has no counterpart for, a partial RoPE, a tensor of a type not read:
    refused by name, before any weight is read."""
    _refused(write_gguf(model_dir, tmp_path / "bad.gguf", **options), tmp_path / "out", match)


def test_mxfp4_weights_beyond_float32_are_refused_before_the_export_is_written(
        model_dir: Path, tmp_path: Path) -> None:
    """A block scale of 255 (2**127) on a code of 12: the stage asking for the tensor fails,
    naming it, and the export leaves no directory."""
    from gguf import GGUFReader

    path = write_gguf(model_dir, tmp_path / "mxfp4.gguf", weights="MXFP4", metadata=STATED)
    stored = {t.name: t for t in GGUFReader(path, "r+").tensors}["blk.0.ffn_up_exps.weight"]
    stored.data[0, 0, :2] = (255, 0x77)  # the first block: its scale, its first two codes
    stored.data.flush()
    _refused(path, tmp_path / "out",
             r"blk\.0\.ffn_up_exps\.weight \(MXFP4\) holds values beyond float32's range")


def test_a_file_of_another_rope_scaling_is_refused(tmp_path: Path) -> None:
    model_dir = build_llama(tmp_path / "model", tied=False,
                            **{**GPT_OSS, "layers": 2, "rope_parameters": {
                                "rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}})
    path = write_gguf(model_dir, tmp_path / "linear.gguf",
                      metadata={"rope.scaling.type": "linear"})
    _refused(path, tmp_path / "out", "its RoPE scaling is 'linear'")
