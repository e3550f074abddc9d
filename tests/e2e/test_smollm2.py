"""End to end on the real default model (SmolLM2-135M-Instruct from its GGUF): a few minutes.
Speculative decoding with both drafters through a 3-node local cluster equals greedy on
every bench_spec prompt. (Its exports checked against Hugging Face in one process:
tests/exporter/test_export_smollm2.py.)"""

from __future__ import annotations

from pathlib import Path


def test_speculative_through_a_cluster_equals_greedy_on_a_bench_prompt_of_each_kind(
        smol_int4_exports, tmp_path: Path) -> None:
    """Both drafters, fixed K so every step drafts where it can, through a 3-node local
    cluster (processes on 127.0.0.1-3) with exact activations and KV: token for token
    the greedy output on one of bench_spec's prompts of each kind (code,
    extraction, chat, creative)."""
    import uuid

    from tools.spec.prompts import PROMPTS as BENCH_PROMPTS
    from zctl.engine.requests import GenerationDone, GenerationRequest
    from zctl.launcher.local import start_local_cluster, stop_processes, wait_serving
    from zctl.launcher.processes import runtime_spec
    from zctl.service.client import generate_stream

    one_stage, three_stages = smol_int4_exports
    record = start_local_cluster(three_stages, 3, runtime_spec(
        "f32", None, "CPU", "f32", dynamic_quantization=False), tmp_path / "cluster")
    try:
        wait_serving(record, 300)

        def run(prompt: str, speculative: str = "") -> tuple[list[int], float]:
            request = GenerationRequest(uuid.uuid4().hex[:16], prompt, 48, True, ignore_eos=True,
                                      temperature=0.0,
                                      speculative=speculative, k=4 if speculative else 0)
            done = [m for m in generate_stream(record.serve, request)
                    if isinstance(m, GenerationDone)][-1]
            assert not done.error, done.error
            return list(done.tokens), done.spec.get("tokens_per_step", 1.0)

        per_step: dict[str, list[float]] = {"lookup": [], "draft": []}
        kinds = {p.kind: p for p in reversed(BENCH_PROMPTS)}  # the first of each kind
        for prompt in kinds.values():
            greedy, _ = run(prompt.text)
            for mode in ("lookup", f"draft:{one_stage}"):
                tokens, tokens_per_step = run(prompt.text, mode)
                assert tokens == greedy, (prompt.name, mode)
                per_step[mode.split(":")[0]].append(tokens_per_step)
        # the drafts were verified, not skipped: several tokens per step
        assert min(per_step["draft"]) > 2 and max(per_step["lookup"]) > 1.5, per_step
    finally:
        stop_processes(record.pids)
