"""NNCF weight compression for one stage, identical whichever way the model was split.

Decoder-layer MatMuls get the chosen format (INT4 groups or INT8 channels) with
``all_layers=True`` so a middle stage's last MatMul is not mistaken for an LM head;
the embedding and LM head always get INT8 (as the monolithic default does), and so does a
mixture of experts' router. The experts' stacked [experts, out, in] weights are MatMul
weights like any other (exporter.moe_block): NNCF compresses them per group.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout

import openvino as ov

from zctl.weights import check_weight_format


@contextmanager
def numpy_compression() -> Iterator[None]:
    """Use NNCF's numpy path: 2x faster here than its OpenVINO-kernel path, which compiles
    a small model per weight shape. Set NNCF_DISABLE_OPTIMIZED_COMPRESSION yourself to
    choose; every stage of one export uses the same path either way."""
    key = "NNCF_DISABLE_OPTIMIZED_COMPRESSION"
    before = os.environ.get(key)
    os.environ.setdefault(key, "1")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)


def compress_stage(model: ov.Model, weight_format: str, group_size: int | None) -> ov.Model:
    """Return the model with weights compressed (int4/int8); fp16/fp32 are left as they are."""
    check_weight_format(weight_format)
    if weight_format in ("fp16", "fp32"):
        return model
    import nncf
    from nncf import CompressWeightsMode, IgnoredScope
    from nncf.common.logging.logger import set_log_level

    set_log_level(logging.ERROR)  # zctl reports progress itself; keep NNCF's tables out
    # the embedding, the LM head and a mixture of experts' router (a flipped argmax there
    # picks other experts) stay out of INT4, and get INT8
    head_and_embedding = IgnoredScope(patterns=[".*embed.*", ".*lm_head.*", r".*\.router/.*"],
                                      validate=False)
    # NNCF draws its progress bars on stdout, which belongs to the caller's output
    # (`zctl run --json` exporting on first use, the benchmarks' --json): send them to stderr.
    with numpy_compression(), redirect_stdout(sys.stderr):
        if weight_format == "int4":
            model = nncf.compress_weights(
                model,
                mode=CompressWeightsMode.INT4_ASYM,
                group_size=group_size,
                ratio=1.0,
                all_layers=True,
                ignored_scope=head_and_embedding,
            )
        # int8 for everything still in float: all MatMuls (int8) or just head/embedding (int4)
        return nncf.compress_weights(model, mode=CompressWeightsMode.INT8_ASYM)
