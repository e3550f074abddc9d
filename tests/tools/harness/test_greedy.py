"""The greedy reference loop (tools.harness.greedy): executors stepped token by token in
rotating order, each on its own greedy stream."""

from __future__ import annotations

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from tools.harness.greedy import paired_step_ms


def test_chains_are_stepped_token_by_token_each_on_its_own_greedy_stream(tiny_exports) -> None:
    config = RuntimeSpec(precision="f32")
    exports = {"one": tiny_exports.get([(0, 4)]), "two": tiny_exports.get([(0, 2), (2, 4)])}
    chains = {key: LocalChain.load(str(path), config) for key, path in exports.items()}
    prompt = [3, 14, 15, 92, 65]
    ms = paired_step_ms(chains, prompt, tokens=6, stream=7)
    assert set(ms) == {"one", "two"} and all(v > 0 for v in ms.values())
    for chain in chains.values():  # prompt + 6 decode steps landed on stream 7
        assert all(r.streams[7].physical == len(prompt) + 6 for r in chain.runners)
    # a second call starts over (the stream is reset), so the figures stay comparable
    paired_step_ms(chains, prompt, tokens=2, stream=7)
    assert all(r.streams[7].physical == len(prompt) + 2 for c in chains.values()
               for r in c.runners)
