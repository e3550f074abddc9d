"""Tiny random Llama-family models and a tiny tokenizer, built by the tests themselves."""

from __future__ import annotations

from pathlib import Path

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


def build_llama(out_dir: Path, *, layers: int = 4, hidden: int = 64, heads: int = 4,
                kv_heads: int = 2, intermediate: int = 128, vocab: int = 384, tied: bool = True,
                rope_parameters: dict | None = None, arch: str = "llama", seed: int = 0) -> Path:
    """Save a random model (weights scaled up so greedy output is not degenerate)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        arch,
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=512, tie_word_embeddings=tied, initializer_range=0.25,
        bos_token_id=0, eos_token_id=3,
        **({"rope_parameters": rope_parameters} if rope_parameters else {}),
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(out_dir)
    build_tokenizer(out_dir, vocab_size=vocab)
    return out_dir
