"""Stage export on a tiny random Llama: exact against HF, consistent across splits, safe on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.ov_core import shared_core
from dataplane.runtime.stateful import StageRunner
from exporter import export as export_mod
from exporter.export import ExportError, export_model
from exporter.sources import SourceError, open_source
from exporter.verify import DEFAULT_PROMPTS, verify_export
from zctl.engine.requests import FROM_GENERATION_CONFIG, Sampling
from zctl.engine.sampling_defaults import LLAMA_SERVER_SAMPLING, model_sampling
from zctl.engine.scheduler import generate_greedy
from zctl.engine.tokenizer import ChatTokenizer
from zctl.manifest import GenerationConfig, load_manifest

SPLITS = {
    1: [(0, 4)],
    2: [(0, 2), (2, 4)],
    3: [(0, 1), (1, 3), (3, 4)],  # uneven
}


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path):
    return open_source(str(tiny_llama_dir)).load_hf_model()


@pytest.mark.slow
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_fp32_chain_matches_hf_greedy(tiny_exports, hf_model, stages: int) -> None:
    export_dir = tiny_exports.get(SPLITS[stages])
    results = verify_export(export_dir, DEFAULT_PROMPTS[:4], max_new_tokens=64, hf_model=hf_model)
    assert len(results) == 4
    for result in results:
        assert len(result.reference) == 64
        assert result.exact, f"{result.prompt!r}: first {result.matched} tokens agree"
    # the tokens are not degenerate (a constant stream would hide RoPE/mask bugs)
    assert len(set(results[0].chain)) > 8


@pytest.mark.slow
def test_static_export_matches_hf_greedy(tiny_exports, hf_model) -> None:
    """The NPU path's static, stateless shards (KV on the host), run here on CPU."""
    export_dir = tiny_exports.get(SPLITS[2], static=(160, 8))
    results = verify_export(export_dir, DEFAULT_PROMPTS[:4], max_new_tokens=64, hf_model=hf_model)
    assert [r.exact for r in results] == [True] * 4, [r.matched for r in results]


@pytest.mark.slow
def test_int4_static_chain_equals_int4_stateful(tiny_exports) -> None:
    prompts = list(DEFAULT_PROMPTS[:4])
    assert (_greedy(tiny_exports.get(SPLITS[2], "int4", static=(160, 8)), prompts)
            == _greedy(tiny_exports.get(SPLITS[2], "int4"), prompts))


def _greedy(export_dir: Path, prompts: list[str], n: int = 48) -> list[list[int]]:
    tokenizer = ChatTokenizer(export_dir)
    chain = LocalChain.load(str(export_dir), RuntimeSpec(precision="f32", kv_cache_precision="f32"))
    return [list(generate_greedy(chain, tokenizer.encode(p), n)) for p in prompts]


@pytest.mark.slow
def test_int4_chains_equal_int4_single_stage(tiny_exports) -> None:
    prompts = list(DEFAULT_PROMPTS[:4])
    single = _greedy(tiny_exports.get(SPLITS[1], "int4"), prompts)
    for stages in (2, 3):
        assert _greedy(tiny_exports.get(SPLITS[stages], "int4"), prompts) == single


@pytest.mark.slow
def test_int4_weights_are_compressed_per_layer_and_head_int8(tiny_exports) -> None:
    export_dir = tiny_exports.get(SPLITS[2], "int4")
    manifest = load_manifest(export_dir)
    assert manifest.weight_format == "int4" and manifest.group_size == 64
    for stage in manifest.stages:
        model = shared_core().read_model(export_dir / stage.xml)
        kinds = {}
        for op in model.get_ops():
            name = op.get_friendly_name()
            if op.get_type_name() == "Constant" and name.endswith(".weight"):
                kinds[name] = op.get_output_element_type(0).get_type_name()
        layer_kinds = {v for k, v in kinds.items() if "layers." in k}
        assert layer_kinds == {"u4"}, "every decoder MatMul, the stage's last one included"
        head = {v for k, v in kinds.items() if "embed" in k or "lm_head" in k}
        assert head <= {"u8"}
        assert model.get_rt_info(["zctl", "openvino_version"]).astype(str) == ov.get_version()


def _matmuls(export_dir: Path) -> int:
    model = shared_core().read_model(export_dir / "stage0.xml")
    return sum(op.get_type_name() == "MatMul" for op in model.get_ops())


