"""The OpenAI-compatible HTTP front door (``zctl serve``): FastAPI routes over the
coordinator's generation service, with Prometheus metrics. Installed with the [serve]
extra; a worker node needs none of it."""
