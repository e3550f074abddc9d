"""What llama.cpp's GGUF metadata keys mean where more than one family reads them."""

from __future__ import annotations

from typing import Any


class GgufError(ValueError):
    """A GGUF file whose metadata or tensors the exporter cannot read as its family's."""


def sliding_layer_flags(pattern: Any, layers: int, location: str) -> list[bool]:
    """Which of ``layers`` layers slide, from an ``attention.sliding_window_pattern``: every
    n-th layer global (an int n >= 1), or a flag per layer (true: sliding)."""
    if isinstance(pattern, list):
        sliding = [bool(flag) for flag in pattern]
    elif int(pattern) >= 1:
        sliding = [bool((i + 1) % int(pattern)) for i in range(layers)]
    else:
        raise GgufError(f"{location}: its sliding_window_pattern is {pattern}")
    if len(sliding) != layers:
        raise GgufError(f"{location}: its sliding_window_pattern has {len(sliding)} layers, "
                        f"its block_count {layers}")
    return sliding
