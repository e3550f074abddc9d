"""Structured output against free text: what holding the output to a JSON Schema costs.

One stream on a 2-node local cluster, driven through the generation service as
``zctl serve`` drives it, with the stages' default runtime. Per task (a prompt asking
for a JSON object, and its schema), interleaved, the order alternated run by run:

* ``schema``: the request holds the output to the schema (``grammar_kind="json_schema"``,
  zctl.engine.constraints); it ends when the object is complete;
* ``free``: the same prompt unconstrained, for as many tokens as the schema run took
  (EOS ignored), the baseline;
* with ``--lookup``, ``lookup``: held to the schema with prompt-lookup speculation
  (adaptive K), its drafts checked by the grammar (``lookup_ratio`` over free,
  ``lookup_over_schema`` over the schema run, ``lookup_same``: runs whose output equals
  the schema run's of the same round).

Six tasks invent an object; two extract one from text in the prompt, whose values
lookup can copy.

With ``--auto``, a text answer under ``tool_choice: "auto"`` (the default when a request
gives tools): four questions no tool answers, each with a tool shown in the system
message as ``zctl serve`` shows it, the output held to a call or text
(``json_or_text``, which lets go once the first token is text) against the same
messages free, for AUTO_TOKENS tokens (EOS ignored); ``auto_ratio`` per question and
``mean_auto_ratio``, ``auto_text``: runs that answered in text.

A warm-up pass first builds the grammar compiler (``first_request_extra_ms``: how much
longer the first schema request took end to end than the same request's median later)
and fixes each task's token count. Decode throughput is the service's
``GenerationDone.tok_s`` (tokens after the first over their time); per task the medians,
and the ratio schema / free paired run by run; ``mean_ratio`` is the mean over tasks.
``schema_valid`` counts schema outputs that parse and hold every required key of the
right JSON type (``schema_cut``: those ``MAX_TOKENS`` cut short, a valid prefix);
``free_json`` counts free outputs that parse as JSON at all (the model asked for JSON,
without a constraint).

    python -m tools.serving.structured [--model smollm2-135m] [--weights int8] [--runs 3]
        [--cpu-sets shared] [--lookup] [--auto] [--json]
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from tools.harness.models import BenchModel
from tools.harness.options import CpuSets, Json, Model, Runs, Weights, fail
from tools.harness.order import rotated
from tools.harness.report import print_result, run_record
from tools.harness.service import generate_done
from tools.harness.stats import paired_ratio, rounded

NODES = 2
MAX_TOKENS = 200  # a schema run's limit (each task's object is far shorter)
AUTO_TOKENS = 96  # an --auto run's tokens
AUTO_QUESTIONS = ["Tell me a joke about cats.", "What is the capital of France?",
                  "Write a haiku about rain.", "Explain photosynthesis briefly."]


def _obj(required: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": dict(required), "required": list(required),
            "additionalProperties": False}


AUTO_TOOL = {"name": "get_weather", "description": "Get the current weather in a city",
             "parameters": _obj({"city": {"type": "string"}})}
TASKS: list[tuple[str, str, dict[str, Any]]] = [
    ("person", "Invent a person. Give their name, age and city as JSON.",
     _obj({"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}})),
    ("book", "Describe a famous novel as JSON: its title, author and year of publication.",
     _obj({"title": {"type": "string"}, "author": {"type": "string"},
           "year": {"type": "integer"}})),
    ("weather", "Report today's weather in Paris as JSON.",
     _obj({"city": {"type": "string"}, "temperature_c": {"type": "number"},
           "sky": {"enum": ["sunny", "cloudy", "rainy", "snowy"]}})),
    ("recipe", "Give a simple pancake recipe as JSON with a name and a list of ingredients.",
     _obj({"name": {"type": "string"},
           "ingredients": {"type": "array", "items": {"type": "string", "maxLength": 40},
                           "maxItems": 6}})),
    ("review", "Write a short review of a coffee shop as JSON: a rating from 1 to 5 and a "
     "one-sentence summary.",
     _obj({"rating": {"type": "integer", "minimum": 1, "maximum": 5},
           "summary": {"type": "string"}})),
    ("event", "Plan a team meeting as JSON: its topic, its date (YYYY-MM-DD) and whether it "
     "is online.",
     _obj({"topic": {"type": "string"}, "date": {"type": "string",
                                                 "pattern": r"^\d{4}-\d{2}-\d{2}$"},
           "online": {"type": "boolean"}})),
    ("contact", "Extract the name, the email and the city from this message as JSON: 'Hi, "
     "I am Maria Lopez (maria.lopez@example.com), writing from Valencia about my order.'",
     _obj({"name": {"type": "string"}, "email": {"type": "string", "maxLength": 60},
           "city": {"type": "string", "maxLength": 40}})),
    ("invoice", "Extract the invoice number, the due date and the total as JSON from: "
     "'Invoice INV-2041 for the Harbor Street office is due on 2024-03-15; the total is "
     "1250.50.'",
     _obj({"invoice": {"type": "string", "maxLength": 20},
           "due": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
           "total": {"type": "number"}})),
]
JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
              "array": list}


def holds(text: str, schema: Mapping[str, Any]) -> bool:
    """``text`` parses as an object with exactly the schema's keys, each of its type."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if not isinstance(value, dict) or set(value) != set(schema["required"]):
        return False
    for key, spec in schema["properties"].items():
        if "enum" in spec:
            if value[key] not in spec["enum"]:
                return False
        elif not isinstance(value[key], JSON_TYPES[spec["type"]]) or (
                spec["type"] in ("integer", "number") and isinstance(value[key], bool)):
            return False
    return True


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def run_schema(serve: str, text: str, schema: Mapping[str, Any], speculative: str = "") -> Any:
    return generate_done(serve, text, MAX_TOKENS, grammar_kind="json_schema",
                         grammar=json.dumps(schema), speculative=speculative)


