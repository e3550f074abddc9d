"""Qwen3-MoE: a tiny random mixture-of-experts model exports exactly, stage by stage; its
expert layers run as the CPU plugin's GatherMatmul (only the routed experts computed);
INT4 stores the experts compressed and INT8 stays close to f32; a config contradicting its
weights, or a mixture-of-experts family the exporter lacks, is refused before a stage is
written."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import openvino as ov
import pytest
import torch

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.ov_core import shared_core
from dataplane.runtime.paged import paged_model
from exporter.export import ExportError, export_model
from exporter.quality import chain_logits, compare_logits, eval_passages, hf_logits
from exporter.sources import SourceError, open_source
from exporter.verify import DEFAULT_PROMPTS, EXACT_CONFIG, hf_greedy, verify_export
from tests.exporter.exactness import assert_speculation_matches, run_to_end, runner_chains
from tests.helpers.tiny_models import build_llama
from zctl.engine.scheduler import StreamScheduler, run_sessions
from zctl.engine.sessions import DecodeSession
from zctl.engine.tokenizer import ChatTokenizer
from zctl.manifest import StaticKV

TOKENS = 32
EXPERTS, ACTIVE, EXPERT_WIDTH = 8, 2, 32
# layer 2 a dense MLP (mlp_only_layers): the middle stage holds a sparse and a dense layer
MOE = dict(arch="qwen3_moe", head_dim=24, moe_intermediate_size=EXPERT_WIDTH,
           num_experts=EXPERTS, num_experts_per_tok=ACTIVE, norm_topk_prob=True,
           mlp_only_layers=[2])
SPARSE = (0, 1, 3)
SPLIT = [(0, 1), (1, 3), (3, 4)]


def _build(out_dir: Path, **changes: object) -> Path:
    return build_llama(out_dir, tied=False, norm_spread=0.3, **{**MOE, **changes})


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory.mktemp("moe") / "model")


@pytest.fixture(scope="module")
def moe_export(moe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("moe_export") / "fp32"
    export_model(open_source(str(moe_model)), SPLIT, "fp32", out)
    return out


@pytest.fixture(scope="module")
def hf(moe_model: Path):
    return open_source(str(moe_model)).load_hf_model()


def test_the_shape_names_the_sparse_layers(moe_model: Path) -> None:
    shape = open_source(str(moe_model)).decoder_shape()
    assert (shape.experts, shape.active_experts, shape.expert_intermediate) == (
        EXPERTS, ACTIVE, EXPERT_WIDTH)
    assert shape.sparse_layers == SPARSE and shape.norm_topk_prob and shape.qk_norm


@pytest.mark.slow
def test_the_manifest_states_the_experts_for_the_planner(moe_export: Path) -> None:
    """The planner reads an exported mixture of experts as one: its experts, the number a
    token runs and their width, from the manifest (a dense model's states none)."""
    from controlplane.planner.export_shape import export_shape
    from zctl.manifest import load_manifest

    manifest = load_manifest(moe_export)
    raw = json.loads((moe_export / "manifest.json").read_text())["model"]
    assert (raw["experts"], raw["active_experts"], raw["expert_intermediate"]) == (
        EXPERTS, ACTIVE, EXPERT_WIDTH)
    shape = export_shape(manifest, moe_export)
    assert shape.moe and (shape.experts, shape.active_experts, shape.expert_intermediate) == (
        EXPERTS, ACTIVE, EXPERT_WIDTH)


def _runtime_ops(compiled: ov.CompiledModel) -> Counter:
    return Counter(op.get_rt_info()["layerType"].astype(str)
                   for op in compiled.get_runtime_model().get_ops())


@pytest.mark.slow
def test_expert_layers_run_as_gather_matmuls_stateful_and_paged(moe_export: Path) -> None:
    """The CPU plugin turns each sparse layer's tiled experts into three GatherMatmuls
    (gate, up, down) fed by the router's top-k: a dense layer has none."""
    core = shared_core()
    f32 = {"INFERENCE_PRECISION_HINT": "f32"}
    for index, (start, end) in enumerate(SPLIT):
        want = 3 * sum(start <= layer < end for layer in SPARSE)
        xml = str(moe_export / f"stage{index}.xml")
        stateful = core.compile_model(core.read_model(xml), "CPU", f32)
        paged = core.compile_model(paged_model(core.read_model(xml), index == 0,
                                               index == len(SPLIT) - 1, 64), "CPU", f32)
        assert _runtime_ops(stateful)["GatherMatmul"] == want, index
        assert _runtime_ops(paged)["GatherMatmul"] == want, index


@pytest.mark.slow
def test_three_uneven_stages_match_hf_greedy(moe_export: Path, hf) -> None:
    """Greedy tokens of the f32 chain equal Hugging Face's over 32 tokens for 5 prompts;
    on paged stages, the 5 prompts decoding as rows of one row group (routed to different
    experts in the same steps) and a prompt whose start is a prefix-cache hit do too."""
    results = verify_export(moe_export, DEFAULT_PROMPTS, max_new_tokens=TOKENS, hf_model=hf)
    assert [r.matched for r in results] == [TOKENS] * len(DEFAULT_PROMPTS)
    assert len(set(results[0].chain)) > 8  # not degenerate: a constant stream hides bugs

    tokenizer = ChatTokenizer(moe_export)
    prompts = [tokenizer.encode(p) for p in DEFAULT_PROMPTS]
    with torch.no_grad():  # the rows' last tokens pick different experts in layer 0
        routed = {tuple(sorted(hf(torch.tensor([p]), output_router_logits=True)
                               .router_logits[0][-1].topk(ACTIVE).indices.tolist()))
                  for p in prompts}
    assert len(routed) > 1
    paged = LocalChain.load(str(moe_export), replace(EXACT_CONFIG, paged_attention=True))
    # decode steps too on the dynamic graph, whose GatherMatmuls compute the routed experts
    # only (a one-token graph would compute every expert: dataplane.runtime.one_token)
    assert all(runner.one_token is None for runner in paged.runners)
    sessions = [DecodeSession(i, p, TOKENS) for i, p in enumerate(prompts)]
    list(run_sessions(paged, sessions, row_groups=1))
    assert [s.emitted for s in sessions] == [r.reference for r in results]

    scheduler = StreamScheduler(paged, prefix_cache_tokens=4096)
    first = DecodeSession(10, prompts[0], TOKENS)
    session = DecodeSession(11, prompts[0] + results[0].reference
                            + tokenizer.encode(" and then", chat=False), TOKENS)
    for each in (first, session):
        scheduler.add(each)
        while scheduler.active:
            scheduler.poll()
        assert each.error is None
    assert session.cached_tokens >= len(prompts[0])  # its start came from the cache
    longer = prompts[0] + results[0].reference + tokenizer.encode(" and then", chat=False)
    assert session.emitted == hf_greedy(hf, longer, TOKENS)


def test_a_static_export_of_a_mixture_of_experts_is_refused(moe_model: Path,
                                                            tmp_path: Path) -> None:
    """The NPU path's stages have every shape fixed, and so compiled the CPU plugin computes
    every expert of every step (no GatherMatmul: checked when this refusal was written): a
    static export of a mixture of experts is refused before any stage is written."""
    with pytest.raises(ExportError, match="static export of a model with a mixture of experts"):
        export_model(open_source(str(moe_model)), SPLIT, "fp32", tmp_path / "static",
                     static_kv=StaticKV(context=160, chunk=8))
    assert not (tmp_path / "static").exists()


@pytest.mark.slow
def test_speculation_rewinds_and_a_stateful_prefix_hit_match_hf(moe_export: Path, hf) -> None:
    """On the stateful runner (rewinding by mask and by trimming) and the paged one, a
    speculative decoding with drafts rejected at every position (the stages rewind their
    KV, the experts' layers among them) gives Hugging Face's greedy tokens; and on the
    stateful runner too, a prompt whose start is a prefix-cache hit."""
    tokenizer = ChatTokenizer(moe_export)
    short = tokenizer.encode("Hi there", chat=False)
    chains = runner_chains(moe_export)
    assert_speculation_matches(chains, short, hf_greedy(hf, short, TOKENS))
    prompt = tokenizer.encode(DEFAULT_PROMPTS[0])
    scheduler = StreamScheduler(chains["mask"], prefix_cache_tokens=4096)
    first = run_to_end(scheduler, DecodeSession(2, prompt, TOKENS))
    longer = prompt + first + tokenizer.encode(" and then", chat=False)
    session = DecodeSession(3, longer, TOKENS)
    assert run_to_end(scheduler, session) == hf_greedy(hf, longer, TOKENS)
    assert session.cached_tokens >= len(prompt)  # its start came from the cache


def _expert_constants(xml: Path) -> Counter:
    """Bytes of the stage's stacked experts' constants (their weights, scales and zero
    points: [experts, ...] of rank 3 or more) by element type."""
    model = shared_core().read_model(str(xml))
    sizes: Counter = Counter()
    for op in model.get_ops():
        shape = op.get_output_shape(0) if op.get_type_name() == "Constant" else []
        if len(shape) >= 3 and shape[0] == EXPERTS:
            sizes[op.get_output_element_type(0).get_type_name()] += op.get_byte_size()
    return sizes


@pytest.mark.slow
def test_int4_stores_the_experts_compressed_and_int8_stays_close(
        moe_model: Path, moe_export: Path, hf, tmp_path: Path) -> None:
    """NNCF compresses the stacked experts as it does any MatMul weight: an INT4 stage
    holds them as u4 with per-group scales (a quarter of f32's bytes and less), and still
    runs them as GatherMatmuls (the routers in INT8); INT8 picks f32's top-1 at most positions of the text."""
    source = open_source(str(moe_model))
    export_model(source, [(0, 4)], "int4", tmp_path / "int4")
    export_model(source, [(0, 4)], "int8", tmp_path / "int8")
    f32 = sum(sum(_expert_constants(moe_export / f"stage{i}.xml").values())
              for i in range(len(SPLIT)))
    int4 = _expert_constants(tmp_path / "int4" / "stage0.xml")
    stacked = len(SPARSE) * EXPERTS * 3 * 64 * EXPERT_WIDTH  # expert weights
    assert f32 == 4 * stacked
    assert int4["u4"] >= stacked // 2 and "f32" not in int4  # every expert weight is u4
    assert sum(int4.values()) < f32 / 4
    routers = {op.get_output_element_type(0).get_type_name()
               for op in shared_core().read_model(str(tmp_path / "int4" / "stage0.xml")).get_ops()
               if op.get_type_name() == "Constant" and op.get_friendly_name().endswith(
                   "router.weight")}
    assert routers == {"u8"}  # the routers are kept out of INT4, in INT8
    compiled = shared_core().compile_model(str(tmp_path / "int4" / "stage0.xml"), "CPU")
    assert _runtime_ops(compiled)["GatherMatmul"] == 3 * len(SPARSE)

    # INT8 stores them in i8 groups ([experts, out, in / group, group]), still GatherMatmuls
    int8_experts = _expert_constants(tmp_path / "int8" / "stage0.xml")
    assert int8_experts["i8"] >= stacked and not {"f32", "u8"} & set(int8_experts)  # routers too
    compiled = shared_core().compile_model(str(tmp_path / "int8" / "stage0.xml"), "CPU")
    assert _runtime_ops(compiled)["GatherMatmul"] == 3 * len(SPARSE)

    passage = eval_passages(moe_export, limit=64)[0]
    reference = hf_logits(hf, passage.token_ids)
    int8 = LocalChain.load(str(tmp_path / "int8"), EXACT_CONFIG)
    figures = compare_logits(reference, chain_logits(int8, passage.token_ids), passage.token_ids)
    assert figures.top1_agreement >= 0.8


def test_a_config_contradicting_its_experts_is_refused(tmp_path: Path) -> None:
    """8 experts stored, 6 in the config; or a layer the config makes dense storing
    experts: refused, naming the layer and both counts, before anything is written."""
    model_dir = _build(tmp_path / "model", layers=2, mlp_only_layers=[])
    config = json.loads((model_dir / "config.json").read_text())
    config["num_experts"] = config.pop("num_local_experts")  # as Qwen's own configs name it
    for changes, named in (({"num_experts": 6}, "layer 0 stores 8 experts .* a mixture of 6"),
                           ({"mlp_only_layers": [1]}, "layer 1 stores 8 experts .* a dense MLP")):
        (model_dir / "config.json").write_text(json.dumps({**config, **changes}))
        with pytest.raises(SourceError, match=named):
            export_model(open_source(str(model_dir)), [(0, 2)], "fp32", tmp_path / "out")
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("fields", "named"), [
    ({"num_experts": 4, "num_experts_per_tok": 6}, "num_experts_per_tok 6"),
    ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
     "use_sliding_window is true"),
])
def test_a_routing_the_export_lacks_is_refused_by_name(tmp_path: Path, fields: dict,
                                                     named: str) -> None:
    from transformers import AutoConfig

    AutoConfig.for_model("qwen3_moe", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=384, **fields
                         ).save_pretrained(tmp_path / "model")
    with pytest.raises(SourceError, match=f"qwen3_moe with {named}.*not supported"):
        open_source(str(tmp_path / "model"))


