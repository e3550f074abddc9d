"""Exporter: cut a Llama-family model into per-stage OpenVINO IR shards.

Uses torch, transformers and NNCF (the ``[export]`` extra); the runtime side never
imports this package.
"""