def measure(serve: str, runs: int, lookup: bool = False) -> tuple[list[dict[str, Any]], float]:
    """Every task's entry, and how much longer the first schema request took, end to end,
    than the same request's median later (the engine builds its grammar compiler)."""
    start = time.perf_counter()
    warm = [run_schema(serve, TASKS[0][1], TASKS[0][2])]
    first_ms = (time.perf_counter() - start) * 1e3
    warm += [run_schema(serve, text, schema) for _, text, schema in TASKS[1:]]
    counts = [max(2, len(done.tokens)) for done in warm]
    systems = ("schema", "free", "lookup") if lookup else ("schema", "free")
    samples: list[dict[str, list[Any]]] = [{s: [] for s in systems} for _ in TASKS]
    later_ms: list[float] = []
    for run in range(runs):
        for i, (_, text, schema) in enumerate(TASKS):
            order = systems if run % 2 == 0 else systems[::-1]
            for system in order:
                start = time.perf_counter()
                done = (generate_done(serve, text, counts[i]) if system == "free"
                        else run_schema(serve, text, schema,
                                        "lookup" if system == "lookup" else ""))
                samples[i][system].append(done)
                if i == 0 and system == "schema":
                    later_ms.append((time.perf_counter() - start) * 1e3)
    entries = [task_entry(name, schema, counts[i], samples[i])
               for i, (name, _, schema) in enumerate(TASKS)]
    return entries, first_ms - statistics.median(later_ms)


def measure_auto(serve: str, runs: int) -> list[dict[str, Any]]:
    """Each --auto question's entry: tok/s of its text answer held to a call or text,
    against the same messages free, interleaved with the order alternated."""
    from zctl.engine.requests import ChatMessage
    from zctl.serve.tools import FunctionDef, ToolPlan, tool_grammar, with_tools_prompt

    plan = ToolPlan([FunctionDef.model_validate(AUTO_TOOL)], optional=True)
    kind, grammar = tool_grammar(plan)

    def run(question: str, held: bool) -> Any:
        messages = [ChatMessage(r, t) for r, t in with_tools_prompt([("user", question)], plan)]
        fields: dict[str, Any] = {"grammar_kind": kind, "grammar": grammar} if held else {}
        return generate_done(serve, "", AUTO_TOKENS, messages=messages, **fields)

    run(AUTO_QUESTIONS[0], True)  # warm-up
    entries = []
    for question in AUTO_QUESTIONS:
        samples: dict[bool, list[Any]] = {True: [], False: []}
        for r in range(runs):
            for held in rotated((True, False), r):
                samples[held].append(run(question, held))
        entries.append({
            "question": question, "auto_tok_s": statistics.median(d.tok_s for d in samples[True]),
            "free_tok_s": statistics.median(d.tok_s for d in samples[False]),
            "auto_ratio": rounded(paired_ratio([d.tok_s for d in samples[True]],
                                               [d.tok_s for d in samples[False]])),
            "auto_text": sum(not d.text.startswith("{") for d in samples[True])})
    return entries


def task_entry(name: str, schema: Mapping[str, Any], tokens: int,
               samples: Mapping[str, Sequence[Any]]) -> dict[str, Any]:
    schema_runs, free_runs = samples["schema"], samples["free"]
    return {
        "task": name, "tokens": tokens,
        "schema_tok_s": statistics.median(d.tok_s for d in schema_runs),
        "free_tok_s": statistics.median(d.tok_s for d in free_runs),
        "ratio": rounded(paired_ratio([d.tok_s for d in schema_runs],
                                      [d.tok_s for d in free_runs])),
        "schema_ttft_ms": statistics.median(d.ttft_ms for d in schema_runs),
        "free_ttft_ms": statistics.median(d.ttft_ms for d in free_runs),
        "schema_valid": sum(holds(d.text, schema) for d in schema_runs),
        "schema_cut": sum(d.stop_reason == "max_tokens" for d in schema_runs),
        "free_json": sum(parses(d.text) for d in free_runs), "runs": len(schema_runs),
        "schema_text": schema_runs[-1].text, "free_text": free_runs[-1].text,
        **lookup_figures(samples.get("lookup", []), schema_runs, free_runs, schema),
    }


