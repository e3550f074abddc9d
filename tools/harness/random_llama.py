"""Write a random-weight Llama checkpoint of a given shape, one layer at a time.

Used by the benchmarks for models with Llama-3.2-1B's and Llama-3.1-8B's shapes (no hub
here), and a tiny one that exports and serves in seconds (``--shape tiny``, the live
fuzzer's). Tensors
are written shard by shard as bf16 safetensors, so making a model never holds more
than one layer in memory. The tokenizer is borrowed from an existing export or HF
directory, or a small BPE tokenizer is trained on the spot (token ids stay below the
model's vocabulary, which is all that matters for timing).

    python -m tools.harness.random_llama OUT_DIR [--shape llama-3.2-1b] [--tokenizer-from DIR]
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import typer

SHAPES = {
    "llama-3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    ),
    # ~16 GB of bf16 weights on disk (~5 GB exported in INT4), written a layer at a time
    "llama-3.1-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    ),
    # Seconds to export and to serve: the live fuzzer's and the tests' scale of model.
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=384, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=512,
    ),
}
# Weights are drawn N(0, std): a tiny model needs a larger spread for its greedy output to
# vary from token to token (at 0.02 it repeats one token).
INIT_STD = {"tiny": 0.25}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "what is the capital of france? paris is the capital.",
    "def reverse(s): return s[::-1]",
    "once upon a time in a small village by the sea there lived a fisher",
    "explain why the sky is blue: rayleigh scattering of sunlight",
] * 20


def build_tokenizer(out_dir: Path, vocab_size: int = 384) -> None:
    """A byte-level BPE tokenizer with chat special tokens, saved as HF files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def _bf16(array: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (round to nearest even), as uint16 for safetensors' BF16."""
    bits = array.astype(np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def _save_shard(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Minimal safetensors writer for BF16 tensors (no torch needed)."""
    header, offset = {}, 0
    for name, value in tensors.items():
        size = value.nbytes
        header[name] = {"dtype": "BF16", "shape": list(value.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as handle:
        handle.write(len(raw).to_bytes(8, "little"))
        handle.write(raw)
        for value in tensors.values():
            handle.write(value.tobytes())


def write_random_llama(out_dir: Path, shape: str = "llama-3.2-1b", seed: int = 0,
                       tokenizer_from: Path | None = None) -> Path:
    cfg = SHAPES[shape]
    rng = np.random.default_rng(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def rand(*dims: int) -> np.ndarray:
        return _bf16(rng.standard_normal(dims, dtype=np.float32) * INIT_STD.get(shape, 0.02))

    weight_map: dict[str, str] = {}

    def save(name: str, tensors: dict[str, np.ndarray]) -> None:
        _save_shard(out_dir / name, tensors)
        weight_map.update(dict.fromkeys(tensors, name))

    save("embed.safetensors", {"model.embed_tokens.weight": rand(cfg["vocab_size"], h)})
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        save(f"layer{layer:03d}.safetensors", {
            p + "input_layernorm.weight": _bf16(np.ones(h, np.float32)),
            p + "post_attention_layernorm.weight": _bf16(np.ones(h, np.float32)),
            p + "self_attn.q_proj.weight": rand(heads * hd, h),
            p + "self_attn.k_proj.weight": rand(kv * hd, h),
            p + "self_attn.v_proj.weight": rand(kv * hd, h),
            p + "self_attn.o_proj.weight": rand(h, heads * hd),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        })
    save("norm.safetensors", {"model.norm.weight": _bf16(np.ones(h, np.float32))})
    if not cfg["tie_word_embeddings"]:
        save("head.safetensors", {"lm_head.weight": rand(cfg["vocab_size"], h)})
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
              "max_position_embeddings": 131072, "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "bfloat16", **cfg}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer_from is None:
        build_tokenizer(out_dir, vocab_size=min(cfg["vocab_size"], 384))
    else:
        for name in TOKENIZER_FILES:
            if (tokenizer_from / name).is_file():
                shutil.copy(tokenizer_from / name, out_dir / name)
    return out_dir


def main(out_dir: Path, shape: str = "llama-3.2-1b", seed: int = 0,
         tokenizer_from: Path | None = None) -> None:
    write_random_llama(out_dir, shape, seed, tokenizer_from)
    print(out_dir)


if __name__ == "__main__":
    typer.run(main)
