"""Anthropic's Messages API as an adapter over the shared serving context: requests and
replies (``protocol``), messages and token counts (``messages``), the routes (``routes``)."""
