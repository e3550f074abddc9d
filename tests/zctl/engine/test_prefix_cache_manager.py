"""The prefix cache through the engine: a follow-up turn (or a prompt sharing a running
stream's start) loads the cached KV and gives the tokens a full prefill gives; eviction
keeps the stages inside the budget; requests beyond the context or the KV budget are
refused or wait, leaving running streams untouched."""

from __future__ import annotations

import pytest

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from zctl.engine.core import GenerationEngine
from zctl.engine.requests import BAD_REQUEST, GenerationChunk, GenerationDone, GenerationRequest
from zctl.engine.tokenizer import ChatTokenizer

EXACT = dict(precision="f32", kv_cache_precision="f32", dynamic_quantization=False)
TEXT = ("the quick brown fox jumps over the lazy dog and then it runs far away into the "
        "green forest where the birds sing all day long ") * 2


@pytest.fixture(scope="module", params=["paged", "stateful"])
def chain_and_tokenizer(request, tiny_exports):
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    config = RuntimeSpec(**EXACT, paged_attention=request.param == "paged")
    return LocalChain.load(str(export_dir), config), ChatTokenizer(export_dir)


def engine(setup, **kwargs) -> GenerationEngine:
    chain, tokenizer = setup
    return GenerationEngine(tokenizer, [], lambda: chain, **kwargs)


def run(eng: GenerationEngine, *requests: tuple[str, GenerationRequest]) -> dict[str, GenerationDone]:
    for client, req in requests:
        eng.submit(client, req)
    done: dict[str, GenerationDone] = {}
    for _ in range(5000):
        for client, event in eng.poll(0.01):
            if isinstance(event, GenerationDone):
                done[client] = event
        if not eng.busy:
            return done
    raise AssertionError("the engine did not finish")


def turn(prompt: str, n: int = 10, rid: str = "r") -> GenerationRequest:
    """A greedy turn (its tokens compared with another run's)."""
    return GenerationRequest(rid, prompt, n, ignore_eos=True, chat=False, temperature=0.0)


def test_a_follow_up_turn_hits_the_cache_and_gives_the_same_tokens(chain_and_tokenizer) -> None:
    cold = engine(chain_and_tokenizer)
    first = run(cold, ("a", turn(TEXT)))["a"]
    follow = TEXT + first.text + " and then"
    want = run(cold, ("a", turn(follow, 12)))["a"]
    assert cold.prefix_counters()["prefix_hits"] == 0  # no cache: nothing looked up

    cached = engine(chain_and_tokenizer, prefix_cache_tokens=4096)
    assert run(cached, ("a", turn(TEXT)))["a"].tokens == first.tokens
    got = run(cached, ("a", turn(follow, 12)))["a"]
    counters = cached.prefix_counters()
    assert got.tokens == want.tokens
    assert first.cached_tokens == 0 and got.cached_tokens == counters["prefix_tokens_saved"]
    assert counters["prefix_hits"] == 1 and counters["prefix_tokens_saved"] >= len(
        chain_and_tokenizer[1].encode(TEXT, chat=False)) - 16
    assert counters["prefix_cached_tokens"] > 0  # the follow-up's own KV is kept in turn
    chain = chain_and_tokenizer[0]
    assert all(v > 0 for v in chain.prefix_bytes().values())
    cached.scheduler.prefixes.evict(0)
    assert cached.prefix_counters()["prefix_cached_tokens"] == 0
    assert all(v == 0 for v in chain.prefix_bytes().values())  # freed on every stage


def test_a_running_streams_prompt_is_a_source(chain_and_tokenizer) -> None:
    system = TEXT
    cold = engine(chain_and_tokenizer)
    want = run(cold, ("b", turn(system + "what next", 8)))["b"]
    eng = engine(chain_and_tokenizer, prefix_cache_tokens=4096)
    eng.submit("a", turn(system + "tell me", 40, "long"))
    for _ in range(200):  # until the first stream decodes: its prompt is in its KV
        if any(isinstance(e, GenerationChunk) for _, e in eng.poll(0.0)):
            break
    done = run(eng, ("b", turn(system + "what next", 8, "b")))
    assert done["b"].tokens == want.tokens and not done["a"].error
    assert eng.prefix_counters()["prefix_hits"] == 1


