"""The tokenizer and chat template that travel with an export, without transformers.

``tokenizer.json`` is run by the ``tokenizers`` library; the chat template (from
``chat_template.jinja`` or ``tokenizer_config.json``) is rendered with jinja2 the way
transformers renders it. ``StreamDecoder`` emits streamed text once it is complete UTF-8;
``with_texts`` and ``prompt_logprob_texts`` give logprobs their tokens' texts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from zctl.engine.requests import TokenLogprob
from zctl.manifest import CHAT_FORMAT_NAME, CHAT_STOPS, CHAT_TEMPLATE_NAME


class TokenizerError(ValueError):
    """The export's tokenizer files are missing or unusable."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _chat_stops(path: Path) -> tuple[str, ...]:
    """The stop strings ``path`` (an export's chat_format.json) gives a chat; none without it."""
    if not path.is_file():
        return ()
    try:
        stops = json.loads(path.read_text())[CHAT_STOPS]
    except (ValueError, KeyError, TypeError) as exc:
        raise TokenizerError(f"{path}: not a chat format ({CHAT_STOPS}: strings): "
                             f"{exc!r}") from None
    if not isinstance(stops, list) or not all(isinstance(t, str) and t for t in stops):
        raise TokenizerError(f"{path}: {CHAT_STOPS} must be a list of non-empty strings")
    return tuple(stops)


class ChatTokenizer:
    """Encode prompts (raw or through the chat template) and decode streamed tokens."""

    def __init__(self, export_dir: Path | str) -> None:
        from tokenizers import Tokenizer

        export_dir = Path(export_dir)
        path = export_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path} not found: the export carries no tokenizer")
        self._tok = Tokenizer.from_file(str(path))
        config_path = export_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template_path = export_dir / CHAT_TEMPLATE_NAME
        template = template_path.read_text() if template_path.is_file() else config.get("chat_template")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.chat_stops: tuple[str, ...] = _chat_stops(export_dir / CHAT_FORMAT_NAME)
        self._compiled: Any = None  # the template, compiled on first use

    @property
    def backend(self) -> Any:
        """The ``tokenizers.Tokenizer`` underneath."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Token ids run 0..vocab_size-1 (added tokens included)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self._tok.token_to_id(self.eos_token)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        if not self.chat_template:
            raise TokenizerError("this model has no chat template: use raw mode")
        if self._compiled is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TokenizerError(f"chat template error: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._compiled = env.from_string(self.chat_template)
        return self._compiled.render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def through_template(self, chat: bool) -> bool:
        """Whether a prompt asked as ``chat`` is put through the chat template."""
        return chat and bool(self.chat_template)

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids for a user prompt: through the chat template, or raw with special tokens."""
        if self.through_template(chat):
            text = self.render_chat([{"role": "user", "content": prompt}])
            return self._tok.encode(text, add_special_tokens=False).ids
        return self._tok.encode(prompt, add_special_tokens=True).ids

    def encode_chat(self, messages: list[tuple[str, str]]) -> list[int]:
        """Token ids of a conversation ((role, content) turns) through the chat template,
        ready for the assistant's answer."""
        text = self.render_chat([{"role": role, "content": content} for role, content in messages])
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


class StreamDecoder:
    """Incremental detokenizer: feed ids one at a time, get newly completed text.

    The ``tokenizers`` library's ``DecodeStream`` keeps only the few ids of the current
    word, so each token costs the same however long the stream is; it waits for the ids
    of an incomplete UTF-8 character and skips special tokens."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok = tokenizer.backend
        self._stream = DecodeStream(skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        return self._stream.step(self._tok, int(token_id)) or ""


def with_texts(tokenizer: ChatTokenizer, lp: TokenLogprob) -> TokenLogprob:
    """``lp`` with the text of its token and of each alternative."""
    decode = tokenizer.decode
    return replace(lp, text=decode([lp.token], skip_special_tokens=False),
                   top_texts=[decode([t], skip_special_tokens=False) for t in lp.top_tokens])


def prompt_logprob_texts(tokenizer: ChatTokenizer, first: int,
                         rest: Sequence[TokenLogprob | None]) -> list[TokenLogprob]:
    """A prompt's logprobs, one per token: ``first`` (nothing before it: at 0), then
    ``rest``. Each token's text is what it adds to the prompt's text (a special token
    nothing), so the texts join into the prompt and offsets follow it."""
    decoder = StreamDecoder(tokenizer)
    return [replace(with_texts(tokenizer, lp), text=decoder.push(lp.token))
            for lp in (TokenLogprob(first, 0.0), *rest) if lp is not None]
