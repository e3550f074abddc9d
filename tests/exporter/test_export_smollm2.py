"""Exports of the real default model (SmolLM2-135M-Instruct from its GGUF): a few minutes.

f32 stage chains for N = 1, 2 (uneven) and 3 stages reproduce Hugging Face greedy
decoding token for token; INT4 chains equal the INT4 single-stage export (with f32
activations: the CPU plugin's dynamic int8 quantization depends on where graphs are cut).
(Speculative decoding through a local cluster of them: tests/e2e/test_smollm2.py.)
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
F32_SPLITS = {1: [(0, 30)], 2: [(0, 10), (10, 30)], 3: [(0, 10), (10, 20), (20, 30)]}
PROMPTS = DEFAULT_PROMPTS[:4]


@pytest.fixture(scope="module")
def hf_model(smol):
    return smol[0].load_hf_model()


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_f32_chain_matches_hf_greedy(smol, hf_model, stages: int) -> None:
    source, root = smol
    out = root / f"f32-{stages}"
    export_model(source, F32_SPLITS[stages], "fp32", out)
    results = verify_export(out, PROMPTS, max_new_tokens=64, hf_model=hf_model)
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
