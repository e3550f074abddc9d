"""The check before speed: at f32, zctl and llama.cpp produce the same greedy tokens for
the same prompt ids. zctl's side is its 1-stage fp32 export stepped by the greedy
reference loop with exact numerics (f32 activations and KV, no dynamic quantization);
llama.cpp's is llama-server on the F32 GGUF with its exact numerics too (an f32 KV cache,
flash attention off: with its defaults, an f16 KV cache and flash attention, SmolLM2's
tokens parted from zctl's at the 10th of 32; with these all 32 matched), /completion at
temperature 0 returning the token ids. Both ignore end-of-sequence. A llama-server that
dies or answers without the token ids is llama.cpp's failure of the check, with its log's
tail; the check's target is then unmet (tools.peers.report.greedy_targets)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from tools.peers.cases import ERROR_SETTLE_S
from tools.peers.processes import PeerFailure
from tools.peers.systems import LlamaServed

GREEDY_TOKENS = 32
LLAMA_EXACT = ("--cache-type-k", "f32", "--cache-type-v", "f32", "--flash-attn", "off")


def zctl_greedy(export_dir: Path, ids: Sequence[int], tokens: int) -> list[int]:
    """zctl's greedy tokens with exact numerics."""
    from dataplane.head.local_chain import LocalChain
    from dataplane.runtime.config import RuntimeSpec
    from tools.harness.greedy import timed_greedy

    exact = RuntimeSpec(precision="f32", kv_cache_precision="f32", dynamic_quantization=False)
    return [int(t) for t in timed_greedy(LocalChain.load(str(export_dir), exact), ids, tokens)[0]]


def completion_token_ids(base_url: str, ids: Sequence[int], tokens: int) -> list[int]:
    """llama-server's greedy tokens (/completion, temperature 0, token ids returned);
    PeerFailure (without a log) if the request fails or the answer holds no token ids."""
    try:
        answer = httpx.post(f"{base_url}/completion", timeout=600, json={
            "prompt": list(ids), "n_predict": tokens, "temperature": 0.0, "top_k": 1,
            "ignore_eos": True, "return_tokens": True, "cache_prompt": False})
    except httpx.HTTPError as exc:
        raise PeerFailure(f"llama-server's greedy request failed: {type(exc).__name__}: "
                          f"{exc}") from None
    if answer.status_code != 200:
        raise PeerFailure(f"llama-server's greedy request failed: http {answer.status_code}: "
                          f"{answer.text[:300]}")
    try:
        body = answer.json()
    except ValueError:
        body = None
    got = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(got, list) or not all(isinstance(t, int) for t in got):
        raise PeerFailure(f"llama-server's greedy answer holds no token ids: {answer.text[:200]}")
    return got


def llama_greedy(llama: LlamaServed, ids: Sequence[int], tokens: int) -> list[int]:
    """llama-server's greedy tokens (``completion_token_ids``). A request that fails, or an
    answer without the tokens, is llama.cpp's failure as in a case (tools.peers.cases):
    a process that exited, with its log's tail, else what went wrong with the tail of
    llama-server's log."""
    try:
        return completion_token_ids(llama.base_url, ids, tokens)
    except PeerFailure as exc:
        time.sleep(ERROR_SETTLE_S)  # a process that just died: let its exit show
        llama.check()
        raise PeerFailure(str(exc), llama.cluster.server_log_tail()) from None


def agreement(zctl: Sequence[int], llama: Sequence[int]) -> dict[str, Any]:
    """How far two greedy sequences agree: the leading tokens in common, and whether all do."""
    common = next((i for i, (a, b) in enumerate(zip(zctl, llama, strict=False)) if a != b),
                  min(len(zctl), len(llama)))
    return {"tokens": len(zctl), "matched": common,
            "match": common == len(zctl) == len(llama), "zctl": list(zctl), "llama.cpp": list(llama)}
