"""What a weight costs in each format: INT8's group (shared by the exporter and the node
profile's synthetic stage) and its scales' bytes in each INT8 form."""

from __future__ import annotations

import pytest

from zctl.weights import (
    INT8_CHANNELS,
    INT8_GROUPS,
    decoder_bytes_per_weight,
    default_int8_form,
    embedding_bytes_per_weight,
    export_int8_form,
    int8_bytes_per_weight,
    int8_group,
    named_int8_form,
)


@pytest.mark.parametrize(("k", "per_weight"), [
    (4096, 1 + 2 / 128), (576, 1 + 2 / 64), (96, 1 + 2 / 32),
    (40, 1 + 3 / 40)])  # no group divides 40: an f16 scale and a u8 zero point per row
def test_i8_groups_count_a_scale_per_group(k: int, per_weight: float) -> None:
    assert int8_bytes_per_weight(k, INT8_GROUPS) == pytest.approx(per_weight)
    assert decoder_bytes_per_weight("int8", k) == pytest.approx(per_weight)  # the default form


def test_u8_channels_count_a_scale_and_zero_point_per_row() -> None:
    assert int8_bytes_per_weight(576, INT8_CHANNELS) == pytest.approx(1 + 3 / 576)
    assert decoder_bytes_per_weight("int8", 576, int8_form=INT8_CHANNELS) == pytest.approx(
        1 + 3 / 576)


def test_the_embedding_and_head_are_int8_in_the_int4_and_int8_formats() -> None:
    assert default_int8_form("int8") == INT8_GROUPS
    assert default_int8_form("int4") == INT8_CHANNELS  # an int4 export's embedding and head
    assert default_int8_form("fp16") is None
    assert embedding_bytes_per_weight("int8", 576) == pytest.approx(1 + 2 / 64)
    assert embedding_bytes_per_weight("int4", 576) == pytest.approx(1 + 3 / 576)
    assert embedding_bytes_per_weight("int8", 576, INT8_CHANNELS) == pytest.approx(1 + 3 / 576)
    assert embedding_bytes_per_weight("fp16", 576) == 2.0
    assert decoder_bytes_per_weight("fp32", 576) == 4.0
    assert decoder_bytes_per_weight("int4", 576, 64) == pytest.approx(0.5 + 2.5 / 64)


def test_bad_forms_and_inputs_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown INT8 form 'i4-groups'"):
        int8_bytes_per_weight(576, "i4-groups")
    with pytest.raises(ValueError, match="at least one input"):
        int8_group(0)
    with pytest.raises(ValueError, match="unknown weight format 'int2'"):
        embedding_bytes_per_weight("int2", 576)
    with pytest.raises(ValueError, match="INT4 needs a group size"):
        decoder_bytes_per_weight("int4", 576)


def test_an_exports_int8_form_is_its_manifests_or_its_formats_default() -> None:
    assert export_int8_form("int8") == INT8_GROUPS
    assert export_int8_form("int8", INT8_CHANNELS) == INT8_CHANNELS
    assert export_int8_form("fp32") is None
    with pytest.raises(ValueError, match="unknown INT8 form 'i4-groups'"):
        export_int8_form("int8", "i4-groups")
    assert named_int8_form("int4", None) == INT8_CHANNELS  # a record naming no form
    assert named_int8_form("int8", INT8_CHANNELS) == INT8_CHANNELS
    assert named_int8_form("int2", None) is None  # a format it does not know: no default
