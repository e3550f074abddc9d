"""Optional CURVE authentication and encryption for the control ROUTER and its DEALERs.

Key pairs live in state directories (``<state_dir>/curve/<name>.key`` and
``.key_secret``, zmq's certificate format). The coordinator admits only the public
keys found in an authorized-keys directory (its own included, so a local status
client can use its pair), or, without that directory, any client (encryption only).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from dataplane.wire.transport import curve_client, curve_server, is_z85_key


class SecurityError(RuntimeError):
    """CURVE keys are missing or unusable."""


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise SecurityError("this libzmq was built without CURVE support")


def key_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "curve"


def load_or_create_keypair(keys: Path, name: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from ``<keys>/<name>.key_secret``; made on first use."""
    _require_curve()
    secret_file = keys / f"{name}.key_secret"
    if not secret_file.exists():
        keys.mkdir(parents=True, exist_ok=True)
        os.chmod(keys, 0o700)
        zmq.auth.create_certificates(keys, name)
        os.chmod(secret_file, 0o600)
    try:
        public, secret = zmq.auth.load_certificate(secret_file)
    except (OSError, ValueError) as exc:
        raise SecurityError(f"cannot read the CURVE key pair {secret_file}: {exc}") from None
    if not secret:
        raise SecurityError(f"{secret_file} holds no secret key")
    return public, secret


def read_public_key(path: Path) -> bytes:
    """The public key of a certificate file (``.key`` or ``.key_secret``)."""
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise SecurityError(f"cannot read a CURVE public key from {path}: {exc}") from None
    return public


def authorize(authorized_dir: Path, name: str, public_key_file: Path) -> Path:
    """Admit a node: copy its public certificate into the authorized-keys directory."""
    read_public_key(public_key_file)  # fails clearly if it is not a certificate
    authorized_dir.mkdir(parents=True, exist_ok=True)
    target = authorized_dir / f"{name}.key"
    shutil.copyfile(public_key_file, target)
    return target


def write_public_key(path: Path, public: bytes, comment: str = "") -> Path:
    """A public certificate file holding ``public`` (zmq's format, as ``node.key``), e.g.
    a key that pairing received; ValueError if it is not a 40-character Z85 key."""
    if not is_z85_key(public):
        raise ValueError(f"not a CURVE public key (40 Z85 characters): {public[:48]!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    note = f"#   {comment}\n" if comment else ""
    path.write_text(f"#   ZeroMQ CURVE Public Certificate\n{note}metadata\ncurve\n"
                    f'    public-key = "{public.decode()}"\n')
    return path


@dataclass
class CurveServer:
    """Server side: key pair plus (optionally) the directory of admitted public keys."""

    public: bytes
    secret: bytes
    authorized_dir: Path | None = None
    _auth: ThreadAuthenticator | None = field(default=None, repr=False)
    _seen: float = field(default=-1.0, repr=False)

    @classmethod
    def from_state_dir(cls, state_dir: Path, authorized_dir: Path | None = None,
                       name: str = "coordinator") -> CurveServer:
        keys = key_dir(state_dir)
        public, secret = load_or_create_keypair(keys, name)
        if authorized_dir is not None:
            authorize(authorized_dir, name, keys / f"{name}.key")
        return cls(public, secret, authorized_dir)

    def apply(self, sock: zmq.Socket, ctx: zmq.Context) -> None:
        """Start the ZAP authenticator on ``ctx`` and make ``sock`` a CURVE server."""
        _require_curve()
        if self._auth is None:
            self._auth = ThreadAuthenticator(ctx)
            self._auth.start()
            self.reload()
        curve_server(sock, self.public, self.secret)

    def reload(self) -> None:
        """Re-read the authorized keys (after ``authorize`` admitted a new node)."""
        if self._auth is None:
            return
        location = str(self.authorized_dir) if self.authorized_dir else zmq.auth.CURVE_ALLOW_ANY
        self._auth.configure_curve(domain="*", location=location)
        self._seen = self._mtime()

    def _mtime(self) -> float:
        try:
            return self.authorized_dir.stat().st_mtime if self.authorized_dir else 0.0
        except OSError:
            return 0.0

    def maybe_reload(self) -> None:
        """Reload if the authorized-keys directory changed (cheap; call it periodically)."""
        if self._auth is not None and self._mtime() != self._seen:
            self.reload()

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


@dataclass(frozen=True)
class CurveClient:
    """Client side: the server's public key and this node's key pair."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def from_state_dir(cls, state_dir: Path, server_public: bytes,
                       name: str = "node") -> CurveClient:
        public, secret = load_or_create_keypair(key_dir(state_dir), name)
        return cls(server_public, public, secret)

    @classmethod
    def from_files(cls, server_key: Path, key_pair: Path) -> CurveClient:
        """The client of an admitted key pair (its ``.key_secret`` file) for the server
        whose public key file is ``server_key``; SecurityError if either is unusable."""
        try:
            public, secret = zmq.auth.load_certificate(str(key_pair))
        except (OSError, ValueError) as exc:
            raise SecurityError(f"cannot read the CURVE key pair {key_pair}: {exc}") from None
        if not secret:
            raise SecurityError(f"{key_pair} holds no secret key: give the .key_secret file")
        return cls(read_public_key(server_key), public, secret)

    def apply(self, sock: zmq.Socket) -> None:
        _require_curve()
        curve_client(sock, self.server_public, self.public, self.secret)


def key_fingerprint(public: bytes) -> str:
    """The sha256 of a Z85 public key, hex: what discovery announces and pairing shows."""
    import hashlib

    return hashlib.sha256(public).hexdigest()
