"""Shard files on both ends of a transfer: chunks served from an export, cached on a node.

No sockets here. ``ShardSource`` (coordinator) turns an export directory into shard
offers and checked chunks. ``ShardCache`` and ``Download`` (node) keep shards under
``<state_dir>/shards/<hash>/`` and assemble a download chunk by chunk: each chunk is
checked against its sha256 (a bad one is re-requested), each file against the
manifest's sha256, and the directory appears under its hash only once all of it is.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from controlplane.checks import SHA256_RE
from controlplane.messages import ShardChunk, ShardOffer, ShardRequest
from controlplane.records import FileSpec
from zctl.manifest import MANIFEST_NAME, ExportManifest, sha256_file

DEFAULT_CHUNK_SIZE = 1 << 20


class ShardError(RuntimeError):
    """A shard request, chunk or cached copy is not acceptable; the text says why."""


def check_file_name(name: str) -> str:
    """A shard file name must be a plain name (it is joined to a local directory)."""
    if not name or name in (".", "..") or Path(name).name != name or "\\" in name or \
            name.startswith("."):
        raise ShardError(f"refusing shard file name {name!r}: not a plain file name")
    return name


def check_hash(shard_hash: str) -> str:
    if not SHA256_RE.match(shard_hash):
        raise ShardError(f"{shard_hash!r} is not a shard hash")
    return shard_hash


class ShardSource:
    """Serves the files of each stage of one export (manifest.json + stage xml + bin)."""

    def __init__(self, export_dir: Path, manifest: ExportManifest,
                 chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk size must be positive, got {chunk_size}")
        self.export_dir = Path(export_dir)
        self.manifest = manifest
        self.chunk_size = chunk_size
        manifest_path = self.export_dir / MANIFEST_NAME
        self._manifest_spec = FileSpec(MANIFEST_NAME, manifest_path.stat().st_size,
                                       sha256_file(manifest_path))
        self.offers: dict[str, ShardOffer] = {}
        for spec in manifest.stages:
            shard_hash = manifest.stage_hash(spec.index)
            files = [self._manifest_spec] + [
                FileSpec(name, (self.export_dir / name).stat().st_size, manifest.files[name])
                for name in (spec.xml, spec.bin)
            ]
            self.offers[shard_hash] = ShardOffer(shard_hash, spec.index, files, chunk_size)

    def offer_for(self, stage_index: int) -> ShardOffer:
        return self.offers[self.manifest.stage_hash(stage_index)]

    def read_chunk(self, request: ShardRequest) -> tuple[ShardChunk, bytes]:
        """Read one requested chunk; raise ShardError if the request does not fit the shard."""
        offer = self.offers.get(request.shard_hash)
        if offer is None:
            raise ShardError(f"shard {request.shard_hash[:12]} is not served here")
        spec = next((f for f in offer.files if f.name == request.file), None)
        if spec is None:
            raise ShardError(f"shard {request.shard_hash[:12]} has no file {request.file!r}")
        expected_size = min(self.chunk_size, spec.size - request.offset)
        if request.offset != request.chunk * self.chunk_size or expected_size <= 0 \
                or request.size != expected_size:
            raise ShardError(
                f"bad chunk request for {request.file}: chunk {request.chunk} offset "
                f"{request.offset} size {request.size} (file is {spec.size} bytes in "
                f"{self.chunk_size}-byte chunks)")
        with open(self.export_dir / spec.name, "rb") as handle:
            handle.seek(request.offset)
            data = handle.read(request.size)
        if len(data) != request.size:
            raise ShardError(f"{spec.name} is shorter than the manifest says")
        digest = hashlib.sha256(data).hexdigest()
        chunk = ShardChunk(request.shard_hash, spec.name, request.chunk, request.offset,
                           request.size, digest)
        return chunk, data


class ShardCache:
    """``<root>/<hash>/`` directories, each a complete verified shard."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, shard_hash: str) -> Path:
        return self.root / check_hash(shard_hash)

    def hashes(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and SHA256_RE.match(p.name))

    def has(self, shard_hash: str) -> bool:
        return self.path(shard_hash).is_dir()

    def verify(self, offer: ShardOffer) -> bool:
        """True if the cached copy holds every offered file with the right size and sha256."""
        base = self.path(offer.shard_hash)
        for spec in offer.files:
            path = base / check_file_name(spec.name)
            if not path.is_file() or path.stat().st_size != spec.size:
                return False
            if sha256_file(path) != spec.sha256:
                return False
        return True

    def remove(self, shard_hash: str) -> None:
        shutil.rmtree(self.path(shard_hash), ignore_errors=True)


