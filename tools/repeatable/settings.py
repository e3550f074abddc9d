"""The settings compared: each a runtime for the stages and where the engine cuts prompts.

``today``: the numerics and scheduling before repeatability (a u8 KV cache, int8
activations, prompts cut anywhere, decode steps unpadded); ``repeatable``: the
same numerics with canonical prefill pieces and decode steps padded
(``zctl.engine.prefill_pieces``, ``RuntimeSpec.pad_decode_steps``); ``f16``: an f16 KV
cache, pieces cut anywhere but never a lone token, padded; ``exact``: an f32 KV cache
and f32 activations (``--exact``), canonical pieces, padded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dataplane.runtime.config import RuntimeSpec
from zctl.engine.prefill_pieces import ANYWHERE, CANONICAL, PieceRule


class UnpaddedSpec(RuntimeSpec):
    """A runtime whose paged stages run decode steps unpadded (as before repeatability)."""

    pad_decode_steps: ClassVar[bool] = False


@dataclass(frozen=True)
class Setting:
    """One setting: KV cache type (None: the plugin's u8), int8 activations, where
    prompts are cut (``pieces``) and whether decode steps are padded."""

    name: str
    kv_cache_precision: str | None
    dynamic_quantization: bool
    pieces: PieceRule
    padded: bool

    def runtime(self) -> RuntimeSpec:
        spec = RuntimeSpec if self.padded else UnpaddedSpec
        return spec(precision="f32", kv_cache_precision=self.kv_cache_precision,
                    dynamic_quantization=self.dynamic_quantization, paged_attention=True)

    @property
    def numerics(self) -> tuple[str | None, bool]:
        """What the stages compile with: settings alike here can share compiled stages."""
        return self.kv_cache_precision, self.dynamic_quantization

    def describe(self) -> dict[str, object]:
        return {"kv_cache_precision": self.kv_cache_precision or "u8 (the plugin's)",
                "dynamic_quantization": self.dynamic_quantization,
                "piece_block": self.pieces.block, "pad_decode_steps": self.padded}


SETTINGS = {s.name: s for s in (
    Setting("today", None, True, ANYWHERE, False),
    Setting("repeatable", None, True, CANONICAL, True),
    # an f16 KV cache has no per-block quantization: pieces need no boundaries, only no
    # lone token (a cached prefix may end anywhere but leaves two tokens)
    Setting("f16", "f16", True, PieceRule(1), True),
    Setting("exact", "f32", False, CANONICAL, True),
)}
BASELINE = "today"


def parse_settings(text: str) -> list[Setting]:
    """Comma-separated setting names; today's is always measured, first (ValueError for an
    unknown name)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}: choose from {', '.join(SETTINGS)}")
    ordered = [BASELINE] + [n for n in dict.fromkeys(names) if n != BASELINE]
    return [SETTINGS[n] for n in ordered]
