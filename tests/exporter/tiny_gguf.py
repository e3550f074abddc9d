"""A tiny Hugging Face model written as a float32 GGUF file, with llama.cpp's names and
metadata keys (the gguf package's), so the GGUF source can be checked against the model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_gguf(model_dir: Path, out: Path, key_length: int | None = None,
               sliding_pattern: int | list[bool] | None = None) -> Path:
    """``model_dir`` (a model the tests built: its config, safetensors and byte-level BPE
    tokenizer) as the GGUF file ``out``; its heads' width stated as llama.cpp does (or as
    ``key_length``, a file that contradicts itself). Gemma 3: its norms' weights stored
    plus one, as llama.cpp stores them, with its sliding window, the sliding layers' RoPE
    base, the global layers' RoPE scaling and ``sliding_pattern`` (which layers slide)."""
    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    # (not Llama: llama.cpp permutes its Q and K rows, which this does not)
    arch = {"qwen3": gguf.MODEL_ARCH.QWEN3, "phi3": gguf.MODEL_ARCH.PHI3,
            "gemma3_text": gguf.MODEL_ARCH.GEMMA3}[config.model_type]
    gemma = config.model_type == "gemma3_text"
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if gemma:
        rope = config.rope_parameters
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        if rope["full_attention"]["rope_type"] == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
        writer.add_sliding_window(config.sliding_window)
        if sliding_pattern is not None:
            writer.add_sliding_window_pattern(sliding_pattern)
    else:
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(key_length or head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)

    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    ids = {**tokenizer["model"]["vocab"], **{t["content"]: t["id"] for t in tokenizer["added_tokens"]}}
    tokens = sorted(ids, key=ids.__getitem__)
    specials = {t["id"] for t in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                             for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(1)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if gemma and name.endswith("norm.weight"):
            tensor = tensor + 1
        if gemma and name == "lm_head.weight":  # tied: llama.cpp writes the embedding only
            continue
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")),
                          tensor.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
