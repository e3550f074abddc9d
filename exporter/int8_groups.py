"""INT8 weights in symmetric i8 groups (llama.cpp's Q8_0 idea), through NNCF's algorithm.

The one place the exporter calls NNCF's internal ``compress_weights_impl``: NNCF's public
``compress_weights`` refuses a group size for its INT8 modes ("INT8 modes require
per-channel quantization"), but its algorithm writes the grouped form when called past
that check. Each compressed weight then becomes, for a MatMul of K inputs in groups of g:

    i8 [N, K/g, g] -> Convert f16 -> Multiply by f16 scales [N, K/g, 1] -> Reshape [N, K]

(then a Convert to f32), no zero point. The group of each MatMul is ``int8_group``
(zctl.weights, shared with the node profile's synthetic stage): 128 where it divides K,
else 64, else 32; a weight none of them divides is left to NNCF's
backup, u8 per output channel with a zero point (INT8 before groups). NNCF does that
choice itself (its ADJUST fallback: the largest power of two dividing K, at least 32);
tests/exporter/test_int8_groups.py checks that it still matches ``int8_group`` and that
the graph keeps the form above, so a new NNCF that changes either fails there.

Only the NNCF versions in ``CHECKED_NNCF_VERSIONS`` are used; any other is refused with
an error naming it (the internal function's signature is no promise).
"""

from __future__ import annotations

from collections.abc import Sequence

import openvino as ov

from zctl.weights import INT8_GROUP_SIZES

CHECKED_NNCF_VERSIONS = ("3.4.0",)
LARGEST_GROUP = INT8_GROUP_SIZES[0]
SMALLEST_GROUP = INT8_GROUP_SIZES[-1]


class UncheckedNncfError(RuntimeError):
    """The installed NNCF is not a version the grouped INT8 call was checked against."""


def check_nncf_version(version: str | None = None) -> str:
    """The installed NNCF's version (or ``version``); UncheckedNncfError unless checked."""
    if version is None:
        import nncf

        version = nncf.__version__
    if version not in CHECKED_NNCF_VERSIONS:
        raise UncheckedNncfError(
            f"INT8 exports compress through NNCF's internal compress_weights_impl, checked "
            f"with nncf {', '.join(CHECKED_NNCF_VERSIONS)}; this is nncf {version}: install "
            f"nncf=={CHECKED_NNCF_VERSIONS[-1]} (zctl's pinned version)")
    return version


def compress_int8_groups(model: ov.Model, ignored_patterns: Sequence[str] = ()) -> ov.Model:
    """``model`` with every float MatMul/Gather weight not matched by ``ignored_patterns``
    (NNCF IgnoredScope regular expressions) in symmetric i8 groups (``int8_group``)."""
    check_nncf_version()
    from nncf import CompressWeightsMode, IgnoredScope
    from nncf.openvino.quantization.quantize_model import compress_weights_impl
    from nncf.parameters import CompressionFormat
    from nncf.quantization.advanced_parameters import (
        AdvancedCompressionParameters,
        GroupSizeFallbackMode,
    )
    from nncf.quantization.algorithms.weight_compression.algorithm import (
        get_weight_compression_configuration,
    )

    # ADJUST: a MatMul LARGEST_GROUP does not divide takes the largest power of two that
    # does (64 or 32 here), and one below SMALLEST_GROUP the backup mode (u8 per channel)
    advanced = AdvancedCompressionParameters(
        group_size_fallback_mode=GroupSizeFallbackMode.ADJUST,
        min_adjusted_group_size=SMALLEST_GROUP)
    config = get_weight_compression_configuration(
        mode=CompressWeightsMode.INT8_SYM,
        ratio=1.0,
        group_size=LARGEST_GROUP,
        all_layers=True,  # a middle stage's last MatMul is no LM head
        ignored_scope=IgnoredScope(patterns=list(ignored_patterns), validate=False),
        advanced_parameters=advanced,
    )
    return compress_weights_impl(model=model, dataset=None, subset_size=128,
                                 compression_format=CompressionFormat.DQ, **config)
