"""gpt-oss: a tiny random model (attention sinks, alternating sliding and full layers,
biases on the attention, a yarn RoPE, a biased router and clamped-SwiGLU experts with
biases) exports exactly, stage by stage, on the stateful runner and the paged one; its
experts run as the CPU plugin's GatherMatmuls; options the export lacks are refused by
name before a stage is written."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
import torch

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.kv.blocks import blocks_for
from dataplane.runtime.ov_core import shared_core
from dataplane.runtime.paged import paged_model
from dataplane.runtime.rope import rope_tables
from exporter.export import ExportError, export_model, model_spec
from exporter.gpt_oss_moe_block import ClampedSwiGLU
from exporter.sources import SourceError, open_source
from exporter.verify import DEFAULT_PROMPTS, hf_greedy, verify_export
from tests.exporter.exactness import (  # noqa: F401 - one_torch_thread: its fixture
    STATEFUL_WINDOW,
    NarrowMargin,
    assert_speculation_matches,
    one_torch_thread,
    run_to_end,
    runner_chains,
    state_slots,
    window_blocks,
)
from tests.helpers.tiny_models import build_llama
from zctl.engine.scheduler import (
    StreamScheduler,
    generate_greedy,
    greedy_kept_open,
    run_sessions,
)
from zctl.engine.sessions import DecodeSession
from zctl.engine.tokenizer import ChatTokenizer
from zctl.manifest import StaticKV

TOKENS = 32
WINDOW = 8  # every prompt is longer
EXPERTS, ACTIVE, EXPERT_WIDTH, LIMIT = 8, 2, 32, 1.5
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}
# 5 layers: sliding, full, sliding, full, sliding (gpt-oss's own alternation)
GPT_OSS = dict(arch="gpt_oss", layers=5, head_dim=16, intermediate=EXPERT_WIDTH,
               num_local_experts=EXPERTS, num_experts_per_tok=ACTIVE, sliding_window=WINDOW,
               swiglu_limit=LIMIT, rope_parameters=YARN, pad_token_id=None)
SLIDING = (0, 2, 4)
SPLIT = [(0, 1), (1, 3), (3, 5)]


def _build(out_dir: Path, **changes: object) -> Path:
    """Norms not all ones, and every bias and sink drawn well away from zero (one left out
    changes the tokens)."""
    return build_llama(out_dir, tied=False, norm_spread=0.3, bias_spread=0.5,
                       **{**GPT_OSS, **changes})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory.mktemp("gpt_oss") / "model")


@pytest.fixture(scope="module")
def export_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpt_oss_export") / "fp32"
    export_model(open_source(str(model_dir)), SPLIT, "fp32", out)
    return out


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    return open_source(str(model_dir)).load_hf_model()


def test_the_shape_names_sinks_windows_and_experts(model_dir: Path) -> None:
    shape = open_source(str(model_dir)).decoder_shape()
    assert shape.attention_sinks and shape.attention_bias and not shape.local_rope
    assert (shape.sliding_window, shape.sliding_layers) == (WINDOW, SLIDING)
    assert (shape.experts, shape.active_experts, shape.expert_intermediate) == (
        EXPERTS, ACTIVE, EXPERT_WIDTH)
    assert shape.sparse_layers == tuple(range(5))
    assert shape.clamped_swiglu == ClampedSwiGLU(alpha=1.702, limit=LIMIT)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_rope_tables_are_hfs(model_dir: Path, tmp_path: Path, truncate: bool) -> None:
    """The frequencies and attention scaling the manifest records give Hugging Face's
    gpt-oss cos and sin (yarn, its truncate either way) to the rounding of numpy's cos and
    sin against torch's."""
    import shutil

    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    shutil.copytree(model_dir, tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    config["rope_parameters"] = {**YARN, "truncate": truncate}
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    source = open_source(str(tmp_path / "model"))
    assert source.config.rope_parameters["truncate"] is truncate
    spec = model_spec(source)
    assert spec.rope_attention_scaling > 1.0  # yarn's attention factor, in cos and sin
    positions = np.arange(0, 300, dtype=np.int64)
    cos, sin = rope_tables(positions[None], np.array(spec.rope_inv_freq, np.float32),
                           spec.rope_attention_scaling)
    rotary = GptOssRotaryEmbedding(source.config)
    want_cos, want_sin = rotary(torch.zeros(1), torch.from_numpy(positions)[None])
    half = cos.shape[-1] // 2  # HF's gpt-oss table is one half; the host's is cat(f, f)
    np.testing.assert_allclose(cos[..., :half], want_cos.numpy(), atol=2e-6)
    np.testing.assert_allclose(sin[..., half:], want_sin.numpy(), atol=2e-6)


def _runtime_ops(compiled: ov.CompiledModel) -> Counter:
    return Counter(op.get_rt_info()["layerType"].astype(str)
                   for op in compiled.get_runtime_model().get_ops())


@pytest.mark.slow
def test_experts_run_as_gather_matmuls_and_sinks_reach_paged_attention(
        export_dir: Path) -> None:
    """Each layer's tiled experts become two GatherMatmuls (gate-and-up, down, each with
    its bias) on the stateful graph and the paged one; the attention stays one fused
    SDPA, and PagedAttention takes each layer's sinks."""
    core = shared_core()
    f32 = {"INFERENCE_PRECISION_HINT": "f32"}
    for index, (start, end) in enumerate(SPLIT):
        xml = str(export_dir / f"stage{index}.xml")
        windows = [WINDOW if layer in SLIDING else 0 for layer in range(start, end)]
        model = paged_model(core.read_model(xml), index == 0, index == len(SPLIT) - 1, 64,
                            windows)
        sinks = [op.input_value(20).get_partial_shape()
                 for op in model.get_ordered_ops()
                 if op.get_type_name() == "PagedAttentionExtension"]
        assert sinks == [ov.PartialShape([1, 4, 1, 1])] * (end - start)
        stateful = _runtime_ops(core.compile_model(core.read_model(xml), "CPU", f32))
        paged = _runtime_ops(core.compile_model(model, "CPU", f32))
        assert stateful["GatherMatmul"] == paged["GatherMatmul"] == 2 * (end - start), index
        assert stateful["ScaledDotProductAttention"] == end - start, index
        assert paged["PagedAttention"] == end - start, index


@pytest.mark.slow
def test_sliding_layers_keep_only_their_window_on_stateful_stages(export_dir: Path, hf) -> None:
    """On stateful stages the sliding layers' states (attention sinks and all) keep their
    window, a margin of 8 and a slack of 4 only, while the full layers' grow: greedy
    tokens stay Hugging Face's over 12 windows."""
    prompt = ChatTokenizer(export_dir).encode(DEFAULT_PROMPTS[0])
    reference = hf_greedy(hf, prompt, 12 * WINDOW)
    chain = LocalChain.load(str(export_dir), STATEFUL_WINDOW, rewind="mask")
    seen: dict[str, list[int]] = {}
    got = []
    for token in generate_greedy(chain, prompt, 12 * WINDOW, stream_id=1):
        got.append(token)
        state_slots(chain, 1, seen)
    assert got == reference
    assert max(seen["sliding"]) <= WINDOW - 1 + 8 + 4 + 1  # and a step's token
    assert max(seen["global"]) >= len(prompt) + 12 * WINDOW - 3


@pytest.mark.slow
def test_sliding_layers_keep_only_their_window_on_paged_stages(export_dir: Path, hf) -> None:
    """On paged stages the sliding layers (attention sinks and all) keep the blocks of
    their window and margin only, while the full layers' tables grow: greedy tokens stay
    Hugging Face's over 12 windows, and so do a healed stream's, its tokens replayed in
    chunks."""
    prompt = ChatTokenizer(export_dir).encode(DEFAULT_PROMPTS[0])
    reference = hf_greedy(hf, prompt, 12 * WINDOW)
    chain = LocalChain.load(str(export_dir), NarrowMargin(
        precision="f32", kv_cache_precision="f32", dynamic_quantization=False,
        paged_attention=True))
    window = chain.runners[0].window
    assert window is not None and (window.window, window.margin) == (WINDOW, 8)
    kept = blocks_for(WINDOW - 1 + 8, window.block_size) + 1  # the most a window spans
    seen: dict[int, list[tuple[int, int]]] = {}
    got = greedy_kept_open(chain, prompt, 12 * WINDOW, 1, lambda: window_blocks(chain, 1, seen))
    assert got == reference
    for counts in seen.values():
        assert max(w for w, _ in counts) <= kept
        assert counts[-1][1] >= 2 * kept  # the full layers' table outgrew the window's
    # a healed stream replays its tokens past the window onto fresh KV, in chunks, and goes
    # on exactly
    got = list(generate_greedy(chain, prompt + reference[:48], 16, stream_id=4,
                               prefill_chunk=7))
    assert got == reference[48:64]


@pytest.mark.slow
def test_three_uneven_stages_match_hf_greedy(export_dir: Path, hf) -> None:
    """Greedy tokens of the f32 chain equal Hugging Face's over 32 tokens for 5 prompts
    longer than the window; a speculative decoding with drafts rejected from a prompt
    shorter than the window to past it does too on the stateful runner (rewinding by mask
    and by trimming) and the paged one; on paged stages the 5 prompts as rows of one row
    group (routed to different experts in the same steps), and on both a prompt whose
    start is a prefix-cache hit."""
    hooked = []
    layer = hf.model.layers[1].mlp.experts
    handle = layer.register_forward_pre_hook(lambda _, args: hooked.append(args[0]))
    results = verify_export(export_dir, DEFAULT_PROMPTS, max_new_tokens=TOKENS, hf_model=hf)
    handle.remove()
    assert [r.matched for r in results] == [TOKENS] * len(DEFAULT_PROMPTS)
    assert len(set(results[0].chain)) > 8  # not degenerate: a constant stream hides bugs
    with torch.no_grad():  # the clamp bites: some gate and up values lie beyond the limit
        gate_up = torch.einsum("rh,ehi->eri", torch.cat(hooked), layer.gate_up_proj)
        gate_up = gate_up + layer.gate_up_proj_bias[:, None]
    assert (gate_up[..., ::2] > LIMIT).float().mean() > 0.05
    assert (gate_up[..., 1::2].abs() > LIMIT).float().mean() > 0.05

    tokenizer = ChatTokenizer(export_dir)
    prompts = [tokenizer.encode(p) for p in DEFAULT_PROMPTS]
    assert min(map(len, prompts)) > WINDOW
    short = tokenizer.encode("Hi there", chat=False)
    assert len(short) < WINDOW
    reference = hf_greedy(hf, short, TOKENS)
    chains = runner_chains(export_dir)
    assert_speculation_matches(chains, short, reference)

    with torch.no_grad():  # the rows' first decode step routes them to different experts
        routed = {tuple(sorted(hf(torch.tensor([p + r.reference[:1]]), output_router_logits=True)
                               .router_logits[0][-1].topk(ACTIVE).indices.tolist()))
                  for p, r in zip(prompts, results, strict=True)}
    assert len(routed) > 1
    sessions = [DecodeSession(i, p, TOKENS) for i, p in enumerate(prompts)]
    list(run_sessions(chains["paged"], sessions, row_groups=1))
    assert [s.emitted for s in sessions] == [r.reference for r in results]

    longer = prompts[0] + results[0].reference + tokenizer.encode(" and then", chat=False)
    expected = hf_greedy(hf, longer, TOKENS)
    for runner in ("mask", "paged"):
        scheduler = StreamScheduler(chains[runner], prefix_cache_tokens=4096)
        run_to_end(scheduler, DecodeSession(20, prompts[0], TOKENS))
        session = DecodeSession(21, longer, TOKENS)
        assert run_to_end(scheduler, session) == expected, runner
        assert session.cached_tokens >= len(prompts[0]), runner  # its start: a cache hit


@pytest.mark.slow
def test_the_manifest_states_the_experts_for_the_planner(export_dir: Path) -> None:
    """The planner reads the export as a mixture of experts: all of a layer's experts held,
    the active ones computed."""
    from controlplane.planner.export_shape import export_shape
    from zctl.manifest import load_manifest

    shape = export_shape(load_manifest(export_dir), export_dir)
    assert shape.moe and (shape.experts, shape.active_experts, shape.expert_intermediate) == (
        EXPERTS, ACTIVE, EXPERT_WIDTH)
    assert shape.architecture == "gpt_oss"


def _config_only(tmp_path: Path, **fields: object) -> Path:
    """A model directory holding only a gpt-oss config.json (every refusal comes before a
    weight is read)."""
    from transformers import AutoConfig

    AutoConfig.for_model("gpt_oss", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=32, vocab_size=384,
                         **{"num_local_experts": 4, "num_experts_per_tok": 2,
                            "architectures": ["GptOssForCausalLM"], **fields}
                         ).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize(("fields", "named"), [
    ({"num_experts_per_tok": 6}, "num_experts_per_tok 6"),
    ({"swiglu_limit": 0.0}, "swiglu_limit 0.0"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]},
     "layer type 'chunked_attention'"),
    ({"sliding_window": None}, "sliding layers with sliding_window None"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
     "rope_type 'dynamic'"),
])
def test_an_option_the_export_lacks_is_refused_by_name(tmp_path: Path, fields: dict,
                                                      named: str) -> None:
    model = _config_only(tmp_path / "model", **fields)
    with pytest.raises(SourceError, match=f"gpt_oss with {named}.*not supported"):
        export_model(open_source(str(model)), [(0, 2)], "fp32", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_static_export_of_attention_sinks_is_refused(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="static export of a model with attention sinks"):
        export_model(open_source(str(model_dir)), [(0, 5)], "fp32", tmp_path / "out",
                     static_kv=StaticKV(context=64, chunk=8))
    assert not (tmp_path / "out").exists()


def test_experts_of_another_count_than_the_config_are_refused(model_dir: Path,
                                                              tmp_path: Path) -> None:
    import shutil

    shutil.copytree(model_dir, tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config,
                                                               "num_local_experts": 6}))
    with pytest.raises(SourceError, match="layer 0 stores 8 experts, and its config makes it "
                       "a mixture of 6"):
        open_source(str(tmp_path / "model"))


@pytest.mark.parametrize("dropped", ["self_attn.sinks", "mlp.router.bias",
                                     "mlp.experts.down_proj_bias"])
def test_a_checkpoint_lacking_a_gpt_oss_tensor_is_refused(model_dir: Path, tmp_path: Path,
                                                          dropped: str) -> None:
    """A layer without its sinks or a bias is refused, naming the layer and the tensor,
    before a stage is written (never exported as if the sinks or the bias were zero)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, tmp_path / "model")
    weights = load_file(tmp_path / "model" / "model.safetensors")
    del weights[f"model.layers.3.{dropped}"]
    save_file(weights, tmp_path / "model" / "model.safetensors")
    with pytest.raises(SourceError, match=f"layer 3 stores no {dropped} "):
        export_model(open_source(str(tmp_path / "model")), SPLIT, "fp32", tmp_path / "out")
    assert not (tmp_path / "out").exists()
