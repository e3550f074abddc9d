"""Phi-3's LongRoPE and partial RoPE (Phi-3 128k, Phi-3.5, Phi-4-mini) export exactly: a
tiny Phi-3 whose RoPE turns 12 of each 16-wide head, with short and long factors (random,
unequal) switching at original_max_position_embeddings = SHORT_CONTEXT, reproduces
Hugging Face's greedy tokens stage by stage on the stateful and the paged runner, with
prompts crossing that length and decodes crossing it, alone and in one row group, and a
speculative decoding whose verification steps span it; a prompt past that length fed in
pieces below it turns long throughout, and a prefix-cache entry serves only prompts of
the set its keys turned with."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dataplane.head.local_chain import LocalChain
from exporter.export import export_model, model_spec
from exporter.sources import open_source
from exporter.verify import DEFAULT_PROMPTS, EXACT_CONFIG, hf_greedy, verify_export
from tests.exporter.exactness import run_to_end
from tests.helpers.tiny_models import build_llama
from tests.zctl.engine.test_drafting import ScriptedDrafter
from zctl.engine.executor import Step, StepReply
from zctl.engine.prefix_index import PrefixIndexStats
from zctl.engine.scheduler import StreamScheduler, generate_greedy, generate_speculative
from zctl.engine.sessions import DecodeSession
from zctl.engine.stats import SpeculativeStats
from zctl.engine.tokenizer import ChatTokenizer
from zctl.manifest import (
    ExportManifest,
    ManifestError,
    StageSpec,
    StaticKV,
    load_manifest,
    manifest_from_dict,
)

TOKENS = 32
PIECE = 8  # the engine's prefill pieces in the tests of prompts cut into pieces
# the 5 default prompts are 29 to 48 tokens with the tiny tokenizer's chat template: the
# two shortest cross this during their decode, the other three in their prompt
SHORT_CONTEXT = 36
ROTARY = 12  # of each 16-wide head: partial_rotary_factor 0.75


def _rope_parameters() -> dict:
    rng = np.random.default_rng(7)
    return {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": rng.uniform(1.0, 2.0, ROTARY // 2).round(4).tolist(),
            "long_factor": rng.uniform(2.0, 8.0, ROTARY // 2).round(4).tolist(),
            "original_max_position_embeddings": SHORT_CONTEXT}


@pytest.fixture(scope="module")
def longrope_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model dir, its export in 3 uneven stages)."""
    root = tmp_path_factory.mktemp("longrope")
    model_dir = build_llama(root / "model", arch="phi3", pad_token_id=None, tied=False,
                            norm_spread=0.3, rope_parameters=_rope_parameters(),
                            original_max_position_embeddings=SHORT_CONTEXT)
    export_model(open_source(str(model_dir)), [(0, 1), (1, 3), (3, 4)], "fp32", root / "export")
    return model_dir, root / "export"


