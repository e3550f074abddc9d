"""``zctl verify``: the stage chain at f32 must reproduce Hugging Face greedy decoding.

The reference is a plain greedy loop over the HF model (no stopping on EOS, so both
sides produce exactly ``max_new_tokens``); the chain runs every stage in-process
with ``INFERENCE_PRECISION_HINT=f32`` and f32 KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from exporter.sources import DEFAULT_MODEL, ModelSource, open_source
from zctl.engine.scheduler import generate_greedy
from zctl.engine.tokenizer import ChatTokenizer
from zctl.manifest import ExportManifest, load_manifest

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain why the sky is blue in two sentences.",
    "List three uses of a paperclip.",
    "Once upon a time, in a small village by the sea,",
)

# f32 throughout: activations too (no dynamic int8 quantization, see RuntimeSpec)
EXACT_CONFIG = RuntimeSpec(precision="f32", kv_cache_precision="f32", dynamic_quantization=False)


@dataclass
class PromptResult:
    prompt: str
    reference: list[int]
    chain: list[int]

    @property
    def matched(self) -> int:
        """Number of leading tokens that agree."""
        for i, (a, b) in enumerate(zip(self.reference, self.chain, strict=False)):
            if a != b:
                return i
        return min(len(self.reference), len(self.chain))

    @property
    def exact(self) -> bool:
        return self.reference == self.chain


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from a Hugging Face causal LM, exactly max_new_tokens of them."""
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        token = int(logits[0, -1].argmax())
        out.append(token)
        ids = torch.tensor([[token]], dtype=torch.long)
    return out


def reference_source(manifest: ExportManifest, model: str | None,
                     cache_dir: Path | None = None) -> ModelSource:
    if model:
        return open_source(model, cache_dir)
    name = DEFAULT_MODEL if manifest.model.name == DEFAULT_MODEL else manifest.source
    return open_source(name, cache_dir)


def verify_export(
    export_dir: Path | str,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    max_new_tokens: int = 64,
    model: str | None = None,
    chat: bool = True,
    hf_model: torch.nn.Module | None = None,
    cache_dir: Path | None = None,
) -> list[PromptResult]:
    """Compare greedy tokens of the chain against the HF reference, prompt by prompt."""
    manifest = load_manifest(export_dir)
    if hf_model is None:
        hf_model = reference_source(manifest, model, cache_dir).load_hf_model()
    tokenizer = ChatTokenizer(export_dir)
    chain = LocalChain.load(str(export_dir), EXACT_CONFIG)
    results = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt, chat=chat)
        reference = hf_greedy(hf_model, ids, max_new_tokens)
        produced = list(generate_greedy(chain, ids, max_new_tokens))
        results.append(PromptResult(prompt, reference, produced))
    return results
