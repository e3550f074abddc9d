"""OpenAI's API (and vLLM's token routes), as adapters over the shared serving context:
requests (``protocol``), chat completions (``chat``), text completions (``completions``),
their choices answered whole or streamed (``choices``, ``replies``), the Responses API
(``responses``, ``responses_protocol``, ``response_store``), models (``models``),
tokenizing (``tokenization``) and the routes (``routes``)."""
