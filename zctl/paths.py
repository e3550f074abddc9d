"""Where zctl keeps its state: exports, node ids, cluster files (override with ZCTL_HOME);
and what every zctl process of one user on one machine shares whatever its ZCTL_HOME (the
user's runtime directory)."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def zctl_home() -> Path:
    return Path(os.environ.get("ZCTL_HOME", Path.home() / ".cache" / "zctl"))


def export_cache_dir() -> Path:
    return zctl_home() / "exports"


def source_cache_dir() -> Path:
    """Model sources converted once (the default model's GGUF as an HF directory)."""
    return zctl_home() / "sources"


def runtime_dir() -> Path:
    """This user's zctl directory of this machine, the same for every zctl process of the
    user whatever its ZCTL_HOME (the nodes of a local cluster, nodes of other clusters,
    ``zctl node profile``): ``$XDG_RUNTIME_DIR/zctl``, else ``<temp dir>/zctl-<uid>``.
    Not created here (see ``private_dir``)."""
    base = os.environ.get("XDG_RUNTIME_DIR", "")
    if base and Path(base).is_absolute():
        return Path(base) / "zctl"
    return Path(tempfile.gettempdir()) / f"zctl-{os.getuid()}"


def private_dir(path: Path) -> Path:
    """``path`` made (mode 0700, its parents as needed) if missing: OSError when it is not a
    directory this user owns that no other user may write (in a shared temporary directory
    another user could have made it first)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise OSError(f"{path} is not a directory")
    if info.st_uid != os.getuid():
        raise OSError(f"{path} belongs to another user (uid {info.st_uid})")
    if info.st_mode & 0o022:
        raise OSError(f"{path} may be written by other users (mode {info.st_mode & 0o777:o})")
    return path