def test_an_unsupported_mixture_of_experts_is_refused_listing_the_supported(
        tmp_path: Path) -> None:
    from transformers import AutoConfig

    AutoConfig.for_model("qwen2_moe", num_hidden_layers=2, hidden_size=64,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=384,
                         architectures=["Qwen2MoeForCausalLM"]).save_pretrained(tmp_path / "model")
    with pytest.raises(SourceError, match=r"'qwen2_moe' \(Qwen2MoeForCausalLM\) is not "
                       r"supported; supported: .*Qwen3MoeForCausalLM.*GptOssForCausalLM"):
        export_model(open_source(str(tmp_path / "model")), [(0, 2)], "fp32", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_experts_stored_stacked_read_as_experts_stored_one_by_one(moe_model: Path,
                                                                  tmp_path: Path) -> None:
    """The stage module reads a layer's experts stacked [experts, out, in] whichever way the
    checkpoint stores them: one by one (as save_pretrained writes them) or stacked (as
    Hugging Face's model holds them in memory, and a GGUF file loads)."""
    import shutil

    from safetensors.torch import save_file

    one_by_one = open_source(str(moe_model))
    state = one_by_one.load_hf_model().state_dict()
    stacked_dir = tmp_path / "stacked"
    shutil.copytree(moe_model, stacked_dir)
    save_file({k: v.contiguous() for k, v in state.items()}, stacked_dir / "model.safetensors")
    stacked = open_source(str(stacked_dir))
    assert not any(".experts.0." in name for name in stacked.tensor_names())
    for name in ("model.layers.3.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.down_proj"):
        assert torch.equal(one_by_one.require(name), state[name]), name
        assert torch.equal(stacked.require(name), state[name]), name
    config = json.loads((stacked_dir / "config.json").read_text())
    (stacked_dir / "config.json").write_text(json.dumps({**config, "num_local_experts": 6}))
    with pytest.raises(SourceError, match="layer 0 stores 8 experts, and its config makes it a "
                       "mixture of 6"):  # counted from the stacked tensor's first dimension
        open_source(str(stacked_dir))
