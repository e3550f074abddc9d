"""One export's stages under each setting, in this process, and generations run to the end
on an engine over them (a ``GenerationEngine`` on a ``LocalChain``, as ``zctl serve``
runs one), optionally through an outage: the pipeline reports itself down for a moment
after some tokens, so every generation in flight pauses and resumes by replay, as after
a node was killed and the cluster healed."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.repeatable.settings import Setting

OUTAGE_S = 0.6  # how long an outage lasts (the engine checks the pipeline every 0.25 s)
PREFIX_CACHE_TOKENS = 16384
RUN_LIMIT_S = 600.0  # a run taking longer than this is a failure of the benchmark


@dataclass(frozen=True)
class Request:
    """One greedy request: a chat prompt (``follow_up``: a second user turn after
    ``answer``) or raw token ids; how many new tokens; the engine's options."""

    prompt: str = ""
    max_tokens: int = 32
    speculative: str = ""
    streamed: bool = False  # chunks as each token comes (else every 100 ms)
    prompt_ids: tuple[int, ...] = ()
    answer: str = ""
    follow_up: str = ""
    ignore_eos: bool = False


class Lab:
    """The export's stages loaded once per setting; engines over them on demand."""

    def __init__(self, export_dir: Path, settings: Sequence[Setting]) -> None:
        from dataplane.head.local_chain import LocalChain
        from zctl.engine.tokenizer import ChatTokenizer
        from zctl.manifest import load_manifest

        self.export_dir = export_dir
        manifest = load_manifest(export_dir, verify_files=False)
        self.tokenizer = ChatTokenizer(export_dir)
        stops = set(manifest.model.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            stops.add(self.tokenizer.eos_token_id)
        self.stops = sorted(stops)
        self.stages = len(manifest.stages)
        self.settings = {s.name: s for s in settings}
        # one chain per numerics: settings that differ only in scheduling share its
        # compiled stages (their figures then differ by the setting alone)
        self.chains = {}
        for setting in settings:
            if setting.numerics not in self.chains:
                chain = LocalChain.load(str(export_dir), setting.runtime())
                for runner in chain.runners:
                    runner.warm_up()
                self.chains[setting.numerics] = chain
        self._down = False
        self.outages = 0  # outages run so far

    def engine(self, setting: str, *, cache: bool = False, row_groups: int = 0) -> Any:
        """A fresh engine (its own prefix cache when ``cache``) over the setting's stages."""
        from zctl.engine.core import GenerationEngine

        chain = self.chains[self.settings[setting].numerics]
        runtime = self.settings[setting].runtime()
        for runner in chain.runners:  # the same numerics: only its class settings differ
            runner.config = runtime
        chain.chain.drop_all_prefixes()
        return GenerationEngine(
            self.tokenizer, self.stops, lambda: chain, max_streams=16, row_groups=row_groups,
            health=lambda: "down (an outage of the benchmark)" if self._down else None,
            prefix_cache_tokens=PREFIX_CACHE_TOKENS if cache else 0,
            prefill_pieces=self.settings[setting].pieces,
            one_query=self.settings[setting].one_query)

    def run(self, engine: Any, requests: Sequence[Request], outage_after: int | None = None
            ) -> list[Any]:
        """Run the requests at once to their ends: their ``GenerationDone``s in order.
        ``outage_after``: the pipeline goes down for ``OUTAGE_S`` once that many tokens
        (of all of them) were streamed."""
        from zctl.engine.requests import GenerationChunk, GenerationDone

        for i, request in enumerate(requests):
            engine.submit(i, self.request(request, f"r{i}"))
        done: dict[int, Any] = {}
        streamed, outage_at = 0, None
        start = time.monotonic()
        while engine.busy or len(done) < len(requests):
            for client, event in engine.poll(0.005):
                if isinstance(event, GenerationDone):
                    done[client] = event
                elif isinstance(event, GenerationChunk):
                    streamed += len(event.tokens)
            now = time.monotonic()
            if outage_after is not None and outage_at is None and streamed >= outage_after:
                outage_at, self._down = now, True
                self.outages += 1
            if self._down and now - outage_at >= OUTAGE_S:
                self._down = False
            if now - start > RUN_LIMIT_S:
                raise RuntimeError(f"{len(requests)} generations did not end in {RUN_LIMIT_S} s")
        self._down = False
        failed = [d.error for d in done.values() if d.error]
        if failed:
            raise RuntimeError(f"a generation failed: {failed[0]}")
        return [done[i] for i in range(len(requests))]

    def request(self, r: Request, request_id: str) -> Any:
        """The engine's request for ``r``: greedy (temperature 0)."""
        from zctl.engine.requests import ChatMessage, GenerationRequest

        common = dict(temperature=0.0, speculative=r.speculative, ignore_eos=r.ignore_eos,
                      chunk_interval_ms=0 if r.streamed else 100)
        if r.prompt_ids:
            return GenerationRequest(request_id, "", r.max_tokens, chat=False,
                                     prompt_ids=list(r.prompt_ids), **common)
        if r.follow_up:
            turns = [ChatMessage("user", r.prompt), ChatMessage("assistant", r.answer),
                     ChatMessage("user", r.follow_up)]
            return GenerationRequest(request_id, "", r.max_tokens, messages=turns, **common)
        return GenerationRequest(request_id, r.prompt, r.max_tokens, **common)
