"""The settings compared: each a runtime for the stages and how the engine cuts and
verifies its steps.

``today``: the numerics and scheduling before repeatability (a u8 KV cache whose keys the
plugin quantizes per channel over a block, int8 activations, prompts cut anywhere, decode
steps unpadded, drafts verified together); ``repeatable``: the default now, the same
activations with by-token keys (``RuntimeSpec.key_cache_by_token``), pieces of two tokens
or more (``zctl.engine.prefill_pieces``), decode steps padded
(``RuntimeSpec.pad_decode_steps``) and verification as one-query steps; ``f16``: the same
with an f16 KV cache; ``exact``: an f32 KV cache and f32 activations (``--exact``), as
``repeatable`` otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dataplane.runtime.config import RuntimeSpec
from zctl.engine.prefill_pieces import ANYWHERE, CANONICAL, PieceRule


class TodaySpec(RuntimeSpec):
    """A runtime as before repeatability: paged stages run decode steps unpadded and
    quantize a u8 cache's keys per channel over a block (the plugin's own)."""

    pad_decode_steps: ClassVar[bool] = False
    key_cache_by_token: ClassVar[bool] = False


@dataclass(frozen=True)
class Setting:
    """One setting: KV cache type (None: the plugin's u8), int8 activations, where
    prompts are cut (``pieces``), and whether the runtime and verification are today's
    (``today``: per-channel keys, unpadded decode steps, drafts verified together) or
    the repeatable ones (by-token keys, padded decode steps, one-query verification)."""

    name: str
    kv_cache_precision: str | None
    dynamic_quantization: bool
    pieces: PieceRule
    today: bool = False

    def runtime(self) -> RuntimeSpec:
        spec = TodaySpec if self.today else RuntimeSpec
        return spec(precision="f32", kv_cache_precision=self.kv_cache_precision,
                    dynamic_quantization=self.dynamic_quantization, paged_attention=True)

    @property
    def one_query(self) -> bool:
        """Whether the engine verifies drafts (and replays) in one-query steps."""
        return not self.today

    @property
    def numerics(self) -> tuple[object, ...]:
        """What the stages compile with: settings alike here can share compiled stages."""
        return tuple(sorted(self.runtime().properties().items()))

    def describe(self) -> dict[str, object]:
        spec = self.runtime()
        return {"kv_cache_precision": self.kv_cache_precision or "u8 (the plugin's)",
                "dynamic_quantization": self.dynamic_quantization,
                "key_cache_by_token": spec.key_cache_by_token and spec.u8_kv_cache,
                "piece_block": self.pieces.block, "pad_decode_steps": spec.pad_decode_steps,
                "one_query_verification": self.one_query}


SETTINGS = {s.name: s for s in (
    Setting("today", None, True, ANYWHERE, today=True),
    Setting("repeatable", None, True, CANONICAL),
    Setting("f16", "f16", True, CANONICAL),
    Setting("exact", "f32", False, CANONICAL),
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
