"""A tiny Hugging Face model written as a float32 GGUF file, with llama.cpp's names and
metadata keys (the gguf package's), so the GGUF source can be checked against the model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_gguf(model_dir: Path, out: Path, key_length: int | None = None,
               sliding_pattern: int | list[bool] | None = None, weights: str = "F32",
               metadata: dict[str, object] | None = None, expert_width: bool = True,
               fused_experts: bool = False, tensor_types: dict[str, str] | None = None,
               leave_out: tuple[str, ...] = (), rotated: int | None = None) -> Path:
    """``model_dir`` (a model the tests built: its config, safetensors and byte-level BPE
    tokenizer) as the GGUF file ``out``; its heads' width stated as llama.cpp does (or as
    ``key_length``, a file that contradicts itself). Gemma 3: its norms' weights stored
    plus one, as llama.cpp stores them, with its sliding window, the sliding layers' RoPE
    base, the global layers' RoPE scaling and ``sliding_pattern`` (which layers slide).
    Qwen3-MoE and gpt-oss: their experts as llama.cpp's converter stores them (gate, up
    and down apart, ``[experts, out, in]``), with the experts' count, the number a token
    runs and their width; gpt-oss with its sliding window and YaRN. ``weights``: the GGML
    type of the matrices but the router (``Q8_0``; ``MXFP4``: gpt-oss's experts only, as in
    its released files); ``metadata``: more ``{arch}.…`` keys (an int, float, bool, string or
    list each); ``expert_width``: False for a file that does not state its experts' width;
    ``fused_experts``: gpt-oss's gate and up experts stored as one ``ffn_gate_up_exps``
    (gate rows first), as llama.cpp's converter may; ``tensor_types``: the GGML type of
    tensors by GGUF name (``I8``: its values cast to int8); ``leave_out``: GGUF names not
    written; ``rotated``: the RoPE dimensions stated (else the heads' width)."""
    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    # (not Llama: llama.cpp permutes its Q and K rows, which this does not)
    arch = {"qwen3": gguf.MODEL_ARCH.QWEN3, "phi3": gguf.MODEL_ARCH.PHI3,
            "gemma3_text": gguf.MODEL_ARCH.GEMMA3, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
            "gpt_oss": gguf.MODEL_ARCH.GPT_OSS}[config.model_type]
    gemma = config.model_type == "gemma3_text"
    gpt_oss = config.model_type == "gpt_oss"
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
    if gpt_oss:
        rope = config.rope_parameters
        if rope["rope_type"] == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(rope["factor"])
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_sliding_window(config.sliding_window)
    if config.model_type in ("qwen3_moe", "gpt_oss"):
        experts = getattr(config, "num_experts", None) or config.num_local_experts
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if expert_width:
            writer.add_expert_feed_forward_length(
                getattr(config, "moe_intermediate_size", None) or config.intermediate_size)
    for key, value in (metadata or {}).items():
        add = {bool: writer.add_bool, int: writer.add_uint32, float: writer.add_float32,
               str: writer.add_string, list: writer.add_array}
        add[type(value)](f"{gguf.MODEL_ARCH_NAMES[arch]}.{key}", value)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(key_length or head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(rotated or head_dim)

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

    def add(gguf_name: str, tensor: torch.Tensor, expert: bool = False) -> None:
        data = tensor.numpy().astype(np.float32)
        # the router stays f32, as llama.cpp's converter keeps it
        quantized = data.ndim > 1 and "ffn_gate_inp" not in gguf_name
        kind = weights if quantized and (expert or weights != "MXFP4") else "F32"
        kind = (tensor_types or {}).get(gguf_name, kind)
        if gguf_name in leave_out:
            return
        if kind == "I8":
            writer.add_tensor(gguf_name, data.astype(np.int8),
                              raw_dtype=gguf.GGMLQuantizationType.I8)
            return
        if kind == "F32":
            writer.add_tensor(gguf_name, data)
            return
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    for name, tensor in model.state_dict().items():
        if gemma and name.endswith("norm.weight"):
            tensor = tensor + 1
        if gemma and name == "lm_head.weight":  # tied: llama.cpp writes the embedding only
            continue
        if ".mlp.experts." in name:
            for gguf_name, part in _experts(name, tensor, gpt_oss, fused_experts):
                add(gguf_name, part, expert=part.ndim == 3)
            continue
        if gpt_oss and name.endswith(".sinks"):
            name += ".weight"
        add(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _experts(name: str, tensor, gpt_oss: bool, fused: bool) -> list[tuple[str, object]]:
    """A layer's stacked experts' tensor as llama.cpp's converter writes it: gate, up and
    down apart, each ``[experts, out, in]`` (gpt-oss's are stored transposed, its gate and
    up interleaved column by column, as are their biases), or (``fused``) gate and up as
    one, gate rows first."""
    import torch

    layer = name.split(".")[2]
    prefix = f"blk.{layer}.ffn"
    if name.endswith("gate_up_proj"):
        whole = tensor.transpose(1, 2) if gpt_oss else tensor
        gate, up = (whole[:, ::2], whole[:, 1::2]) if gpt_oss else whole.chunk(2, dim=1)
        if fused:
            return [(f"{prefix}_gate_up_exps.weight", torch.cat((gate, up), dim=1))]
        return [(f"{prefix}_gate_exps.weight", gate.contiguous()),
                (f"{prefix}_up_exps.weight", up.contiguous())]
    if name.endswith("gate_up_proj_bias"):
        if fused:
            return [(f"{prefix}_gate_up_exps.bias",
                     torch.cat((tensor[:, ::2], tensor[:, 1::2]), dim=1))]
        return [(f"{prefix}_gate_exps.bias", tensor[:, ::2].contiguous()),
                (f"{prefix}_up_exps.bias", tensor[:, 1::2].contiguous())]
    if name.endswith("down_proj"):
        return [(f"{prefix}_down_exps.weight",
                 tensor.transpose(1, 2).contiguous() if gpt_oss else tensor)]
    if name.endswith("down_proj_bias"):
        return [(f"{prefix}_down_exps.bias", tensor)]
    raise ValueError(f"{name}: not an experts' tensor this writer knows")
