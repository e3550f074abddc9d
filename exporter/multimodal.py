"""The language model inside a multimodal checkpoint: zctl exports its text part.

Gemma 3 from 4B up is published as ``Gemma3ForConditionalGeneration``: a vision tower, a
projector and a Gemma 3 text model, whose config sits under ``text_config`` and whose
tensors under a prefix, ``language_model.model.`` and ``language_model.lm_head.`` as the
Hub's checkpoints (and transformers' ``save_pretrained``) store them, or
``model.language_model.`` beside a top-level ``lm_head.`` in transformers' own module
layout. A text prompt runs through the text model alone, so the export is that model's:
the vision tower and the projector are not read. Its chat template may be its processor's
only (``chat_template.json``), where the tokenizer does not look: the export takes it
from there (a template that handles a message's content as text as well as images).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

PROCESSOR_CHAT_TEMPLATE = "chat_template.json"  # a processor's {"chat_template": "..."}

# a multimodal architecture -> its text model's architecture (its config: ``text_config``)
TEXT_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# where the text model's tensors are stored -> their names in a text-only checkpoint
TEXT_PREFIXES = (("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head."),
                 ("model.language_model.", "model."),
                 ("lm_head.", "lm_head."))


def multimodal_architecture(architectures: Iterable[str] | None) -> str | None:
    """The multimodal architecture ``architectures`` names whose text model zctl exports
    (None: none)."""
    return next((a for a in architectures or () if a in TEXT_MODELS), None)


def text_part_of_raw(raw: Mapping[str, Any]) -> tuple[list[str], Any]:
    """A config.json's (architectures, model_type) as the family check reads them: the text
    model's for a multimodal checkpoint, the config's own otherwise."""
    architectures = raw.get("architectures")
    wrapper = multimodal_architecture(architectures if isinstance(architectures, list) else None)
    if wrapper is None:
        return architectures, raw.get("model_type")
    text = raw.get("text_config")
    model_type = text.get("model_type") if isinstance(text, Mapping) else None
    return [TEXT_MODELS[wrapper]], model_type


def text_config(config: Any) -> Any:
    """The config of the model zctl exports: a multimodal one's text model's config (its
    architecture named, and the top level's token ids where the text model's leave them
    out), or ``config`` itself."""
    wrapper = multimodal_architecture(getattr(config, "architectures", None))
    if wrapper is None:
        return config
    text = config.text_config
    text.architectures = [TEXT_MODELS[wrapper]]
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(text, name, None) is None and getattr(config, name, None) is not None:
            setattr(text, name, getattr(config, name))
    return text


def text_tensor_names(stored: Iterable[str]) -> dict[str, str]:
    """The text model's tensors among a multimodal checkpoint's ``stored`` names: each one's
    name in a text-only checkpoint -> its stored name (the vision tower's, the projector's
    and any other tensor left out)."""
    names: dict[str, str] = {}
    for name in stored:
        for prefix, text_prefix in TEXT_PREFIXES:
            if name.startswith(prefix):
                names[text_prefix + name[len(prefix):]] = name
                break
    return names


class ProcessorTemplateError(ValueError):
    """A processor's chat template file that cannot be read."""


def processor_chat_template(model_dir: Path) -> str | None:
    """The chat template of ``model_dir``'s processor (``chat_template.json``), None when
    there is no such file; ProcessorTemplateError for one that is not JSON or holds no
    template string."""
    path = Path(model_dir) / PROCESSOR_CHAT_TEMPLATE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:  # JSONDecodeError, bad UTF-8
        raise ProcessorTemplateError(f"{path} is not valid JSON: {exc}") from None
    template = raw.get("chat_template") if isinstance(raw, dict) else None
    if not isinstance(template, str) or not template.strip():
        raise ProcessorTemplateError(f"{path} holds no chat_template string")
    return template
