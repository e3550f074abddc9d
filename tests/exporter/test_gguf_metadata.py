"""Which layers slide, as a GGUF file's attention.sliding_window_pattern states it (Gemma 3's
and gpt-oss's files read it the same way)."""

from __future__ import annotations

import pytest

from exporter.gguf_metadata import GgufError, sliding_layer_flags


def test_every_nth_layer_is_global() -> None:
    assert sliding_layer_flags(2, 5, "f") == [True, False, True, False, True]
    assert sliding_layer_flags(3, 4, "f") == [True, True, False, True]


def test_a_flag_per_layer_is_taken_as_stated() -> None:
    assert sliding_layer_flags([0, 1, 1], 3, "f") == [False, True, True]


@pytest.mark.parametrize(("pattern", "match"), [
    (0, "f: its sliding_window_pattern is 0"),
    ([True, False], "f: its sliding_window_pattern has 2 layers, its block_count 3"),
])
def test_a_pattern_that_fits_no_layers_is_refused(pattern: object, match: str) -> None:
    with pytest.raises(GgufError, match=match):
        sliding_layer_flags(pattern, 3, "f")
