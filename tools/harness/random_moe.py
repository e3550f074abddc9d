"""Write a random-weight Qwen3-MoE checkpoint of Qwen3-30B-A3B's layer shape (hidden 2048,
32 query heads and 4 KV heads of 128, experts 768 wide, 8 of them active), with any number
of experts and layers, or the same layers with a dense MLP in place of the experts.

Tensors are float16 safetensors, a file per tensor, the experts stored stacked
([experts, out, in], as Hugging Face's model holds them), so writing never holds more than
one tensor in memory. The vocabulary is small (the benchmarks time the decoder layers, not
the LM head) and the tokenizer a small trained BPE one.

    python -m tools.harness.random_moe OUT_DIR [--experts 128] [--layers 1] [--dense]
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import typer

from tools.harness.random_llama import build_tokenizer

LAYER_SHAPE = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                   head_dim=128, moe_intermediate_size=768, num_experts_per_tok=8,
                   vocab_size=1024, rms_norm_eps=1e-6, norm_topk_prob=True,
                   tie_word_embeddings=False, max_position_embeddings=4096,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
INIT_STD = 0.02


def write_random_moe(out_dir: Path, experts: int = 128, layers: int = 1, dense: bool = False,
                     seed: int = 0) -> Path:
    """The checkpoint in ``out_dir``. ``dense``: every layer's MLP dense and
    ``experts`` x 768 wide, as many MLP weights as ``experts`` experts (the dense model of
    the same total parameters)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    s = LAYER_SHAPE
    h, width = s["hidden_size"], s["moe_intermediate_size"]
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    weight_map: dict[str, str] = {}

    def save(name: str, *dims: int, ones: bool = False) -> None:
        value = (np.ones(dims, np.float16) if ones else
                 (rng.standard_normal(dims, dtype=np.float32) * INIT_STD).astype(np.float16))
        file_name = f"{name}.safetensors"
        save_file({name: value}, str(out_dir / file_name))
        weight_map[name] = file_name

    save("model.embed_tokens.weight", s["vocab_size"], h)
    for layer in range(layers):
        p = f"model.layers.{layer}."
        save(p + "input_layernorm.weight", h, ones=True)
        save(p + "post_attention_layernorm.weight", h, ones=True)
        save(p + "self_attn.q_proj.weight", q, h)
        save(p + "self_attn.k_proj.weight", kv, h)
        save(p + "self_attn.v_proj.weight", kv, h)
        save(p + "self_attn.o_proj.weight", h, q)
        save(p + "self_attn.q_norm.weight", s["head_dim"], ones=True)
        save(p + "self_attn.k_norm.weight", s["head_dim"], ones=True)
        if dense:
            save(p + "mlp.gate_proj.weight", experts * width, h)
            save(p + "mlp.up_proj.weight", experts * width, h)
            save(p + "mlp.down_proj.weight", h, experts * width)
        else:
            save(p + "mlp.gate.weight", experts, h)
            save(p + "mlp.experts.gate_up_proj", experts, 2 * width, h)
            save(p + "mlp.experts.down_proj", experts, h, width)
    save("model.norm.weight", h, ones=True)
    save("lm_head.weight", s["vocab_size"], h)
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
              "num_hidden_layers": layers, "num_experts": experts,
              "intermediate_size": experts * width, "decoder_sparse_step": 1,
              "mlp_only_layers": list(range(layers)) if dense else [],
              "bos_token_id": 0, "eos_token_id": 3, "torch_dtype": "float16", **s}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    build_tokenizer(out_dir)
    return out_dir


def main(out_dir: Path, experts: int = 128, layers: int = 1, dense: bool = False,
         seed: int = 0) -> None:
    write_random_moe(out_dir, experts, layers, dense, seed)
    print(out_dir)


if __name__ == "__main__":
    typer.run(main)
