"""The chat format an export stands in when its checkpoint states no chat template.

A pretrained (base) checkpoint carries no chat template (the packaged Gemma 3 270M GGUF
does not), and an export without one could only be prompted raw: the OpenAI and Anthropic
chat routes would refuse it. A base model does not follow an instruction-tuned model's
turn markers (Gemma 3 270M answers its family's ``<start_of_turn>`` turns with noise),
but it continues a plain question-and-answer transcript sensibly. So such an export gets
that transcript as its template, and a chat's reply ends where the model goes on to ask
the next question (the stop string ``\nQuestion:``, of chat requests only: a raw
completion runs on). A checkpoint's own template always wins.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatFormat:
    template: str  # a jinja2 chat template, rendered as transformers renders one
    stops: tuple[str, ...]  # text that ends the model's turn: stop strings of a chat's reply


# A system message opens the transcript as a paragraph of its own; each user turn is a
# "Question:" line, each assistant turn an "Answer:" line; the reply follows "Answer:".
TRANSCRIPT = ChatFormat(
    template=(
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}"
        "{{ message['content'] | trim ~ '\n\n' }}"
        "{% elif message['role'] == 'user' %}"
        "{{ 'Question: ' ~ message['content'] | trim ~ '\n' }}"
        "{% elif message['role'] == 'assistant' %}"
        "{{ 'Answer: ' ~ message['content'] | trim ~ '\n' }}"
        "{% else %}"
        "{{ raise_exception('a transcript has system, user and assistant turns, not '"
        " ~ message['role']) }}"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ 'Answer:' }}{% endif %}"
    ),
    stops=("\nQuestion:",),
)


def stand_in_format(stated_template: str | None) -> ChatFormat | None:
    """The chat format an export writes: none when the checkpoint states a template, else
    the question-and-answer transcript."""
    return None if stated_template else TRANSCRIPT
