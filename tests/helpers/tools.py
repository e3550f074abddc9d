"""Tests that need a system tool CI installs (Debian's chromium, nftables): skipped where
it is missing, failed instead when ZCTL_REQUIRE_TOOLS=1 (.ci/run sets it)."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def missing_tool(what: str) -> NoReturn:
    """Skip the test for lack of ``what``, or fail it where the tools are required."""
    if os.environ.get("ZCTL_REQUIRE_TOOLS") == "1":
        pytest.fail(f"this test needs {what} (ZCTL_REQUIRE_TOOLS=1)")
    pytest.skip(f"needs {what}")
