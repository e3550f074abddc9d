"""The engine's API: a generation request, the chunks it streams back, and how it ended.

Plain frozen dataclasses with no transport: the ZeroMQ front door
(zctl.service.messages) carries these same fields on the wire, and any other
front door (an HTTP server) builds them from its own requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_PROMPT_CHARS = 1 << 20
MAX_PROMPT_IDS = 1 << 18  # a prompt given as token ids
# what a request's ``logits_payload`` may ask of the last stage (zctl.engine.payloads)
PAYLOAD_POLICIES = ("auto", "fp16", "fp32")
MAX_NEW_TOKENS = 1 << 16
MAX_DRAFT_TOKENS = 32
MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20
MAX_MESSAGES = 4096
# generations a service runs at once (more wait their turn): with paged KV and row groups,
# 16 streams serve 16 clients ~20% faster than 8 (docs/measurements.md, "Serving")
DEFAULT_MAX_STREAMS = 16
MAX_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties: -2..2
MAX_REPETITION_PENALTY = 2.0  # a repetition penalty is in (0, 2] (1: none)
MAX_LOGIT_BIAS = 100.0  # ... for a token's logit bias: -100..100
MAX_BIASED_TOKENS = 1024  # the most tokens one request's logit_bias names
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# "pipelined": lookup guesses keep every stage busy for one stream (zctl.engine.pipelined)
SPECULATIVE_MODES = ("", "lookup", "pipelined")  # or "draft:PATH" (a 1-stage export on the
# coordinator)
# what a request's output may be held to (zctl.engine.constraints): a JSON Schema, a regular
# expression, a grammar (Lark or llama.cpp's GBNF), a JSON list of choices, or JSON of a
# schema or else text that does not begin with "{" (a tool call or an answer: free text
# once its first token shows it is text)
GRAMMAR_KINDS = ("json_schema", "regex", "grammar", "choice", "json_or_text")
MAX_GRAMMAR_CHARS = 1 << 16


class RequestRefused(ValueError):
    """A well-formed request the engine cannot run (e.g. a missing draft model)."""


# Why a generation failed, for a front door to map onto its own codes (HTTP 400/503/500).
BAD_REQUEST, UNAVAILABLE, INTERNAL = "bad_request", "unavailable", "internal"


MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1 << 20


def sampling_checks(temperature: float | None, top_k: int | None, top_p: float | None,
                    min_p: float | None, repetition_penalty: float | None
                    ) -> tuple[tuple[bool, str], ...]:
    """(sound, what is wrong if not) for each sampling value; None (left out) is sound."""
    return (
        (temperature is None or 0.0 <= temperature <= MAX_TEMPERATURE,
         f"temperature must be in 0..{MAX_TEMPERATURE:g}"),
        (top_k is None or 0 <= top_k <= MAX_TOP_K, "top_k must be >= 0"),
        (top_p is None or 0.0 < top_p <= 1.0, "top_p must be in (0, 1]"),
        (min_p is None or 0.0 <= min_p <= 1.0, "min_p must be in [0, 1]"),
        (repetition_penalty is None or 0.0 < repetition_penalty <= MAX_REPETITION_PENALTY,
         f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}]"),
    )


# where the sampling of a request that leaves it out comes from (``Sampling.defaults``)
FROM_GENERATION_CONFIG = "generation_config"  # the model's generation_config.json
FROM_LLAMA_SERVER = "llama-server"  # llama-server's defaults: the model has no say


@dataclass(frozen=True)
class Sampling:
    """A generation's sampling: temperature (0: greedy), top_k (0: all), top_p (1: all),
    min_p (0: all) and repetition_penalty (1: none). As a model's defaults, what a request
    gets for the fields it leaves out; in a ``GenerationDone``, what the generation ran
    with. ``defaults`` says where the model's defaults came from (FROM_GENERATION_CONFIG,
    FROM_LLAMA_SERVER)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    defaults: str = FROM_LLAMA_SERVER

    def problem(self) -> str | None:
        """What is wrong with the values (the first thing found), or None."""
        checks = sampling_checks(self.temperature, self.top_k, self.top_p, self.min_p,
                                 self.repetition_penalty)
        return next((text for ok, text in checks if not ok), None)


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a conversation, rendered with the model's own chat template."""

    role: str
    content: str


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model, and the most likely
    alternatives at its position (best first)."""

    token: int
    logprob: float
    top_tokens: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    text: str = ""  # each token's own text (the engine fills these in)
    top_texts: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class GenerationRequest:
    """Generate for this prompt, streaming tokens back."""

    request_id: str
    prompt: str = ""  # a user prompt, or raw text (chat=False); or else ``messages``
    max_tokens: int = 128  # 0: as many as the model's context holds
    chat: bool = True
    ignore_eos: bool = False
    speculative: str = ""  # "", "lookup", "pipelined" or "draft:PATH"
    k: int = 0  # draft tokens per step (with "pipelined": per run, after its first token);
    # 0 = adaptive (up to MAX_DRAFT_TOKENS // 2; pipelined: zctl.engine.pipelined.WIDE)
    # sampling: None (a field left out) takes the model's default (``Sampling``,
    # zctl.engine.sampling_defaults): its generation config's, else llama-server's
    temperature: float | None = None  # 0 = greedy
    top_k: int | None = None  # 0 = no top-k truncation
    top_p: float | None = None  # 1 = no nucleus truncation
    seed: int | None = None  # None: a fresh seed per request
    presence_penalty: float = 0.0  # off each generated token's logit (zctl.engine.sampling)
    frequency_penalty: float = 0.0  # ... once per time it was generated
    repetition_penalty: float | None = None  # a prompt's or output's token's logit divided
    # by it (multiplied when negative): Hugging Face's and llama.cpp's; 1 is none
    logit_bias: dict[str, float] = field(default_factory=dict)  # token id (decimal) -> bias
    messages: list[ChatMessage] = field(default_factory=list)  # a conversation (chat)
    prompt_ids: list[int] = field(default_factory=list)  # or the prompt as token ids (raw)
    stop: list[str] = field(default_factory=list)  # stop strings: end before the first one
    logprobs: bool = False  # chunks carry each token's TokenLogprob
    top_logprobs: int = 0  # ... with this many alternatives
    logits_payload: str = "auto"  # what the last stage sends when logits are needed: "auto"
    # (the smallest exact: top-k where it answers exactly), "fp16" or "fp32" (zctl.engine.payloads)
    chunk_interval_ms: int = 100  # how often tokens are sent (0: each as it comes)
    grammar_kind: str = ""  # "": free text; else one of GRAMMAR_KINDS, and the output
    grammar: str = ""  # ... matches this (zctl.engine.constraints; drafts are checked by it)
    prompt_logprobs: bool = False  # the first chunk carries the prompt's tokens' logprobs
    # (each after the ones before it, with top_logprobs alternatives; needs logprobs): the
    # whole prompt is prefilled, no cached prefix used
    min_p: float | None = None  # keep tokens at least this fraction as likely as the best
    # (0: all)
    stop_token_ids: list[int] = field(default_factory=list)  # these end it too (not shown;
    # also with ignore_eos), as vLLM's stop_token_ids

    def biases(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs in id order (check ``problem`` first;
        of two spellings of one id, such as "7" and "07", the later wins)."""
        return tuple(sorted({int(k): float(b) for k, b in self.logit_bias.items()}.items()))

    def problem(self) -> str | None:
        """What is wrong with the request's values (the first thing found), or None."""
        stop_chars = sum(len(s) for s in self.stop)
        checks = (
            *sampling_checks(self.temperature, self.top_k, self.top_p, self.min_p,
                             self.repetition_penalty),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS and all(
                0 <= t < 1 << 31 for t in self.stop_token_ids),
             f"stop_token_ids takes up to {MAX_STOP_TOKEN_IDS} ids >= 0"),
            (self.seed is None or 0 <= self.seed < 1 << 63, "seed must be >= 0"),
            (-MAX_PENALTY <= self.presence_penalty <= MAX_PENALTY,
             f"presence_penalty must be in -{MAX_PENALTY:g}..{MAX_PENALTY:g}"),
            (-MAX_PENALTY <= self.frequency_penalty <= MAX_PENALTY,
             f"frequency_penalty must be in -{MAX_PENALTY:g}..{MAX_PENALTY:g}"),
            (len(self.logit_bias) <= MAX_BIASED_TOKENS and all(
                k.isascii() and k.isdecimal() and len(k) <= 9 for k in self.logit_bias) and all(
                -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for b in self.logit_bias.values()),
             f"logit_bias maps up to {MAX_BIASED_TOKENS} token ids (decimal strings) to "
             f"-{MAX_LOGIT_BIAS:g}..{MAX_LOGIT_BIAS:g}"),
            (self.speculative in SPECULATIVE_MODES or (
                self.speculative.startswith("draft:") and len(self.speculative) > 6),
             f"speculative must be '', 'lookup', 'pipelined' or 'draft:PATH', got "
             f"{self.speculative!r}"),
            (0 <= self.k <= MAX_DRAFT_TOKENS,
             f"k must be in 0..{MAX_DRAFT_TOKENS} (0 = adaptive)"),
            (bool(self.prompt) + bool(self.messages) + bool(self.prompt_ids) == 1,
             "give one of a prompt, messages or prompt token ids"),
            (len(self.prompt) + sum(len(m.content) for m in self.messages) <= MAX_PROMPT_CHARS,
             f"the prompt must have at most {MAX_PROMPT_CHARS} characters"),
            (len(self.prompt_ids) <= MAX_PROMPT_IDS and all(0 <= t < 1 << 31
                                                             for t in self.prompt_ids),
             f"prompt token ids are up to {MAX_PROMPT_IDS} ids >= 0"),
            (not (self.prompt_ids and self.chat), "prompt token ids are raw (chat=False)"),
            (len(self.messages) <= MAX_MESSAGES, f"at most {MAX_MESSAGES} messages"),
            (self.chat or not self.messages, "messages need the chat template (chat=True)"),
            (all(m.role in CHAT_ROLES for m in self.messages),
             f"a message's role is one of {', '.join(CHAT_ROLES)}"),
            (len(self.stop) <= MAX_STOP_STRINGS and all(self.stop) and stop_chars <= MAX_STOP_CHARS,
             f"stop takes up to {MAX_STOP_STRINGS} non-empty strings ({MAX_STOP_CHARS} "
             "characters in all)"),
            (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
             f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}"),
            (self.logprobs or self.top_logprobs == 0, "top_logprobs needs logprobs"),
            (self.logprobs or not self.prompt_logprobs, "prompt_logprobs needs logprobs"),
            (self.logits_payload in PAYLOAD_POLICIES,
             f"logits_payload must be one of {', '.join(PAYLOAD_POLICIES)}"),
            (0 <= self.chunk_interval_ms <= 60_000, "chunk_interval_ms must be in 0..60000"),
            (0 <= self.max_tokens <= MAX_NEW_TOKENS,
             f"max_tokens must be in 0..{MAX_NEW_TOKENS} (0: as many as the context holds)"),
            (self.grammar_kind in ("", *GRAMMAR_KINDS),
             f"grammar_kind is '' or one of {', '.join(GRAMMAR_KINDS)}"),
            (bool(self.grammar_kind) == bool(self.grammar), "a grammar needs its kind, and a kind "
             "its grammar"),
            (len(self.grammar) <= MAX_GRAMMAR_CHARS,
             f"the grammar must have at most {MAX_GRAMMAR_CHARS} characters"),
            (0 < len(self.request_id) <= 64, "request_id must be 1..64 chars"),
        )
        return next((text for ok, text in checks if not ok), None)