def _logits(export_dir: Path, token_ids: list[int]) -> list[np.ndarray]:
    """The last token's logits after a prefill of ``token_ids`` and each of 8 decode steps
    (greedy), on the plugin's default (fast) numerics."""
    runner = StageRunner(export_dir, 0, RuntimeSpec())
    runner.open_stream(0)
    out = [runner.step(0, np.array([token_ids]), np.arange(len(token_ids))).copy()]
    for position in range(len(token_ids), len(token_ids) + 8):
        token = int(out[-1][0, -1].argmax())
        out.append(runner.step(0, np.array([[token]]), np.array([position])).copy())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_fused_projections_are_four_matmuls_a_layer_with_the_separate_ones_logits(
        tiny_exports, tiny_llama_dir: Path, tmp_path: Path, weights: str) -> None:
    """Q/K/V and gate/up are one MatMul each (4 a layer, not 7), and, each output row
    compressed on its own either way, the logits are bit for bit those of the separate
    projections."""
    fused = tiny_exports.get(SPLITS[1], weights)
    separate = tmp_path / "separate"
    export_model(open_source(str(tiny_llama_dir)), SPLITS[1], weights, separate,
                 fuse_projections=False)
    assert (_matmuls(fused), _matmuls(separate)) == (4 * 4 + 1, 7 * 4 + 1)
    ids = [0, 17, 42, 101, 7, 250, 33]
    for a, b in zip(_logits(fused, ids), _logits(separate, ids), strict=True):
        assert np.array_equal(a, b)


