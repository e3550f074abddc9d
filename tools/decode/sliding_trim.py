"""A sliding-window model on stateful stages past the sliding trim, against a reference.

On a stateful stage the host cuts a sliding layer's state once its slack is used up
(dataplane.runtime.kv.sliding_states). This runs one greedy stream long enough for that
to happen (a prompt of ``--prompt-tokens`` through the export's chat template, the shipped
prose as its document, then ``--new-tokens``), counts the trims on every stage, and
checks the tokens against:

  hf     Hugging Face greedy decoding of the export's source at f32 (the export should be
         fp32; the chain runs at f32 as ``zctl verify`` does): the leading tokens that
         agree, and the share of positions that do
  paged  the same export on paged stages with the same runtime settings (an INT8 export,
         say; the runtime's default numerics, or f32 with ``--exact``): the paged chain is
         fed the stateful stream's tokens one by one, and the share of positions where its
         top-1 is the stateful stream's token is reported, with the stateful stream's text

    python -m tools.decode.sliding_trim EXPORT_DIR [--against hf|paged] [--prompt-tokens 1400]
        [--new-tokens 300] [--exact] [--json]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.stateful import StageRunner
from exporter.verify import EXACT_CONFIG, hf_greedy, reference_source
from tools.harness.options import Json, fail
from tools.serving.prefill_prompts import first_turn
from zctl.engine.scheduler import greedy_kept_open
from zctl.engine.tokenizer import ChatTokenizer
from zctl.manifest import load_manifest

STREAM = 0
AGAINST = ("hf", "paged")


@dataclass
class TrimWatch:
    """The trims of one stream's sliding states on each stateful stage of a chain, seen as
    the stream's sliding start moving on between steps, and the most slots a sliding
    state held after a step (by the stream's slot table: what its states hold)."""

    runners: Sequence[StageRunner]
    stream_id: int = STREAM
    trims: list[int] = field(default_factory=list)
    most_sliding_slots: list[int] = field(default_factory=list)
    _starts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        count = len(self.runners)
        self.trims, self.most_sliding_slots, self._starts = [0] * count, [0] * count, [0] * count

    def __call__(self) -> None:
        """Note the stream's sliding start on every stage (call after each step)."""
        for i, runner in enumerate(self.runners):
            slots = runner.streams.get(self.stream_id)
            if runner.sliding is None or slots is None:
                continue
            if slots.sliding_start < self._starts[i]:  # a new stream on this id
                self._starts[i] = 0
            if slots.sliding_start > self._starts[i]:
                self.trims[i] += 1
            self._starts[i] = slots.sliding_start
            self.most_sliding_slots[i] = max(self.most_sliding_slots[i],
                                             slots.physical - slots.sliding_start)


def stateful_runners(chain: LocalChain) -> list[StageRunner]:
    """The chain's stages as stateful runners (ValueError if one is not)."""
    runners = list(chain.runners)
    if not all(isinstance(r, StageRunner) for r in runners):
        raise ValueError("the chain's stages are not stateful runners")
    return runners


def forced_top1(chain: LocalChain, prompt: list[int], tokens: list[int]) -> list[int]:
    """The chain's top-1 after ``prompt`` and after each of ``tokens`` but the last, fed
    one by one (teacher-forced on ``tokens``)."""
    chain.reset(STREAM)
    top = [int(chain.step(STREAM, np.asarray(prompt), np.arange(len(prompt))).tokens[-1])]
    for i, token in enumerate(tokens[:-1]):
        reply = chain.step(STREAM, np.asarray([token]), np.asarray([len(prompt) + i]))
        top.append(int(reply.tokens[-1]))
    return top


def long_prompt(tokenizer: ChatTokenizer, tokens: int) -> list[int]:
    """A conversation of exactly ``tokens`` ids (the shipped prose and an instruction to
    summarise it) through the export's chat template."""
    return tokenizer.encode_chat(first_turn(tokenizer, tokens, "sliding-trim"))


@dataclass
class TrimReport:
    export: str
    against: str
    exact: bool  # f32 numerics (else the runtime's defaults)
    prompt_tokens: int
    new_tokens: int
    trims: list[int]  # per stage (0 on a stage without sliding layers)
    most_sliding_slots: list[int]  # per stage, after a step
    matched: int  # leading tokens that agree with the reference (new_tokens: all of them)
    agreement: float  # share of positions whose top-1 agrees
    disagreements: list[int]  # the positions (0: the prompt's next token) where it does not
    text: str  # the stateful stream's generated text


def check(export_dir: Path, against: str, prompt_tokens: int, new_tokens: int,
          exact: bool = False) -> TrimReport:
    """Run the stateful stream and its reference (see the module's docstring); against
    paged stages at the runtime's default numerics unless ``exact``."""
    manifest = load_manifest(export_dir)
    tokenizer = ChatTokenizer(export_dir)
    prompt = long_prompt(tokenizer, prompt_tokens)
    config = EXACT_CONFIG if against == "hf" or exact else RuntimeSpec()
    chain = LocalChain.load(str(export_dir), config)
    watch = TrimWatch(stateful_runners(chain))
    got = greedy_kept_open(chain, prompt, new_tokens, STREAM, watch)
    if against == "hf":
        reference = hf_greedy(reference_source(manifest, None).load_hf_model(), prompt,
                              new_tokens)
        agree = [a == b for a, b in zip(got, reference, strict=True)]
    else:
        paged = LocalChain.load(str(export_dir), replace(config, paged_attention=True))
        agree = [a == b for a, b in zip(got, forced_top1(paged, prompt, got), strict=True)]
    matched = len(agree) if all(agree) else agree.index(False)
    return TrimReport(str(export_dir), against, exact or against == "hf", len(prompt),
                      len(got), watch.trims, watch.most_sliding_slots, matched,
                      sum(agree) / len(agree), [i for i, a in enumerate(agree) if not a],
                      tokenizer.decode(got))


def main(
    export_dir: Annotated[Path, typer.Argument(help="an export with sliding-window layers")],
    against: Annotated[str, typer.Option(help="hf (f32, exact) | paged (same settings)")] = "hf",
    prompt_tokens: Annotated[int, typer.Option(help="the prompt's tokens")] = 1400,
    new_tokens: Annotated[int, typer.Option(help="greedy tokens after it")] = 300,
    exact: Annotated[bool, typer.Option(help="--against paged: f32 numerics (hf: always)")
                     ] = False,
    as_json: Json = False,
) -> None:
    if against not in AGAINST:
        fail(f"--against takes one of {', '.join(AGAINST)}, not {against!r}")
    if prompt_tokens < 1 or new_tokens < 1:
        fail("--prompt-tokens and --new-tokens must be at least 1")
    if not load_manifest(export_dir).model.sliding_kv_trimmable:
        fail(f"{export_dir} states no trimmable sliding layers (sliding_kv_trimmable)")
    report = check(export_dir, against, prompt_tokens, new_tokens, exact)
    if as_json:
        print(json.dumps(asdict(report)))
        return
    print(f"{report.export}: {report.prompt_tokens}-token prompt + {report.new_tokens} tokens "
          f"on stateful stages, trims per stage {report.trims}, most sliding slots "
          f"{report.most_sliding_slots}")
    print(f"against {report.against}: {report.matched}/{report.new_tokens} leading tokens agree, "
          f"top-1 agreement {report.agreement:.3f}, disagreeing at {report.disagreements}")
    print(f"text: {report.text!r}")


if __name__ == "__main__":
    typer.run(main)
