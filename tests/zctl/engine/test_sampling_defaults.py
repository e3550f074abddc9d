"""zctl.engine.sampling_defaults: a request that leaves sampling out gets the model's
generation config where it says (do_sample false: greedy), llama-server's defaults
elsewhere; a field the request gives overrides just that field; the engine samples so
and says so in the generation's end."""

from __future__ import annotations

from pathlib import Path

import pytest

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from zctl.engine.admission import SessionLimits, new_session
from zctl.engine.core import GenerationEngine
from zctl.engine.requests import (
    FROM_GENERATION_CONFIG,
    FROM_LLAMA_SERVER,
    GenerationDone,
    GenerationRequest,
    Sampling,
)
from zctl.engine.sampling_defaults import (
    LLAMA_SERVER_SAMPLING,
    SamplingConfigError,
    model_sampling,
    request_sampling,
)
from zctl.engine.scheduler import generate_greedy
from zctl.engine.tokenizer import ChatTokenizer
from zctl.manifest import GenerationConfig

LLAMA = Sampling(0.8, 40, 0.95, 0.05, 1.0, FROM_LLAMA_SERVER)


def test_without_a_generation_config_the_defaults_are_llama_servers() -> None:
    assert LLAMA_SERVER_SAMPLING == LLAMA
    assert model_sampling(None) == LLAMA
    # a config without sampling fields (a GGUF's, transformers' from the model config)
    assert model_sampling(GenerationConfig()) == LLAMA
    assert model_sampling(GenerationConfig(do_sample=True)) == LLAMA


def test_a_generation_config_gives_what_it_has_and_llama_server_the_rest() -> None:
    full = GenerationConfig(do_sample=True, temperature=0.6, top_k=20, top_p=0.8, min_p=0.0,
                            repetition_penalty=1.05)
    assert model_sampling(full) == Sampling(0.6, 20, 0.8, 0.0, 1.05, FROM_GENERATION_CONFIG)
    partial = GenerationConfig(temperature=0.7, top_p=0.9)
    assert model_sampling(partial) == Sampling(0.7, 40, 0.9, 0.05, 1.0, FROM_GENERATION_CONFIG)


def test_do_sample_false_is_greedy_whatever_the_temperature() -> None:
    greedy = model_sampling(GenerationConfig(do_sample=False, temperature=0.7,
                                             repetition_penalty=1.1))
    assert greedy == Sampling(0.0, 40, 0.95, 0.05, 1.1, FROM_GENERATION_CONFIG)


@pytest.mark.parametrize(("config", "field"), [
    (GenerationConfig(repetition_penalty=3.0), "repetition_penalty"),
    (GenerationConfig(top_p=0.0), "top_p"), (GenerationConfig(temperature=-1.0), "temperature"),
    (GenerationConfig(min_p=1.5), "min_p"), (GenerationConfig(top_k=-1), "top_k")])
def test_a_value_no_request_may_ask_is_refused(config: GenerationConfig, field: str) -> None:
    with pytest.raises(SamplingConfigError, match=f"generation config: {field}"):
        model_sampling(config)


def test_a_request_overrides_only_the_fields_it_gives() -> None:
    model = Sampling(0.6, 20, 0.8, 0.0, 1.05, FROM_GENERATION_CONFIG)
    assert request_sampling(GenerationRequest("r", "hi"), model) == model
    assert request_sampling(GenerationRequest("r", "hi", top_k=0), model) == Sampling(
        0.6, 0, 0.8, 0.0, 1.05, FROM_GENERATION_CONFIG)
    assert request_sampling(GenerationRequest("r", "hi", temperature=0), LLAMA) == Sampling(
        0.0, 40, 0.95, 0.05, 1.0, FROM_LLAMA_SERVER)
    given = GenerationRequest("r", "hi", temperature=1.0, top_k=5, top_p=0.5, min_p=0.1,
                              repetition_penalty=1.3)
    assert request_sampling(given, LLAMA) == Sampling(1.0, 5, 0.5, 0.1, 1.3, FROM_LLAMA_SERVER)


def test_a_session_samples_with_the_defaults_it_is_given() -> None:
    limits = SessionLimits(100, None, 50, [2])
    plain = new_session(0, GenerationRequest("r", "hi", 8), [1, 5], limits)
    assert plain.sampling is not None and (plain.sampling.temperature, plain.sampling.top_k,
                                           plain.sampling.min_p) == (0.8, 40, 0.05)
    greedy_model = Sampling(0.0, 0, 1.0, 0.0, 1.0, FROM_GENERATION_CONFIG)
    assert new_session(0, GenerationRequest("r", "hi", 8), [1, 5], limits,
                       defaults=greedy_model).sampling is None  # plain greedy: no sampler
    told = new_session(0, GenerationRequest("r", "hi", 8, temperature=0.5), [1, 5], limits,
                       defaults=greedy_model)
    assert told.sampling is not None and told.sampling.temperature == 0.5


def test_the_request_checks_what_it_gives_and_takes_none_as_left_out() -> None:
    assert GenerationRequest("r", "hi").problem() is None
    for bad, why in (({"temperature": -0.1}, "temperature"), ({"top_k": -1}, "top_k"),
                     ({"top_p": 0.0}, "top_p"), ({"min_p": 2.0}, "min_p"),
                     ({"repetition_penalty": 0.0}, "repetition_penalty")):
        assert why in (GenerationRequest("r", "hi", **bad).problem() or "")


# -- the engine ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tiny_exports):
    export_dir: Path = tiny_exports.get([(0, 2), (2, 4)])
    chain = LocalChain.load(str(export_dir), RuntimeSpec(precision="f32"))
    return chain, ChatTokenizer(export_dir)


def generate(setup, request: GenerationRequest, **engine_options) -> GenerationDone:
    chain, tokenizer = setup
    engine = GenerationEngine(tokenizer, [], lambda: chain, **engine_options)
    engine.submit("c", request)
    for _ in range(2000):
        done = [e for _, e in engine.poll(0.0) if isinstance(e, GenerationDone)]
        if done:
            assert not done[0].error, done[0].error
            return done[0]
    raise AssertionError("the generation did not end")


def test_the_engine_samples_by_default_and_says_with_what(setup) -> None:
    chain, tokenizer = setup
    prompt = "one two three one two three one two"
    greedy = list(generate_greedy(chain, tokenizer.encode(prompt), 16))
    runs = [generate(setup, GenerationRequest(f"s{i}", prompt, 16, ignore_eos=True, seed=7))
            for i in range(2)]
    assert runs[0].sampling == LLAMA
    assert runs[0].tokens == runs[1].tokens != greedy  # sampled, repeatably with a seed
    told = generate(setup, GenerationRequest("g", prompt, 16, ignore_eos=True, temperature=0))
    assert told.tokens == greedy and told.sampling == Sampling(0.0, 40, 0.95, 0.05, 1.0)
    model_greedy = model_sampling(GenerationConfig(do_sample=False))
    plain = generate(setup, GenerationRequest("m", prompt, 16, ignore_eos=True),
                     sampling_defaults=model_greedy)
    assert plain.tokens == greedy and plain.sampling == model_greedy
