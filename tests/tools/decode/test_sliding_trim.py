"""tools/decode/sliding_trim's refusals (its run on the real Gemma 3 270M is
tests/exporter/test_export_gemma3.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from tools.decode import sliding_trim


@pytest.mark.parametrize(("options", "match"), [
    (dict(against="cuda"), "--against takes one of hf, paged"),
    (dict(prompt_tokens=0), "must be at least 1"),
    (dict(new_tokens=0), "must be at least 1"),
    ({}, "states no trimmable sliding layers"),  # the tiny Llama slides nowhere
])
def test_bad_options_and_an_export_without_sliding_layers_are_refused(
        dp_export2: Path, options: dict, match: str) -> None:
    with pytest.raises(typer.BadParameter, match=match):
        sliding_trim.main(dp_export2, **options)
