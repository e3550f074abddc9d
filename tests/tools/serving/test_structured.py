"""tools/serving/structured's pure parts: the schema check of its tasks' outputs and a
task's figures from its runs (the cluster run is `python -m tools.serving.structured`)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tools.serving.structured import TASKS, holds, parses, task_entry
from zctl.engine.constraints import GrammarCompiler

PERSON = TASKS[0][2]


def test_holds_checks_keys_types_and_enums() -> None:
    assert holds('{"name": "Ann", "age": 30, "city": "Oslo"}', PERSON)
    for bad in ('{"name": "Ann", "age": 30}', '{"name": "Ann", "age": "30", "city": "Oslo"}',
                '{"name": "Ann", "age": true, "city": "Oslo"}', '["Ann"]', "The person: {",
                '{"name": "Ann", "age": 30, "city": "Oslo", "x": 1}'):
        assert not holds(bad, PERSON), bad
    weather = TASKS[2][2]
    assert holds('{"city": "Paris", "temperature_c": 21.5, "sky": "sunny"}', weather)
    assert not holds('{"city": "Paris", "temperature_c": 21.5, "sky": "foggy"}', weather)
    assert parses("[1, 2]") and not parses("```json\n{}")


def test_a_task_entry_pairs_its_runs() -> None:
    def done(tok_s: float, text: str) -> SimpleNamespace:
        return SimpleNamespace(tok_s=tok_s, ttft_ms=20.0, text=text,
                               stop_reason="eos" if text.endswith("}") else "max_tokens")

    good = '{"name": "Ann", "age": 30, "city": "Oslo"}'
    entry = task_entry("person", PERSON, 12, {
        "schema": [done(45.0, good), done(50.0, good), done(40.0, "{")],
        "free": [done(50.0, "hi"), done(50.0, good), done(50.0, "x")]})
    assert entry["ratio"] == pytest.approx(0.9)  # the median of 0.9, 1.0, 0.8
    assert (entry["schema_tok_s"], entry["free_tok_s"]) == (45.0, 50.0)
    assert (entry["schema_valid"], entry["free_json"], entry["runs"]) == (2, 1, 3)
    assert entry["schema_cut"] == 1
    assert "lookup_ratio" not in entry  # the lookup system did not run
    with_lookup = task_entry("person", PERSON, 12, {
        "schema": [done(40.0, good), done(50.0, good)], "free": [done(50.0, "x")] * 2,
        "lookup": [done(60.0, good), done(50.0, "{")]})
    assert with_lookup["lookup_ratio"] == pytest.approx(1.1)  # median of 1.2 and 1.0
    assert with_lookup["lookup_over_schema"] == pytest.approx(1.25)  # of 1.5 and 1.0
    assert (with_lookup["lookup_valid"], with_lookup["lookup_same"]) == (1, 1)
    assert with_lookup["lookup_cut"] == 1


def test_every_task_schema_compiles(tiny_llama_dir) -> None:
    from zctl.engine.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer(tiny_llama_dir)
    compiler = GrammarCompiler(tokenizer.backend.to_str(), tokenizer.vocab_size,
                               [tokenizer.eos_token_id])
    for name, _, schema in TASKS:
        assert compiler.constraint("json_schema", json.dumps(schema)), name
