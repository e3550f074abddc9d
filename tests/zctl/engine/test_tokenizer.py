"""The export's tokenizer without transformers must encode exactly as transformers does."""

from __future__ import annotations

from pathlib import Path

import pytest

from zctl.engine.tokenizer import ChatTokenizer, StreamDecoder, TokenizerError


def test_chat_and_raw_encoding_match_transformers(tiny_exports) -> None:
    from transformers import AutoTokenizer

    export_dir = tiny_exports.get([(0, 4)])
    ours = ChatTokenizer(export_dir)
    theirs = AutoTokenizer.from_pretrained(export_dir)
    for prompt in ["what is the capital of france?", "def f(x): return x", "héllo wörld ✓"]:
        chat = theirs.apply_chat_template([{"role": "user", "content": prompt}],
                                          add_generation_prompt=True, tokenize=True)
        chat = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
        assert ours.encode(prompt, chat=True) == list(chat)
        assert ours.encode(prompt, chat=False) == theirs(prompt)["input_ids"]
    assert ours.eos_token_id == theirs.eos_token_id


def test_stream_decoder_waits_for_complete_characters(tiny_exports) -> None:
    tokenizer = ChatTokenizer(tiny_exports.get([(0, 4)]))
    text = "snow ✓ done"
    ids = tokenizer.encode(text, chat=False)[1:]  # drop BOS
    decoder = StreamDecoder(tokenizer)
    pieces = [decoder.push(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_missing_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="carries no tokenizer"):
        ChatTokenizer(tmp_path)


def test_no_chat_template_falls_back_or_refuses(tiny_exports, tmp_path: Path) -> None:
    import json
    import shutil

    src = tiny_exports.get([(0, 4)])
    shutil.copy(src / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = ChatTokenizer(tmp_path)
    assert tokenizer.encode("hi", chat=True) == tokenizer.encode("hi", chat=False)
    with pytest.raises(TokenizerError, match="no chat template"):
        tokenizer.render_chat([{"role": "user", "content": "hi"}])


def test_stream_decoder_cost_does_not_grow_with_the_stream(tiny_exports, monkeypatch) -> None:
    """Each token is decoded on its own (tokenizers' DecodeStream), never the whole stream
    again: the text still equals decoding all ids at once."""
    tokenizer = ChatTokenizer(tiny_exports.get([(0, 4)]))
    text = " ".join(["the quick brown fox jumps over ✓ the lazy dog"] * 40)
    ids = tokenizer.encode(text, chat=False)[1:]
    whole = tokenizer.decode(ids)
    monkeypatch.setattr(ChatTokenizer, "decode", lambda *a, **k: pytest.fail("re-decoded"))
    decoder = StreamDecoder(tokenizer)
    assert "".join(decoder.push(i) for i in ids) == whole
