"""The page's files: all shipped in the wheel (pyproject's package data), nothing loaded
from elsewhere, and small (the whole page under 300 KB compressed)."""

from __future__ import annotations

import gzip
import re
import tomllib
from fnmatch import fnmatch

from tests.helpers.repo import ROOT
from zctl.serve.web.routes import STATIC

BUDGET = 300 << 10  # bytes, compressed


def files() -> list[str]:
    return sorted(p.relative_to(STATIC.parent).as_posix() for p in STATIC.rglob("*")
                  if p.is_file())


def test_every_file_of_the_page_is_package_data() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["zctl.serve.web"]
    shipped = files()
    assert "static/index.html" in shipped and "static/vendor/marked.esm.js" in shipped
    assert [f for f in shipped if not any(fnmatch(f, g) for g in globs)] == []


def test_the_page_loads_nothing_from_elsewhere_and_is_small() -> None:
    remote = re.compile(r"""(src|href)=["'](https?:)?//|from\s+["']https?:|import\(["']https?:""")
    total = 0
    for name in files():
        data = (STATIC.parent / name).read_bytes()
        if name.endswith((".html", ".css", ".js")):
            assert not remote.search(data.decode()), name
        total += len(gzip.compress(data, 6))
    assert total < BUDGET
