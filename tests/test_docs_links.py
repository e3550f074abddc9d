"""Every relative link in the README and under docs/ reaches a file that exists, and every
``#anchor`` a heading of the page it points to (the anchors GitHub makes of headings)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers.repo import ROOT

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def prose(text: str) -> str:
    """The text outside fenced code blocks and code spans (links there are not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lowercased, punctuation dropped
    (letters, digits, ``_``, ``-`` and spaces kept), spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").replace("*", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading's get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(pages: list[Path], root: Path) -> list[str]:
    """``page: target (why)`` for every relative link among ``pages`` that does not resolve."""
    broken = []
    for page in pages:
        for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
            if SCHEME.match(target):
                continue  # http(s), mailto: not checked here
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(root)}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} (no heading makes #{anchor} in {dest.name})")
            elif anchor and dest.suffix != ".md":
                broken.append(f"{where} (an anchor into a file that is not markdown)")
    return broken


def documentation(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def test_every_relative_link_and_anchor_in_the_docs_resolves() -> None:
    pages = documentation(ROOT)
    assert len(pages) > 10, "the docs were not found"
    assert broken_links(pages, ROOT) == []


def test_the_check_finds_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "# A page\n\n## The `step`'s path\n\n## Twice\n\n## Twice\n", encoding="utf-8")
    (tmp_path / "README.md").write_text(
        "[ok](docs/page.md#the-steps-path) [ok](docs/page.md#twice-1) [ok](#top)\n"
        "[gone](docs/gone.md) [bad anchor](docs/page.md#no-such-heading)\n"
        "[web](https://example.com/x#y) `[in code](docs/gone.md)`\n\n# Top\n\n"
        "```\n[in a fence](docs/gone.md)\n```\n", encoding="utf-8")
    found = broken_links(documentation(tmp_path), tmp_path)
    assert found == ["README.md: docs/gone.md (no such file)",
                     "README.md: docs/page.md#no-such-heading (no heading makes "
                     "#no-such-heading in page.md)"]
