"""OpenAI's API (and vLLM's token routes), as adapters over the shared serving context:
requests (``protocol``), chat completions (``chat``, its replies ``chat_replies``), text
completions (``completions``, ``completion_replies``), their choices answered whole or
streamed (``choices``, what both APIs' replies share: ``replies``), the Responses API
(``responses``, ``responses_protocol``, ``response_store``), models (``models``),
tokenizing (``tokenization``) and the routes (``routes``)."""
