"""The HTTP API under load: concurrent clients against openvino_genai's continuous batching
and the HTTP layer's own cost (``serve``), long prompts (``prefill``, with its prompts,
systems and report), structured output (``structured``) and a prompt's scores
(``scoring``).
"""
