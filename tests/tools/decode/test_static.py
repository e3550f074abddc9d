"""tools/decode/static on the tiny model: its JSON, and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer

from tools.decode import static


def test_parse_contexts() -> None:
    assert static.parse_contexts("256, 1024") == [256, 1024]
    for bad in ("", "a,b", "0,16"):
        with pytest.raises(typer.BadParameter):
            static.parse_contexts(bad)


def _run(tiny_llama_dir: Path, contexts: str, tokens: int, capsys) -> dict:
    static.main(model=str(tiny_llama_dir), weights="fp32", stages=2, contexts=contexts,
                      chunk=4, tokens=tokens, device="CPU", as_json=True)
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_bench_static_reports_every_system(tiny_llama_dir: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))
    result = _run(tiny_llama_dir, "96,128", 6, capsys)
    assert set(result["step_ms"]) == {"stateful", "static96", "static128", "static128_f16"}
    assert result["static96_ratio"] > 0 and result["static128_ratio"] > 0
    assert set(result["prefill_ms"]) == set(result["step_ms"])
    exports = sorted(p.name for p in (tmp_path / "home" / "exports" / "bench").iterdir())
    assert any(name.endswith("-static96x4") for name in exports)
    assert any(name.endswith("-static128x4-f16") for name in exports)
    with pytest.raises(typer.BadParameter, match="hold fewer than"):
        _run(tiny_llama_dir, "8", 6, capsys)
