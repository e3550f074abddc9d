"""Field checks shared by the message schemas: each raises ``MessageError`` with a reason."""

from __future__ import annotations

import re
from typing import Any

NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
Z85_KEY_RE = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")


class MessageError(ValueError):
    """A frame is not a valid control-plane message; the text says why."""


def need(cond: bool, text: str) -> None:
    if not cond:
        raise MessageError(text)


def check_key(key: str, what: str, required: bool = False) -> None:
    """A Z85 CURVE public key (40 characters), or "" when not ``required``."""
    if not key and not required:
        return
    need(bool(Z85_KEY_RE.fullmatch(key)), f"{what} must be a 40-character Z85 CURVE public key")


def check_sha(value: str, what: str) -> None:
    need(bool(SHA256_RE.match(value)), f"{what} must be 64 lowercase hex digits, got {value!r}")


def check_nonneg(obj: Any, *names: str) -> None:
    for name in names:
        need(getattr(obj, name) >= 0, f"{type(obj).TYPE}.{name} must be >= 0")