@pytest.mark.slow
def test_an_export_with_separate_projections_runs_on_every_runner(
        tiny_exports, tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Exports made before the fused projections (7 MatMuls a layer) load and decode on the
    stateful and the paged runners, cut in stages, with the fused export's tokens."""
    separate = tmp_path / "separate"
    export_model(open_source(str(tiny_llama_dir)), SPLITS[2], "int4", separate,
                 fuse_projections=False)
    fused = tiny_exports.get(SPLITS[2], "int4")
    ids = [0, 17, 42, 101, 7, 250, 33]
    for paged in (False, True):
        config = RuntimeSpec(paged_attention=paged)
        want = list(generate_greedy(LocalChain.load(str(fused), config), ids, 12))
        assert list(generate_greedy(LocalChain.load(str(separate), config), ids, 12)) == want


@pytest.mark.slow
def test_beam_idx_is_injected_or_left_out(tiny_exports) -> None:
    with_beam = load_manifest(tiny_exports.get(SPLITS[2]))
    assert with_beam.beam_idx and "beam_idx" in with_beam.stages[0].inputs
    without_dir = tiny_exports.get(SPLITS[2], beam_idx=False)
    without = load_manifest(without_dir)
    assert not without.beam_idx
    model = shared_core().read_model(without_dir / without.stages[1].xml)
    assert "beam_idx" not in {p.get_any_name() for p in model.inputs}
    assert any(op.get_type_name() == "ReadValue" for op in model.get_ops())
    # the ablation still decodes the same tokens
    assert _greedy(without_dir, ["hello"], 16) == _greedy(tiny_exports.get(SPLITS[2]), ["hello"], 16)


def test_stateful_graph_has_gather_between_readvalue_and_concat(tiny_exports) -> None:
    export_dir = tiny_exports.get(SPLITS[1])
    model = shared_core().read_model(export_dir / "stage0.xml")
    read_values = [op for op in model.get_ops() if op.get_type_name() == "ReadValue"]
    assert len(read_values) == 2 * 4
    for op in read_values:
        consumers = [t.get_node().get_type_name() for t in op.output(0).get_target_inputs()]
        assert consumers == ["Gather"], "a single consumer, so no ShapeOf hangs off the past KV"


def test_bad_layer_split_is_refused_and_writes_nothing(tiny_llama_dir: Path, tmp_path: Path) -> None:
    source = open_source(str(tiny_llama_dir))
    with pytest.raises(ExportError, match="model has 4 layers"):
        export_model(source, [(0, 2), (2, 3)], "fp32", tmp_path / "out")
    with pytest.raises(ExportError, match="unknown weight format"):
        export_model(source, [(0, 4)], "int3", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_failure_mid_export_leaves_nothing_behind(tiny_llama_dir: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    source = open_source(str(tiny_llama_dir))

    def explode(*args: object) -> None:
        raise RuntimeError("disk full")

    calls = {"n": 0}
    real = export_mod.compress_stage

    def second_stage_fails(*args: object):
        calls["n"] += 1
        return (explode if calls["n"] == 2 else real)(*args)

    monkeypatch.setattr(export_mod, "compress_stage", second_stage_fails)
    with pytest.raises(RuntimeError, match="disk full"):
        export_model(source, [(0, 2), (2, 4)], "fp32", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_force(tiny_exports, tiny_llama_dir: Path) -> None:
    existing = tiny_exports.get(SPLITS[1])
    with pytest.raises(ExportError, match="already exists"):
        export_model(open_source(str(tiny_llama_dir)), [(0, 4)], "fp32", existing)
    load_manifest(existing)  # untouched


def test_unknown_model_type_and_missing_paths(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(SourceError, match="not supported"):
        open_source(str(tmp_path))
    with pytest.raises(SourceError, match="no such"):
        open_source(str(tmp_path / "nothing.gguf"))
    with pytest.raises(SourceError, match="no such file"):
        open_source("./does/not/exist")


@pytest.mark.slow
def test_qwen2_style_biases_export_exactly(tmp_path: Path) -> None:
    from tests.helpers.tiny_models import build_llama

    model_dir = build_llama(tmp_path / "qwen", arch="qwen2", layers=2, tied=False)
    export_model(open_source(str(model_dir)), [(0, 1), (1, 2)], "fp32", tmp_path / "exp")
    results = verify_export(tmp_path / "exp", ["hello world"], max_new_tokens=24)
    assert results[0].exact


@pytest.mark.slow
def test_compression_keeps_stdout_clean(tiny_llama_dir: Path, tmp_path: Path, capfd) -> None:
    """stdout belongs to the caller (``zctl run --json`` exporting on first use): NNCF's
    progress bars go to stderr."""
    export_model(open_source(str(tiny_llama_dir)), [(0, 4)], "int4", tmp_path / "int4")
    out, _ = capfd.readouterr()
    assert out == ""


def model_with_generation_config(tiny_llama_dir: Path, tmp_path: Path, text: str) -> Path:
    """The tiny model's files (linked) with ``text`` as its generation_config.json."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for path in tiny_llama_dir.iterdir():
        if path.name != "generation_config.json":
            (model_dir / path.name).symlink_to(path)
    (model_dir / "generation_config.json").write_text(text)
    return model_dir


def test_the_export_carries_the_models_generation_config(tiny_exports, tiny_llama_dir: Path,
                                                        tmp_path: Path) -> None:
    config = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1,
              "bos_token_id": 0, "eos_token_id": 3}
    model_dir = model_with_generation_config(tiny_llama_dir, tmp_path, json.dumps(config))
    export_model(open_source(str(model_dir)), [(0, 4)], "fp32", tmp_path / "out")
    carried = load_manifest(tmp_path / "out").generation_config
    assert carried == GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9,
                                       repetition_penalty=1.1)
    assert model_sampling(carried) == Sampling(0.6, 40, 0.9, 0.05, 1.1, FROM_GENERATION_CONFIG)
    # transformers' own generation config for the random model names no sampling field
    plain = load_manifest(tiny_exports.get(SPLITS[1])).generation_config
    assert plain == GenerationConfig() and model_sampling(plain) == LLAMA_SERVER_SAMPLING


def test_a_model_without_a_generation_config_exports_with_none(tiny_llama_dir: Path,
                                                              tmp_path: Path) -> None:
    model_dir = model_with_generation_config(tiny_llama_dir, tmp_path, "{}")
    (model_dir / "generation_config.json").unlink()
    assert open_source(str(model_dir)).sampling_config() is None


@pytest.mark.parametrize(("text", "why"), [
    ("{not json", "is not valid JSON"), ('{"temperature": "hot"}', "temperature has the wrong type"),
    ('{"repetition_penalty": 3.0}', "generation config: repetition_penalty must be in")])
def test_a_bad_generation_config_is_refused_and_writes_nothing(
        tiny_llama_dir: Path, tmp_path: Path, text: str, why: str) -> None:
    model_dir = model_with_generation_config(tiny_llama_dir, tmp_path, text)
    with pytest.raises((ExportError, SourceError), match=why):
        export_model(open_source(str(model_dir)), [(0, 4)], "fp32", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()
