"""The user's runtime directory: one per user and machine, whatever ZCTL_HOME says, and
made private or refused."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from zctl.paths import private_dir, runtime_dir


def test_the_runtime_dir_is_the_user_s_not_zctl_home_s(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "a"))
    one = runtime_dir()
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "b"))
    assert runtime_dir() == one == tmp_path / "run" / "zctl"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert runtime_dir() == Path(tempfile.gettempdir()) / f"zctl-{os.getuid()}"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "relative/run")  # not a usable one: ignored
    assert runtime_dir() == Path(tempfile.gettempdir()) / f"zctl-{os.getuid()}"


def test_a_private_dir_is_made_0700_and_a_shared_or_false_one_is_refused(tmp_path: Path) -> None:
    made = private_dir(tmp_path / "x" / "zctl")
    assert made.is_dir() and made.stat().st_mode & 0o777 == 0o700
    assert private_dir(made) == made  # there already: fine
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(OSError, match="written by other users"):
        private_dir(shared)
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        private_dir(tmp_path / "file")
    (tmp_path / "link").symlink_to(made)
    with pytest.raises(OSError, match="not a directory"):
        private_dir(tmp_path / "link")
