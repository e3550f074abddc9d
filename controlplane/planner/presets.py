"""Named model shapes, with the values of each model's published config.json."""

from __future__ import annotations

from controlplane.planner.shape import ModelShape

PRESETS: dict[str, ModelShape] = {shape.name: shape for shape in (
    # meta-llama/Llama-3.1-70B
    ModelShape("llama-3.1-70b", num_layers=80, hidden=8192, intermediate=28672, heads=64,
               kv_heads=8, head_dim=128, vocab=128256),
    # meta-llama/Llama-3.1-8B
    ModelShape("llama-3.1-8b", num_layers=32, hidden=4096, intermediate=14336, heads=32,
               kv_heads=8, head_dim=128, vocab=128256),
    # meta-llama/Llama-3.2-1B
    ModelShape("llama-3.2-1b", num_layers=16, hidden=2048, intermediate=8192, heads=32,
               kv_heads=8, head_dim=64, vocab=128256, tied_embeddings=True),
    # Qwen/Qwen2.5-72B
    ModelShape("qwen2.5-72b", num_layers=80, hidden=8192, intermediate=29568, heads=64,
               kv_heads=8, head_dim=128, vocab=152064, architecture="qwen2"),
    # Qwen/Qwen3-30B-A3B: every layer a mixture of 128 experts, 8 active per token
    ModelShape("qwen3-30b-a3b", num_layers=48, hidden=2048, intermediate=6144, heads=32,
               kv_heads=4, head_dim=128, vocab=151936, experts=128, active_experts=8,
               expert_intermediate=768, architecture="qwen3_moe"),
    # openai/gpt-oss-20b: every layer a mixture of 32 experts, 4 active per token; every
    # other layer (from the first) attends over a window of 128 tokens
    ModelShape("gpt-oss-20b", num_layers=24, hidden=2880, intermediate=2880, heads=64,
               kv_heads=8, head_dim=64, vocab=201088, experts=32, active_experts=4,
               expert_intermediate=2880, architecture="gpt_oss", sliding_window=128,
               sliding_layers=12),
    # openai/gpt-oss-120b: 128 experts, 4 active per token (transformers' GptOssConfig defaults)
    ModelShape("gpt-oss-120b", num_layers=36, hidden=2880, intermediate=2880, heads=64,
               kv_heads=8, head_dim=64, vocab=201088, experts=128, active_experts=4,
               expert_intermediate=2880, architecture="gpt_oss", sliding_window=128,
               sliding_layers=18),
    # HuggingFaceTB/SmolLM2-135M-Instruct (zctl's default model)
    ModelShape("smollm2-135m", num_layers=30, hidden=576, intermediate=1536, heads=9,
               kv_heads=3, head_dim=64, vocab=49152, tied_embeddings=True),
)}
