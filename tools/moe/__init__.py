"""Mixture-of-experts benchmarks: zctl's Qwen3-MoE stage shards against openvino_genai."""