def test_eviction_keeps_the_cache_in_its_budget(chain_and_tokenizer) -> None:
    chain, tokenizer = chain_and_tokenizer
    eng = engine(chain_and_tokenizer, prefix_cache_tokens=150)
    for i in range(4):
        run(eng, ("a", turn(f"{i} {i} {i} " + TEXT[:200], 6)))
        assert eng.prefix_counters()["prefix_cached_tokens"] <= 150
    assert eng.prefix_counters()["prefix_evictions"] >= 2
    held = len(eng.scheduler.prefixes.index.entries())
    assert held <= 2 and all(v >= 0 for v in chain.prefix_bytes().values())


def test_beyond_the_context_is_refused_and_running_streams_are_untouched(chain_and_tokenizer
                                                                          ) -> None:
    alone = run(engine(chain_and_tokenizer), ("a", turn(TEXT, 20)))["a"]
    eng = engine(chain_and_tokenizer, max_context=256)
    eng.submit("a", turn(TEXT, 20))
    eng.poll(0.0)
    done = run(eng, ("b", turn(TEXT * 3, 20, "big")))
    assert done["b"].error_kind == BAD_REQUEST and "context of 256" in done["b"].error
    assert done["a"].tokens == alone.tokens and not done["a"].error


def test_kv_admission_waits_or_refuses(chain_and_tokenizer) -> None:
    chain, tokenizer = chain_and_tokenizer
    need = len(tokenizer.encode(TEXT, chat=False)) + 20
    eng = engine(chain_and_tokenizer, kv_budget_tokens=need + 10)
    eng.submit("a", turn(TEXT, 20, "a"))
    eng.submit("b", turn(TEXT, 20, "b"))  # does not fit beside a: waits for it
    eng.poll(0.0)
    assert eng.active == 1 and eng.waiting == 1
    done = run(eng)
    assert done["a"].tokens == done["b"].tokens and not done["b"].error
    refused = run(eng, ("c", turn(TEXT * 2, 20, "c")))["c"]
    assert refused.error_kind == BAD_REQUEST and "KV memory budget" in refused.error


def test_an_entry_missing_on_a_later_stage_costs_a_full_prefill_not_the_request(
        dp_threaded2, tiny_exports) -> None:
    pipe, worker = dp_threaded2
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    tokenizer = ChatTokenizer(export_dir)
    eng = GenerationEngine(tokenizer, [], lambda: pipe, prefix_cache_tokens=4096)
    first = run(eng, ("a", turn(TEXT)))["a"]
    want = run(GenerationEngine(tokenizer, [], lambda: pipe), ("a", turn(TEXT + " more", 8)))
    worker.runner.drop_all_prefixes()  # as if stage 1's node came back empty
    got = run(eng, ("a", turn(TEXT + " more", 8)))["a"]
    assert not first.error and not got.error
    assert got.tokens == want["a"].tokens
    # it hit, the load failed on stage 1, it healed
    assert eng.scheduler.prefixes.index.stats.hits == 1
    assert worker.stats().prefix_failures >= 1


def test_a_rewired_pipeline_starts_the_index_empty(dp_threaded2, tiny_exports) -> None:
    pipe, _ = dp_threaded2
    tokenizer = ChatTokenizer(tiny_exports.get([(0, 2), (2, 4)]))
    eng = GenerationEngine(tokenizer, [], lambda: pipe, prefix_cache_tokens=4096)
    run(eng, ("a", turn(TEXT)))
    assert eng.scheduler.prefixes.index.entries()
    pipe.abandon_all("a node went down")  # what a pause does; a rewire counts the same
    done = run(eng, ("a", turn(TEXT + " more", 8)))["a"]
    assert not done.error and eng.scheduler.prefixes.index.stats.hits == 0
