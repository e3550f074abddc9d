"""What chat and text completion replies share (zctl.serve.openai.replies): the usage of a
request's choices."""

from __future__ import annotations

from zctl.engine.requests import GenerationDone
from zctl.serve.openai.replies import usage


def done_of(prompt_tokens: int, tokens: int, cached: int) -> GenerationDone:
    return GenerationDone("r", list(range(tokens)), "x", prompt_tokens, 0, 0, stop_reason="eos",
                          cached_tokens=cached)


def test_each_prompt_counts_once_and_every_choice_its_tokens() -> None:
    # two prompts, n=2 each: the prompts' first choices carry their prompt's count
    dones = [done_of(10, 3, 4), done_of(10, 5, 9), done_of(7, 2, 0), done_of(7, 1, 6)]
    counted = usage(dones, per_prompt=2)
    assert counted.model_dump() == {"prompt_tokens": 17, "completion_tokens": 11,
                                    "total_tokens": 28,
                                    "prompt_tokens_details": {"cached_tokens": 4}}
    assert usage(dones).prompt_tokens == 34  # one choice per prompt: each counts
    assert usage([]).model_dump() == {"prompt_tokens": 0, "completion_tokens": 0,
                                      "total_tokens": 0,
                                      "prompt_tokens_details": {"cached_tokens": 0}}
