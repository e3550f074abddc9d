"""Manifest parsing, layer splits and integrity checks (no OpenVINO needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zctl.manifest import (
    GenerationConfig,
    ManifestError,
    check_layer_cover,
    even_split,
    generation_config_from_dict,
    load_manifest,
    manifest_from_dict,
    parse_layer_spec,
)
from zctl.weights import INT8_CHANNELS, INT8_GROUPS


def test_parse_layer_spec_inclusive_to_half_open() -> None:
    assert parse_layer_spec("0-9,10-29") == [(0, 10), (10, 30)]
    assert parse_layer_spec(" 0-0 , 1-3") == [(0, 1), (1, 4)]


@pytest.mark.parametrize("spec", ["0-9;10-19", "a-b", "0-", "0-9-12", ""])
def test_parse_layer_spec_rejects_garbage(spec: str) -> None:
    with pytest.raises(ManifestError, match="bad layer range"):
        parse_layer_spec(spec)


def test_even_split_gives_remainder_to_early_stages() -> None:
    assert even_split(30, 2) == [(0, 15), (15, 30)]
    assert even_split(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    with pytest.raises(ManifestError):
        even_split(4, 5)


@pytest.mark.parametrize(
    ("ranges", "message"),
    [
        ([(1, 4)], "starting at layer 0"),
        ([(0, 2), (3, 4)], "starting at layer 2"),
        ([(0, 2), (2, 3)], "model has 4 layers"),
        ([(0, 5)], "model has 4 layers"),
        ([(0, 0), (0, 4)], "empty or reversed"),
        ([], "no stages"),
    ],
)
def test_layer_cover_must_be_exact(ranges: list[tuple[int, int]], message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        check_layer_cover(ranges, 4)


def test_missing_manifest_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="not a zctl export directory|not found"):
        load_manifest(tmp_path)


def test_invalid_json_manifest(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        load_manifest(tmp_path)


def test_manifest_round_trip_and_tamper(tiny_exports) -> None:
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    manifest = load_manifest(export_dir)
    assert [(s.layer_start, s.layer_end) for s in manifest.stages] == [(0, 2), (2, 4)]
    assert manifest.stages[0].first and manifest.stages[1].last
    assert manifest.versions["openvino"]
    assert len(manifest.stage_hash(0)) == 64 and manifest.stage_hash(0) != manifest.stage_hash(1)
    raw = json.loads((export_dir / "manifest.json").read_text())
    for mutate, message in [
        (lambda r: r.pop("stages"), "missing 'stages'"),
        (lambda r: r.update(format="other/9"), "format"),
        (lambda r: r["stages"][1].update(layer_start=3), "starting at layer 2"),
        (lambda r: r["model"].pop("hidden_size"), "model section is malformed"),
    ]:
        broken = json.loads(json.dumps(raw))
        mutate(broken)
        copy = export_dir.parent / "tampered"
        copy.mkdir(exist_ok=True)
        (copy / "manifest.json").write_text(json.dumps(broken))
        with pytest.raises(ManifestError, match=message):
            load_manifest(copy, verify_files=False)


@pytest.mark.parametrize(("weights", "given", "form"), [
    ("int8", None, INT8_CHANNELS),  # written before the field: per channel
    ("int4", None, INT8_CHANNELS),  # its embedding and head
    ("fp16", None, None),
    ("int8", INT8_GROUPS, INT8_GROUPS),
])
def test_the_int8_form_is_read_or_told_by_the_exports_age(
        tiny_exports, weights: str, given: str | None, form: str | None) -> None:
    raw = json.loads((tiny_exports.get([(0, 4)]) / "manifest.json").read_text())
    raw.update(weight_format=weights, int8_form=given)
    if given is None:
        del raw["int8_form"]
    manifest = manifest_from_dict(raw)
    assert manifest.int8_form == form
    assert manifest_from_dict(json.loads(manifest.to_json())).int8_form == form


def test_an_unknown_int8_form_is_refused_by_name(tiny_exports) -> None:
    raw = json.loads((tiny_exports.get([(0, 4)]) / "manifest.json").read_text())
    with pytest.raises(ManifestError, match="int8_form 'q8_0' is not one of"):
        manifest_from_dict({**raw, "weight_format": "int8", "int8_form": "q8_0"})


def test_a_generation_config_keeps_its_sampling_fields_as_given() -> None:
    raw = {"do_sample": True, "temperature": 1, "top_p": 0.9, "min_p": None, "top_k": 20,
           "bos_token_id": 1, "transformers_version": "5.0"}
    assert generation_config_from_dict(raw) == GenerationConfig(
        do_sample=True, temperature=1.0, top_k=20, top_p=0.9)
    assert generation_config_from_dict({"_from_model_config": True}) == GenerationConfig()
    for bad, field in (({"temperature": "hot"}, "temperature"), ({"top_k": 2.5}, "top_k"),
                       ({"top_k": True}, "top_k"), ({"do_sample": 1}, "do_sample")):
        with pytest.raises(ManifestError, match=rf"g\.{field} has the wrong type"):
            generation_config_from_dict(bad, "g")
    with pytest.raises(ManifestError, match="not a JSON object"):
        generation_config_from_dict([1])


def test_the_manifest_carries_the_generation_config(tiny_exports, tmp_path: Path) -> None:
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    raw = json.loads((export_dir / "manifest.json").read_text())
    for given, expected in ((None, None), ({"do_sample": False, "top_k": 5},
                                           GenerationConfig(do_sample=False, top_k=5))):
        (tmp_path / "manifest.json").write_text(json.dumps({**raw, "generation_config": given}))
        assert load_manifest(tmp_path, verify_files=False).generation_config == expected
    older = {k: v for k, v in raw.items() if k != "generation_config"}  # before it was kept
    (tmp_path / "manifest.json").write_text(json.dumps(older))
    assert load_manifest(tmp_path, verify_files=False).generation_config is None
    (tmp_path / "manifest.json").write_text(json.dumps({**raw, "generation_config": {
        "temperature": "warm"}}))
    with pytest.raises(ManifestError, match="generation_config.temperature has the wrong type"):
        load_manifest(tmp_path, verify_files=False)
