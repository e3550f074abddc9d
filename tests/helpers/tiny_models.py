"""Tiny random Llama-family models and a tiny tokenizer, built by the tests themselves."""

from __future__ import annotations

from pathlib import Path

from tools.harness.random_llama import build_tokenizer


def build_llama(out_dir: Path, *, layers: int = 4, hidden: int = 64, heads: int = 4,
                kv_heads: int = 2, intermediate: int = 128, vocab: int = 384, tied: bool = True,
                rope_parameters: dict | None = None, arch: str = "llama", seed: int = 0,
                context: int = 512, norm_spread: float = 0.0, bias_spread: float = 0.0,
                **options: object) -> Path:
    """Save a random model (weights scaled up so greedy output is not degenerate) whose
    context is ``context`` tokens. ``norm_spread``: the RMSNorm weights drawn around 1 with
    that spread (not all ones, so a norm applied to the wrong tensor shows); ``bias_spread``:
    every bias and attention sink (gpt-oss) drawn with that spread, not the initial zeros or
    small values, so a bias or sink left out shows; ``options``:
    more fields of the family's config (e.g. Qwen3's ``head_dim``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        arch,
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=context, tie_word_embeddings=tied, initializer_range=0.25,
        bos_token_id=0, eos_token_id=3,
        **({"rope_parameters": rope_parameters} if rope_parameters else {}), **options,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if norm_spread and name.endswith("norm.weight"):
                weight.copy_(1 + norm_spread * torch.randn_like(weight))
            if bias_spread and name.endswith(("bias", ".sinks")):
                weight.copy_(bias_spread * torch.randn_like(weight))
    model.save_pretrained(out_dir)
    build_tokenizer(out_dir, vocab_size=vocab)
    return out_dir


def build_gemma3_multimodal(out_dir: Path, *, layers: int = 7, norm_spread: float = 0.3,
                            seed: int = 0, **text_options: object) -> Path:
    """Save a random ``Gemma3ForConditionalGeneration`` (as Gemma 3 from 4B up is published:
    a vision tower and projector beside the text model) whose text model is the tiny Gemma
    3 build_llama makes with these options, norms drawn around 1 with ``norm_spread``."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3Config

    torch.manual_seed(seed)
    text = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                initializer_range=0.25, bos_token_id=0, eos_token_id=3, pad_token_id=None,
                **text_options)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=380, boi_token_index=381, eoi_token_index=382,
                          initializer_range=0.25)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if norm_spread and name.endswith("norm.weight"):
                weight.copy_(1 + norm_spread * torch.randn_like(weight))
    model.save_pretrained(out_dir)
    build_tokenizer(out_dir, vocab_size=384)
    return out_dir
