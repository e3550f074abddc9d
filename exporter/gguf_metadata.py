"""What llama.cpp's GGUF metadata keys mean where more than one family reads them, and
which of its tensor types the exporter reads."""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np


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


def listed(names: list[str]) -> str:
    """The first four of ``names``, and how many more, for an error message."""
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


@cache
def dequantizable(kind: str) -> bool:
    """The gguf package dequantizes GGML type ``kind`` (tried on one zero block)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

    try:
        qtype = GGMLQuantizationType[kind]
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except (KeyError, NotImplementedError, ValueError):
        return False
    return True


def check_readable_types(tensor_types: dict[str, str], location: str) -> None:
    """GgufError naming the tensors (GGUF name: GGML type name) of a type the exporter does
    not read: it reads what the gguf package dequantizes, as transformers' GGUF loader
    does."""
    unread = sorted(f"{name} ({kind})" for name, kind in tensor_types.items()
                    if not dequantizable(kind))
    if unread:
        raise GgufError(f"{location}: tensors of a GGML type the exporter does not read: "
                        f"{listed(unread)} (it reads the types the gguf package dequantizes: "
                        "F32, F16, BF16, Q8_0, MXFP4, the k-quants, ...)")
