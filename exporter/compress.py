"""NNCF weight compression for one stage, identical whichever way the model was split.

Decoder-layer MatMuls get the chosen format (INT4 groups or INT8) with
``all_layers=True`` so a middle stage's last MatMul is not mistaken for an LM head;
the embedding and LM head always get INT8 (as the monolithic default does), and so does a
mixture of experts' router. The experts' stacked [experts, out, in] weights are MatMul
weights like any other (exporter.moe_block): NNCF compresses them per group.

An export with exact experts (exporter.exact_experts) first puts the experts' weights in
their exact i8 form, which NNCF then finds no float weight in and leaves as it is.

INT8 takes one of two forms (zctl.weights.INT8_FORMS), chosen by the caller: symmetric i8
groups (exporter.int8_groups; an int8 export's) or u8 per output channel with a zero point
(NNCF's public INT8_ASYM; an int4 export's embedding and head, and a static export's INT8).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout

import openvino as ov

from exporter.exact_experts import keep_experts_exact
from exporter.int8_groups import compress_int8_groups
from zctl.weights import INT8_CHANNELS, INT8_FORMS, INT8_GROUPS, check_weight_format

COMPRESSED_FORMATS = ("int4", "int8")  # the formats NNCF compresses to; the others stay float
# The weights only the INT8 pass compresses, in every format (the embedding, the LM head and
# a mixture of experts' router), by the Hugging Face Llama names the exporter fetches them
# by. They are the largest single weights, and NNCF's INT8 temporaries of a float32 weight
# are smaller than of a 16-bit one (it widens a bf16 weight through a compiled model): a
# compressed export hands them over in float32, the other weights in their stored 16-bit
# type (exporter.stored_weights).
INT8_PASS_WEIGHTS = re.compile(r"model\.embed_tokens\.weight|lm_head\.weight"
                               r"|model\.layers\.\d+\.mlp\.(gate|router)\.weight")


def keeps_16bit(weight_format: str, name: str) -> bool:
    """Whether weight ``name`` may reach compression in its stored 16-bit type."""
    return weight_format in COMPRESSED_FORMATS and INT8_PASS_WEIGHTS.fullmatch(name) is None


@contextmanager
def numpy_compression() -> Iterator[None]:
    """Use NNCF's numpy path for INT4 groups: 2x faster here than its OpenVINO-kernel
    path, which compiles a small model per weight shape. INT8 (per channel) takes the
    kernel path: the same bytes, 2.5x faster and 1 GB less transient memory on a
    Llama-3.2-1B-sized embedding (128256 x 2048) than numpy's float32 temporaries, the
    largest weight an export compresses. Set NNCF_DISABLE_OPTIMIZED_COMPRESSION yourself to
    choose; every stage of one export uses the same paths either way."""
    key = "NNCF_DISABLE_OPTIMIZED_COMPRESSION"
    before = os.environ.get(key)
    os.environ.setdefault(key, "1")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)


def compress_stage(model: ov.Model, weight_format: str, group_size: int | None,
                   compressed_16bit: Callable[[], None] = lambda: None,
                   int8_form: str = INT8_CHANNELS, exact_experts: bool = False) -> ov.Model:
    """Return the model with weights compressed (int4/int8); fp16/fp32 are left as they are.
    ``int8_form`` (INT8_FORMS): the form of the INT8 pass's weights. ``exact_experts``: a
    mixture of experts' weights take their exact i8 form first, in every format
    (InexactExpertsError, the model unchanged, where they have none).

    ``compressed_16bit`` is called once every weight ``keeps_16bit`` lets through is
    compressed (after the INT4 pass of an int4 export, else after the INT8 pass): the torch
    tensors those 16-bit Constants shared may go before the INT8 pass's temporaries come."""
    check_weight_format(weight_format)
    if int8_form not in INT8_FORMS:
        raise ValueError(f"unknown INT8 form {int8_form!r}; expected one of {INT8_FORMS}")
    if exact_experts:
        keep_experts_exact(model)
    if weight_format not in COMPRESSED_FORMATS:
        compressed_16bit()
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
    with redirect_stdout(sys.stderr):
        if weight_format == "int4":
            with numpy_compression():
                model = nncf.compress_weights(
                    model,
                    mode=CompressWeightsMode.INT4_ASYM,
                    group_size=group_size,
                    ratio=1.0,
                    all_layers=True,
                    ignored_scope=head_and_embedding,
                )
            compressed_16bit()
        # int8 for everything still in float: all MatMuls (int8) or just head/embedding (int4)
        if int8_form == INT8_GROUPS:
            model = compress_int8_groups(model)
        else:
            model = nncf.compress_weights(model, mode=CompressWeightsMode.INT8_ASYM)
    compressed_16bit()
    return model