@dataclass
class _Chunk:
    file: str
    index: int
    offset: int
    size: int
    sent_at: float = 0.0
    retries: int = 0


class Download:
    """Assembles one offered shard in ``<root>/.partial-<hash>/`` with credit-based requests."""

    def __init__(self, cache: ShardCache, offer: ShardOffer, max_retries: int = 5,
                 chunk_timeout: float = 10.0) -> None:
        self.cache = cache
        self.offer = offer
        self.max_retries = max_retries
        self.chunk_timeout = chunk_timeout
        self.partial = cache.root / f".partial-{check_hash(offer.shard_hash)}"
        shutil.rmtree(self.partial, ignore_errors=True)
        self.partial.mkdir(parents=True)
        self.rejected = 0
        self.bytes_total = sum(f.size for f in offer.files)
        self.bytes_done = 0
        self._fds: dict[str, int] = {}
        self._pending: list[_Chunk] = []
        self._outstanding: dict[tuple[str, int], _Chunk] = {}
        for spec in offer.files:
            fd = os.open(self.partial / check_file_name(spec.name),
                         os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            self._fds[spec.name] = fd
            os.ftruncate(fd, spec.size)
            for index, offset in enumerate(range(0, spec.size, offer.chunk_size)):
                size = min(offer.chunk_size, spec.size - offset)
                self._pending.append(_Chunk(spec.name, index, offset, size))

    @property
    def complete(self) -> bool:
        return not self._pending and not self._outstanding

    def requests(self, window: int, now: float | None = None) -> list[ShardRequest]:
        """New requests so that up to ``window`` are outstanding; re-sends timed-out ones."""
        now = time.monotonic() if now is None else now
        out = []
        for chunk in self._outstanding.values():
            if now - chunk.sent_at > self.chunk_timeout:
                self._retry(chunk)
                chunk.sent_at = now
                out.append(self._request(chunk))
        while self._pending and len(self._outstanding) < window:
            chunk = self._pending.pop(0)
            chunk.sent_at = now
            self._outstanding[(chunk.file, chunk.index)] = chunk
            out.append(self._request(chunk))
        return out

    def _request(self, chunk: _Chunk) -> ShardRequest:
        return ShardRequest(self.offer.shard_hash, chunk.file, chunk.index, chunk.offset,
                            chunk.size)

    def _retry(self, chunk: _Chunk) -> None:
        chunk.retries += 1
        if chunk.retries > self.max_retries:
            raise ShardError(
                f"chunk {chunk.index} of {chunk.file} failed {chunk.retries} times; giving up")

    def accept(self, msg: ShardChunk, payload: bytes) -> bool:
        """Write a chunk if it is expected and intact; a corrupt one is queued again.

        Returns True if the chunk was written. Raises ShardError when a chunk has failed
        more than ``max_retries`` times.
        """
        chunk = self._outstanding.get((msg.file, msg.chunk))
        if chunk is None or msg.shard_hash != self.offer.shard_hash or \
                msg.offset != chunk.offset or msg.size != chunk.size:
            return False  # a stale duplicate (e.g. answer to a timed-out request)
        del self._outstanding[(msg.file, msg.chunk)]
        if hashlib.sha256(payload).hexdigest() != msg.sha256 or len(payload) != chunk.size:
            self.rejected += 1
            self._retry(chunk)
            self._pending.insert(0, chunk)
            return False
        os.pwrite(self._fds[msg.file], payload, msg.offset)
        self.bytes_done += chunk.size
        return True

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def abort(self) -> None:
        self.close()
        shutil.rmtree(self.partial, ignore_errors=True)

    def finalize(self) -> Path:
        """Check every file's sha256 and move the shard into the cache (slow: hashes it all)."""
        if not self.complete:
            raise ShardError("shard download is not complete")
        self.close()
        for spec in self.offer.files:
            actual = sha256_file(self.partial / spec.name)
            if actual != spec.sha256:
                shutil.rmtree(self.partial, ignore_errors=True)
                raise ShardError(
                    f"{spec.name} of shard {self.offer.shard_hash[:12]} arrived with sha256 "
                    f"{actual[:12]}... but should be {spec.sha256[:12]}...")
        final = self.cache.path(self.offer.shard_hash)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(self.partial, final)
        return final
