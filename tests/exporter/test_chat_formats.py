"""A checkpoint that states no chat template (a base model: the packaged Gemma 3 270M
GGUF) is exported with a question-and-answer transcript as its template, and a chat's
reply ends where the model asks the next question (a raw completion's does not); a
stated template wins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exporter.chat_formats import TRANSCRIPT, stand_in_format
from exporter.export import export_model
from exporter.sources import open_source
from tests.helpers.tiny_models import build_llama
from zctl.engine.core import GenerationEngine
from zctl.engine.requests import ChatMessage, GenerationRequest
from zctl.engine.tokenizer import ChatTokenizer, TokenizerError
from zctl.manifest import CHAT_FORMAT_NAME

GEMMA = dict(arch="gemma3_text", layers=2, head_dim=16, sliding_window=8,
             sliding_window_pattern=2, query_pre_attn_scalar=16, pad_token_id=None)


def _without_template(out_dir: Path) -> Path:
    """A tiny Gemma 3 whose tokenizer states no chat template (as Gemma 3 270M's GGUF)."""
    from transformers import AutoTokenizer

    build_llama(out_dir, **GEMMA)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    tokenizer.chat_template = None
    (out_dir / "chat_template.jinja").unlink()
    tokenizer.save_pretrained(out_dir)
    config = json.loads((out_dir / "tokenizer_config.json").read_text())
    assert not config.get("chat_template") and not (out_dir / "chat_template.jinja").exists()
    return out_dir


@pytest.fixture(scope="module")
def base_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("base-chat")
    export_model(open_source(str(_without_template(root / "model"))), [(0, 2)], "fp32",
                 root / "export")
    return root / "export"


def test_a_base_export_chats_as_a_transcript(base_export: Path) -> None:
    tokenizer = ChatTokenizer(base_export)
    ids = tokenizer.encode_chat([("system", "Be brief. "), ("user", " hi\n"),
                                 ("assistant", "hello"), ("user", "why")])
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        "<s>Be brief.\n\nQuestion: hi\nAnswer: hello\nQuestion: why\nAnswer:")
    assert ids.count(tokenizer.backend.token_to_id("<s>")) == 1  # BOS once, from the template
    assert tokenizer.encode("why") == tokenizer.encode_chat([("user", "why")])
    assert tokenizer.chat_stops == ("\nQuestion:",)


def test_the_transcript_refuses_a_role_it_has_not(base_export: Path) -> None:
    with pytest.raises(TokenizerError, match="not tool"):
        ChatTokenizer(base_export).encode_chat([("user", "hi"), ("tool", "42")])


def test_only_a_chat_stops_where_the_next_question_starts(base_export: Path) -> None:
    engine = GenerationEngine(ChatTokenizer(base_export), [3], lambda: None)
    chats = [GenerationRequest("a", prompt="hi", stop=["."]),
             GenerationRequest("b", messages=[ChatMessage("user", "hi")])]
    raws = [GenerationRequest("c", prompt="hi", chat=False, stop=["."]),
            GenerationRequest("d", prompt_ids=[5, 6])]
    assert [engine.stop_strings_of(r) for r in chats] == [[".", "\nQuestion:"],
                                                          ["\nQuestion:"]]
    assert [engine.stop_strings_of(r) for r in raws] == [["."], []]


def test_a_stated_template_wins(tmp_path: Path) -> None:
    model = build_llama(tmp_path / "model", **GEMMA)  # the tiny tokenizer's ChatML template
    open_source(str(model)).save_tokenizer(tmp_path / "out")
    tokenizer = ChatTokenizer(tmp_path / "out")
    assert "<|im_start|>" in tokenizer.render_chat([{"role": "user", "content": "hi"}])
    assert tokenizer.chat_stops == () and not (tmp_path / "out" / CHAT_FORMAT_NAME).exists()
    assert stand_in_format("{{ messages }}") is None and stand_in_format(None) is TRANSCRIPT


@pytest.mark.parametrize("content", ['{"stop": [1]}', '{"stop": [""]}', '{"stop": "x"}',
                                     "[]", "{"])
def test_a_broken_chat_format_is_refused_by_name(base_export: Path, tmp_path: Path,
                                                 content: str) -> None:
    broken = tmp_path / "export"
    broken.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((base_export / name).read_bytes())
    (broken / CHAT_FORMAT_NAME).write_text(content)
    with pytest.raises(TokenizerError, match=CHAT_FORMAT_NAME):
        ChatTokenizer(broken)