def lookup_figures(lookup_runs: Sequence[Any], schema_runs: Sequence[Any],
                   free_runs: Sequence[Any], schema: Mapping[str, Any]) -> dict[str, Any]:
    """The lookup system's figures for a task (none when it did not run)."""
    if not lookup_runs:
        return {}
    speeds = [d.tok_s for d in lookup_runs]
    return {"lookup_tok_s": statistics.median(speeds),
            "lookup_ratio": rounded(paired_ratio(speeds, [d.tok_s for d in free_runs])),
            "lookup_over_schema": rounded(paired_ratio(speeds, [d.tok_s for d in schema_runs])),
            "lookup_valid": sum(holds(d.text, schema) for d in lookup_runs),
            "lookup_cut": sum(d.stop_reason == "max_tokens" for d in lookup_runs),
            "lookup_same": sum(a.text == b.text for a, b in zip(lookup_runs, schema_runs,
                                                                 strict=True))}


def render(result: Mapping[str, Any], console: Console) -> None:
    table = Table(title=f"structured output vs free text ({result['cpu']}, {result['commit']})")
    for column in ("task", "tokens", "schema tok/s", "free tok/s", "ratio", "TTFT schema / free ms",
                   "schema valid", "free parses"):
        table.add_column(column)
    for e in result["tasks"]:
        table.add_row(e["task"], str(e["tokens"]), f"{e['schema_tok_s']:.1f}",
                      f"{e['free_tok_s']:.1f}", f"{e['ratio']:.3f}",
                      f"{e['schema_ttft_ms']:.0f} / {e['free_ttft_ms']:.0f}",
                      f"{e['schema_valid']}/{e['runs']}", f"{e['free_json']}/{e['runs']}")
    console.print(table)
    if "mean_lookup_ratio" in result:
        for e in result["tasks"]:
            console.print(f"{e['task']}: lookup {e['lookup_tok_s']:.1f} tok/s, "
                          f"{e['lookup_ratio']:.3f}x free, {e['lookup_over_schema']:.3f}x "
                          f"schema, valid {e['lookup_valid']}/{e['runs']}, same as schema "
                          f"{e['lookup_same']}/{e['runs']}")
        console.print(f"mean lookup ratio {result['mean_lookup_ratio']:.3f} "
                      f"(over schema {result['mean_lookup_over_schema']:.3f})")
    for e in result.get("auto", []):
        console.print(f"auto, {e['question']!r}: {e['auto_tok_s']:.1f} tok/s against free "
                      f"{e['free_tok_s']:.1f} ({e['auto_ratio']:.3f}x), text "
                      f"{e['auto_text']}/{result['runs']}")
    if "mean_auto_ratio" in result:
        console.print(f"mean auto ratio {result['mean_auto_ratio']:.3f}")
    console.print(f"mean ratio {result['mean_ratio']:.3f}; the first schema request took "
                  f"{result['first_request_extra_ms']:.0f} ms longer (it builds the grammar "
                  "compiler)")


def main(model: Model = "smollm2-135m", weights: Weights = "int8", runs: Runs = 3,
         cpu_sets: CpuSets = "shared",
         lookup: Annotated[bool, typer.Option(help="also run each schema request with "
                                                   "prompt-lookup speculation")] = False,
         auto: Annotated[bool, typer.Option(help="also time text answers under "
                                                 "tool_choice auto against free text")] = False,
         as_json: Json = False) -> None:
    from tools.harness.cluster import local_cluster
    from zctl.launcher.processes import runtime_spec

    if runs < 1:
        fail("--runs needs at least 1")
    bench_model = BenchModel.resolve(model)
    export_dir = bench_model.export(NODES, weights)
    with local_cluster(export_dir, NODES, runtime_spec(None, None, "CPU"),
                       bench_model.cache / "bench-structured", cpu_sets=cpu_sets) as record:
        entries, first_extra = measure(record.serve, runs, lookup)
        auto_entries = measure_auto(record.serve, runs) if auto else []
    result = {"mean_ratio": statistics.mean(e["ratio"] for e in entries),
              **({"mean_lookup_ratio": statistics.mean(e["lookup_ratio"] for e in entries),
                  "mean_lookup_over_schema": statistics.mean(e["lookup_over_schema"]
                                                             for e in entries)}
                 if lookup else {}),
              **({"mean_auto_ratio": statistics.mean(e["auto_ratio"] for e in auto_entries),
                  "auto": auto_entries} if auto else {}),
              "first_request_extra_ms": first_extra, **run_record(), "model": model,
              "weights": weights, "runs": runs, "cpu_sets": cpu_sets, "tasks": entries}
    print_result(result, as_json, render)


if __name__ == "__main__":
    typer.run(main)