@dataclass(frozen=True)
class GenerationChunk:
    """Newly generated tokens and text, with running figures (or only a ``note``)."""

    request_id: str
    tokens: list[int]
    text: str
    produced: int
    ttft_ms: float | None = None
    tok_s: float | None = None
    timing: dict[str, dict[str, float]] = field(default_factory=dict)  # step figures, only
    # when newer than the ones this stream last got (a client keeps the last it got)
    spec: dict[str, float] = field(default_factory=dict)  # acceptance, k, tokens_per_step
    note: str = ""  # what happened to the generation (paused: a stage is down; resumed)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, if asked
    # the prompt's tokens, each after the ones before it (the first, with none before it,
    # at 0), in the stream's first chunk when prompt_logprobs asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class GenerationDone:
    """The generation ended: all its tokens and text (``error`` is empty on success).

    ``stop_reason``: "eos", "stop" (a stop string), "max_tokens", "cancelled" or "error";
    ``error_kind`` says why an error happened (BAD_REQUEST, UNAVAILABLE, INTERNAL)."""

    request_id: str
    tokens: list[int]
    text: str
    prompt_tokens: int
    ttft_ms: float
    tok_s: float
    timing: dict[str, dict[str, float]] = field(default_factory=dict)
    stop_reason: str = ""
    error: str = ""
    spec: dict[str, float] = field(default_factory=dict)
    error_kind: str = ""
    cached_tokens: int = 0  # of prompt_tokens, those whose KV came from the prefix cache
    sampling: Sampling | None = None  # what it sampled with (None: it never started)
