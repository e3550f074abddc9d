"""The sampling a request gets for the fields it leaves out (pure).

A chat user expects a model to sample by default, as llama-server, Ollama and the model's
own generation config do: decoded greedily, a small model soon repeats one sentence to
the end. So a request's temperature, top_k, top_p, min_p or repetition_penalty left out
(None) takes the model's default: the field as its generation config gives it (Hugging
Face's ``generation_config.json``, kept by the export: ``ExportManifest.generation_config``;
``do_sample`` false there means greedy), else llama-server's. A front door with defaults
of its own (OpenAI's API: temperature 1, top_p 1) sets every field, and the model's
defaults do not apply.
"""

from __future__ import annotations

from dataclasses import replace

from zctl.engine.requests import (
    FROM_GENERATION_CONFIG,
    FROM_LLAMA_SERVER,
    GenerationRequest,
    Sampling,
)
from zctl.manifest import GenerationConfig

# llama-server's defaults (llama.cpp's common_params_sampling): what a model without a
# generation config gets; repetition_penalty 1 (none), as its repeat_penalty
LLAMA_SERVER_SAMPLING = Sampling(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                                 repetition_penalty=1.0, defaults=FROM_LLAMA_SERVER)


class SamplingConfigError(ValueError):
    """A model's generation config holds a value zctl cannot sample with."""


def model_sampling(config: GenerationConfig | None) -> Sampling:
    """A model's default sampling: each field its generation ``config`` gives (None: it has
    none), llama-server's for the rest; ``do_sample`` false: greedy (temperature 0).
    SamplingConfigError for a value outside what a request may ask."""
    if config is None:
        return LLAMA_SERVER_SAMPLING
    given = {name: value for name, value in (
        ("temperature", 0.0 if config.do_sample is False else config.temperature),
        ("top_k", config.top_k), ("top_p", config.top_p), ("min_p", config.min_p),
        ("repetition_penalty", config.repetition_penalty)) if value is not None}
    if not given:
        return LLAMA_SERVER_SAMPLING
    sampling = replace(LLAMA_SERVER_SAMPLING, **given, defaults=FROM_GENERATION_CONFIG)
    problem = sampling.problem()
    if problem is not None:
        raise SamplingConfigError(f"the model's generation config: {problem}")
    return sampling


def request_sampling(req: GenerationRequest, defaults: Sampling) -> Sampling:
    """What ``req`` samples with: its own fields, ``defaults``' for those it leaves out."""
    return Sampling(
        temperature=defaults.temperature if req.temperature is None else req.temperature,
        top_k=defaults.top_k if req.top_k is None else req.top_k,
        top_p=defaults.top_p if req.top_p is None else req.top_p,
        min_p=defaults.min_p if req.min_p is None else req.min_p,
        repetition_penalty=(defaults.repetition_penalty if req.repetition_penalty is None
                            else req.repetition_penalty),
        defaults=defaults.defaults)
