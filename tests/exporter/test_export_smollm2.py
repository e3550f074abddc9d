"""Exports of the real default model (SmolLM2-135M-Instruct from its GGUF): a few minutes.

An f32 chain of 2 uneven stages reproduces Hugging Face greedy decoding token for token
(chains of 1, 2 and 3 stages of the tiny model do too: tests/exporter/test_export.py);
INT4 chains equal the INT4 single-stage export (with f32 activations: the CPU plugin's
dynamic int8 quantization depends on where graphs are cut). (Speculative decoding
through a local cluster of them: tests/e2e/test_smollm2.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dataplane.head.local_chain import LocalChain
from exporter.export import export_model
from exporter.verify import DEFAULT_PROMPTS, EXACT_CONFIG, verify_export
from zctl.engine.scheduler import generate_greedy
from zctl.engine.tokenizer import ChatTokenizer

pytestmark = pytest.mark.slow
PROMPTS = DEFAULT_PROMPTS[:4]


def test_f32_chain_matches_hf_greedy(smol) -> None:
    source, root = smol
    out = root / "f32-2"
    export_model(source, [(0, 10), (10, 30)], "fp32", out)
    results = verify_export(out, PROMPTS, max_new_tokens=64, hf_model=source.load_hf_model())
    for result in results:
        assert result.exact, f"{result.prompt!r}: {result.matched}/64 tokens agree"


def _greedy(export_dir: Path, n: int = 48) -> list[list[int]]:
    tokenizer = ChatTokenizer(export_dir)
    chain = LocalChain.load(str(export_dir), EXACT_CONFIG)
    return [list(generate_greedy(chain, tokenizer.encode(p), n)) for p in PROMPTS]


def test_int4_chain_equals_int4_single_stage(smol_int4_exports) -> None:
    one_stage, three_stages = smol_int4_exports
    single = _greedy(one_stage)
    assert _greedy(three_stages) == single
    text = ChatTokenizer(one_stage).decode(single[0])
    assert "Paris" in text  # INT4 SmolLM2 still answers "What is the capital of France?"