def _run_together(chain: LocalChain, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of ``prompts`` decoded at once in one row group."""
    scheduler = StreamScheduler(chain, row_groups=1)
    sessions = [DecodeSession(10 + i, prompt, TOKENS) for i, prompt in enumerate(prompts)]
    for session in sessions:
        scheduler.add(session)
    while scheduler.active:
        scheduler.poll()
    assert all(session.error is None for session in sessions)
    assert scheduler.rows_stepped > scheduler.row_steps  # steps did carry several rows
    return [session.emitted for session in sessions]


@pytest.mark.slow
def test_longrope_and_partial_rope_match_hf_greedy(longrope_export) -> None:
    model_dir, export_dir = longrope_export
    source = open_source(str(model_dir))
    model = load_manifest(export_dir).model
    assert (len(model.rope_inv_freq), model.rope_short_context) == (ROTARY // 2, SHORT_CONTEXT)
    assert model.rope_long_inv_freq != model.rope_inv_freq
    hf = source.load_hf_model()
    tokenizer = ChatTokenizer(export_dir)
    prompts = [tokenizer.encode(p) for p in DEFAULT_PROMPTS]
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] + TOKENS > SHORT_CONTEXT >= lengths[1] and lengths[2] > SHORT_CONTEXT

    results = verify_export(export_dir, DEFAULT_PROMPTS, max_new_tokens=TOKENS, hf_model=hf)
    assert [r.matched for r in results] == [TOKENS] * len(DEFAULT_PROMPTS)
    assert len(set(results[0].chain)) > 8  # not degenerate: a constant stream hides bugs

    # speculation from a prompt below the threshold, drafts rejected at every position
    # and a verification step spanning it (stateful, rewinding by mask; paged)
    crossing = min(range(len(prompts)), key=lambda i: len(prompts[i]))
    reference = results[crossing].reference
    paged = LocalChain.load(str(export_dir), replace(EXACT_CONFIG, paged_attention=True))
    chains = {"mask": LocalChain.load(str(export_dir), EXACT_CONFIG, rewind="mask"),
              "paged": paged}
    for runner, chain in chains.items():
        stats = SpeculativeStats()
        drafter = ScriptedDrafter(prompts[crossing], reference)
        assert list(generate_speculative(chain, prompts[crossing], TOKENS, drafter=drafter,
                                         k=4, stats=stats, stream_id=1)) == reference, runner
        assert stats.rejections > 3 and stats.accepted > 3

    # paged, alone and in a row group: a row below the threshold, one crossing it in its
    # decode, and one past it from its prompt on, each turning with its own set
    beyond = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    below = tokenizer.encode("Hi there", chat=False)
    assert len(below) + TOKENS // 2 < SHORT_CONTEXT
    got = _run_together(paged, [prompts[crossing], prompts[beyond], below])
    assert got[0] == results[crossing].reference and got[1] == results[beyond].reference
    assert got[2] == hf_greedy(hf, below, TOKENS)
    # the whole graph reads rope inputs 12 wide: a table as wide as the head is refused
    assert paged.runners[0].rope.width == ROTARY


class PieceChain(LocalChain):
    """A LocalChain that notes each step's first position and token count."""

    def compute(self, step: Step) -> StepReply:
        self.pieces.append((int(step.positions.reshape(-1)[0]), int(step.positions.size)))
        return super().compute(step)


class ShortPrompts(LocalChain):
    """A LocalChain that never tells its stages a sequence is long (what the stages did
    before a reset carried it): a prompt's pieces each turn by their own positions."""

    def reset(self, stream_id: int, long_rope: bool = False) -> None:
        super().reset(stream_id, False)


def _chains(export_dir: Path, kind: type[LocalChain] = PieceChain) -> dict[str, LocalChain]:
    paged = replace(EXACT_CONFIG, paged_attention=True)
    chains = {"stateful": kind.load(str(export_dir), EXACT_CONFIG, rewind="mask"),
              "paged": kind.load(str(export_dir), paged)}
    for chain in chains.values():
        chain.pieces = []
    return chains


@pytest.mark.slow
def test_a_prompt_past_the_threshold_fed_in_pieces_turns_long_throughout(longrope_export
                                                                        ) -> None:
    """Hugging Face's one pass over a prompt longer than SHORT_CONTEXT turns every token of
    it with the long set. Fed in PIECE-token pieces (the first ending far below the
    threshold), on the stateful and the paged runner, greedy, speculative (drafts rejected
    at every position) and beside a short prompt in one row group: Hugging Face's tokens.
    Stages not told the sequence is long turn its first pieces short, and diverge."""
    model_dir, export_dir = longrope_export
    hf = open_source(str(model_dir)).load_hf_model()
    tokenizer = ChatTokenizer(export_dir)
    prompt = max((tokenizer.encode(p) for p in DEFAULT_PROMPTS), key=len)
    assert len(prompt) > SHORT_CONTEXT + PIECE
    reference = hf_greedy(hf, prompt, TOKENS)
    assert len(set(reference)) > 8
    # Hugging Face's generate gives these tokens too (its cache is dropped only for a
    # sequence that reaches the threshold after its prompt)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out[0, len(prompt):].tolist() == reference
    below = tokenizer.encode("Hi there", chat=False)
    chains = _chains(export_dir)
    for runner, chain in chains.items():
        got = list(generate_greedy(chain, prompt, TOKENS, prefill_chunk=PIECE))
        assert got == reference, runner
        # the prompt went in pieces, the first ending below the threshold
        pieces = [p for p in chain.pieces if p[1] > 1]
        assert pieces[0] == (0, PIECE) and len(pieces) == -(-len(prompt) // PIECE), runner
        stats = SpeculativeStats()
        drafter = ScriptedDrafter(prompt, reference)
        assert list(generate_speculative(chain, prompt, TOKENS, drafter=drafter, k=4,
                                         stats=stats, stream_id=1, prefill_chunk=PIECE)
                    ) == reference, runner
        assert stats.rejections > 3 and stats.accepted > 3, runner
    scheduler = StreamScheduler(chains["paged"], row_groups=1)
    sessions = [DecodeSession(10, prompt, TOKENS, prefill_chunk=PIECE),
                DecodeSession(11, below, TOKENS, prefill_chunk=PIECE)]
    for session in sessions:
        scheduler.add(session)
    while scheduler.active:
        scheduler.poll()
    assert [s.error for s in sessions] == [None, None]
    assert scheduler.rows_stepped > scheduler.row_steps  # steps did carry several rows
    assert sessions[0].emitted == reference
    assert sessions[1].emitted == hf_greedy(hf, below, TOKENS)
    for runner, chain in _chains(export_dir, ShortPrompts).items():
        assert list(generate_greedy(chain, prompt, TOKENS, prefill_chunk=PIECE)
                    ) != reference, runner


@pytest.mark.slow
def test_a_cluster_tells_its_stages_which_sequences_are_long(longrope_export) -> None:
    """Over ZeroMQ (stages 1 and 2 in worker threads, on loopback): the RESET of a prompt
    past the threshold carries LONG_ROPE to every stage, the prompt fed in pieces gives
    Hugging Face's tokens, and a later short sequence on the stream turns short again."""
    from dataplane.head.cluster_head import ClusterHead
    from dataplane.runtime.stateful import StageRunner
    from dataplane.worker.stage_worker import StageWorker

    model_dir, export_dir = longrope_export
    hf = open_source(str(model_dir)).load_hf_model()
    tokenizer = ChatTokenizer(export_dir)
    prompt = max((tokenizer.encode(p) for p in DEFAULT_PROMPTS), key=len)
    below = tokenizer.encode("Hi there", chat=False)
    pipe = ClusterHead(StageRunner(export_dir, 0, EXACT_CONFIG), "tcp://127.0.0.1:1",
                       "tcp://127.0.0.1:*", timeout_s=20)
    last = StageWorker(StageRunner(export_dir, 2, EXACT_CONFIG), "tcp://127.0.0.1:*",
                       pipe.reply_endpoint).start()
    middle = StageWorker(StageRunner(export_dir, 1, EXACT_CONFIG), "tcp://127.0.0.1:*",
                         last.endpoint).start()
    try:
        pipe.rewire(middle.endpoint)
        assert pipe.rope_short_context == SHORT_CONTEXT
        got = list(generate_greedy(pipe, prompt, TOKENS, stream_id=3, prefill_chunk=PIECE))
        assert got == hf_greedy(hf, prompt, TOKENS)
        got = list(generate_greedy(pipe, below, TOKENS, stream_id=3, prefill_chunk=PIECE))
        assert got == hf_greedy(hf, below, TOKENS)
        runners = [pipe.stage0, middle.runner, last.runner]
        pipe.open(4)
        for long_rope in (True, False):
            pipe.reset(4, long_rope)
            pipe.step(4, np.array(prompt[:PIECE]), np.arange(PIECE))  # after the RESET
            assert [4 in r.long_sequences for r in runners] == [long_rope] * 3
    finally:
        middle.stop()
        last.stop()
        pipe.close()


@pytest.mark.slow
def test_a_cached_prefix_serves_only_prompts_of_its_set(longrope_export) -> None:
    """On the paged runner's prefix cache: a prompt below the threshold that starts like a
    finished prompt past it does not reuse its (long) keys, and one past it does; a prompt
    below it reuses a short entry, and one past it does not. Tokens exact every time."""
    model_dir, export_dir = longrope_export
    hf = open_source(str(model_dir)).load_hf_model()
    tokenizer = ChatTokenizer(export_dir)
    long_prompt = max((tokenizer.encode(p) for p in DEFAULT_PROMPTS), key=len)
    assert len(long_prompt) > SHORT_CONTEXT + 4
    chain = LocalChain.load(str(export_dir), replace(EXACT_CONFIG, paged_attention=True))
    stats = PrefixIndexStats()
    scheduler = StreamScheduler(chain, prefix_cache_tokens=10_000, prefix_stats=stats)
    extra = long_prompt[-3:]  # tokens of the vocabulary, appended to make prompts differ

    def run(stream_id: int, prompt: list[int], hit: bool) -> None:
        hits = stats.hits
        got = run_to_end(scheduler, DecodeSession(stream_id, prompt, TOKENS // 2))
        assert got == hf_greedy(hf, prompt, TOKENS // 2), (stream_id, len(prompt))
        assert stats.hits == hits + hit, (stream_id, len(prompt))

    run(1, long_prompt, hit=False)  # its KV stays: an entry of the long set
    short_prompt = long_prompt[:SHORT_CONTEXT - 6] + extra
    run(2, short_prompt, hit=False)  # refused: the entry's keys are long; kept, short
    run(3, long_prompt[:SHORT_CONTEXT + 2] + extra, hit=True)  # the long entry
    run(4, short_prompt[:SHORT_CONTEXT - 8] + extra[::-1], hit=True)  # the short entry
    assert stats.tokens_saved >= 2 * 16


@pytest.mark.slow
def test_a_static_export_runs_longrope_and_partial_rope(longrope_export,
                                                       tmp_path: Path) -> None:
    """The static (NPU) path in one stage, its steps cut into pieces of CHUNK tokens: a
    prompt's pieces turn with the set of the whole prompt, not of each piece."""
    model_dir, _ = longrope_export
    source = open_source(str(model_dir))
    export_model(source, [(0, 4)], "fp32", tmp_path / "static",
                 static_kv=StaticKV(context=128, chunk=8))
    chain = LocalChain.load(str(tmp_path / "static"), EXACT_CONFIG)
    tokenizer = ChatTokenizer(tmp_path / "static")
    hf = source.load_hf_model()
    ids = tokenizer.encode(DEFAULT_PROMPTS[1])  # past the threshold from its first piece on
    assert len(ids) > SHORT_CONTEXT
    assert list(generate_greedy(chain, ids, TOKENS)) == hf_greedy(hf, ids, TOKENS)


def test_a_manifest_without_longrope_reads_as_before_and_bad_rope_fields_are_refused(
        tmp_path: Path) -> None:
    """The LongRoPE fields are written only for a LongRoPE model (an older manifest reads
    as one set for every position) and read back as written; a long set of another width, one without its
    context, and frequencies wider than a head are refused by name."""
    spec = model_spec(open_source(str(build_llama(tmp_path, arch="phi3", pad_token_id=None,
                                                  layers=1))))
    stage = StageSpec(index=0, layer_start=0, layer_end=1, xml="s.xml", bin="s.bin", inputs=(),
                      outputs=(), state_names=(), first=True, last=True)
    manifest = ExportManifest(model=spec, stages=(stage,), weight_format="fp32",
                              group_size=None, activation_dtype="f32", beam_idx=True,
                              versions={})
    raw = json.loads(manifest.to_json())
    assert "rope_long_inv_freq" not in raw["model"] and "rope_short_context" not in raw["model"]
    assert manifest_from_dict(raw).model == spec
    longrope = replace(spec, rope_long_inv_freq=spec.rope_inv_freq[::-1], rope_short_context=16)
    raw_long = json.loads(replace(manifest, model=longrope).to_json())
    assert raw_long["model"]["rope_short_context"] == 16
    assert manifest_from_dict(raw_long).model == longrope
    width = len(raw["model"]["rope_inv_freq"])
    bad = [({"rope_long_inv_freq": [1.0] * (width - 1), "rope_short_context": 16},
            f"rope_long_inv_freq has {width - 1} frequencies, rope_inv_freq {width}"),
           ({"rope_long_inv_freq": [1.0] * width}, "go together"),
           ({"rope_short_context": 16}, "go together"),
           ({"rope_inv_freq": [1.0] * (width + 1)}, "RoPE turns 2 x that many")]
    for fields, named in bad:
        with pytest.raises(ManifestError, match=named):
            manifest_from_dict({**raw, "model": {**raw["model"], **fields}})
