"""An A/B of one setting, end to end: two local clusters that differ only in their
environment, generating in turn, compared run by run.

Whole benchmark runs drift by +-10% on these machines, more than most changes are worth.
Two clusters started side by side (each idle while the other generates), with their
runs alternated (A B, B A, ...) and compared pair by pair, resolve a 2-3% difference in
eight pairs. Each cluster is the real thing (``zctl cluster up --local``): a coordinator
and node processes on loopback addresses, driven through the generation service.

    python -m tools.decode.cluster_ab --a ZCTL_HUGE_PAGES=1 --b ZCTL_HUGE_PAGES=0 \\
        [--pairs 8] [--tokens 96] [--cpu-sets shared|split] [--json]
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from dataplane.runtime.config import RuntimeSpec
from tools.harness.cluster import local_cluster
from tools.harness.models import model_export
from tools.harness.options import CpuSets, Json, Model, Precision, Tokens, Weights, fail
from tools.harness.order import rotated
from tools.harness.report import err
from tools.harness.stats import paired_ratio, rounded


def parse_env(assignments: Sequence[str]) -> dict[str, str]:
    """``["VAR=VALUE", ...]`` as a dict; ValueError names a malformed one."""
    env: dict[str, str] = {}
    for item in assignments:
        name, sep, value = item.partition("=")
        if not sep or not name or not name.replace("_", "").isalnum() or name[0].isdigit():
            raise ValueError(f"{item!r} is not VAR=VALUE (an environment variable and its value)")
        env[name] = value
    return env


@contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``env`` applied (processes started inside inherit it), restored after."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def paired_summary(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Medians of A's and B's tok/s and of A over B pair by pair (with the mean and the
    pairs' range: a change is real when most pairs agree)."""
    if len(a) != len(b) or not a:
        raise ValueError("A and B need the same, non-zero number of runs")
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    return {"a_tok_s": round(statistics.median(a), 2), "b_tok_s": round(statistics.median(b), 2),
            "a_over_b_paired": rounded(paired_ratio(a, b)),
            "a_over_b_mean": round(statistics.mean(ratios), 3),
            "a_over_b_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "a_faster_pairs": sum(r > 1 for r in ratios), "pairs": len(ratios)}


def run_ab(export_dir: Path, env_a: dict[str, str], env_b: dict[str, str], pairs: int,
           tokens: int, runtime: RuntimeSpec, root: Path, cpu_sets: str = "shared",
           prompt: str = "Explain in detail how a bicycle's gears work.") -> dict[str, Any]:
    """Start a local cluster per environment under ``root``, alternate ``pairs`` runs of
    ``tokens`` greedy tokens on each (A first in even pairs, B first in odd ones)."""
    from tools.decode.cluster import cluster_run

    with ExitStack() as clusters:
        records = {}
        for name, env in (("a", env_a), ("b", env_b)):
            with environment(env):
                records[name] = clusters.enter_context(local_cluster(
                    export_dir, 2, runtime, root / name, cpu_sets=cpu_sets))
        for record in records.values():
            cluster_run(record.serve, prompt, 8)  # warm-up
        tok_s: dict[str, list[float]] = {"a": [], "b": []}
        for i in range(pairs):
            for name in rotated(("a", "b"), i):
                tok_s[name].append(cluster_run(records[name].serve, prompt, tokens)["tok_s"])
            err.print(f"pair {i + 1}/{pairs}: A {tok_s['a'][-1]:.1f}  B {tok_s['b'][-1]:.1f} tok/s")
    return {"a": env_a, "b": env_b, "tokens": tokens, "cpu_sets": cpu_sets,
            **paired_summary(tok_s["a"], tok_s["b"]),
            "samples": {k: [round(v, 2) for v in vs] for k, vs in tok_s.items()}}


def main(
    a: Annotated[list[str], typer.Option("--a", help="VAR=VALUE for cluster A (repeatable)")],
    b: Annotated[list[str], typer.Option("--b", help="VAR=VALUE for cluster B (repeatable)")],
    model: Model = "smollm2-135m",
    weights: Weights = "int4",
    pairs: Annotated[int, typer.Option(help="runs of each cluster, alternated")] = 8,
    tokens: Tokens = 96,
    cpu_sets: CpuSets = "shared",
    precision: Precision = "f32",
    as_json: Json = False,
) -> None:
    from zctl.launcher.processes import runtime_spec
    from zctl.paths import zctl_home

    try:
        env_a, env_b = parse_env(a), parse_env(b)
    except ValueError as exc:
        fail(str(exc))
    export_dir = model_export(model, 2, weights)
    result = run_ab(export_dir, env_a, env_b, pairs, tokens,
                    runtime_spec(None if precision == "default" else precision, None, "CPU"),
                    zctl_home() / "bench-ab", cpu_sets)
    if as_json:
        print(json.dumps(result))
        return
    Console().print(f"A {env_a}: {result['a_tok_s']} tok/s   B {env_b}: {result['b_tok_s']} tok/s\n"
                    f"A over B, pair by pair: median {result['a_over_b_paired']}, mean "
                    f"{result['a_over_b_mean']}, range {result['a_over_b_range']}, A faster in "
                    f"{result['a_faster_pairs']} of {result['pairs']} pairs")


if __name__ == "__main__":
    typer.run(main)
