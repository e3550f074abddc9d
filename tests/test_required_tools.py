"""A test lacking a system tool CI installs is skipped here, failed under ZCTL_REQUIRE_TOOLS=1."""

from __future__ import annotations

import pytest

from tests.helpers.tools import missing_tool


def test_a_missing_tool_skips_where_tools_are_optional(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZCTL_REQUIRE_TOOLS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs nftables"):
        missing_tool("nftables")


def test_a_missing_tool_fails_where_tools_are_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZCTL_REQUIRE_TOOLS", "1")
    with pytest.raises(pytest.fail.Exception, match="needs Debian's chromium"):
        missing_tool("Debian's chromium")
