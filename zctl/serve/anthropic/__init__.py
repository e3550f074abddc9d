"""Anthropic's Messages API as an adapter over the shared serving context: requests
(``protocol``), replies (``replies``), messages and token counts (``messages``), the
routes (``routes``)."""
