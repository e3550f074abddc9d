"""The HTTP front door (``zctl serve``): FastAPI over the coordinator's generation service,
with Prometheus metrics. A shared serving context (``context``: the service's client,
admission, the key and model checks, metrics) and an adapter per API over it
(``openai``, ``anthropic``). Installed with the [serve] extra; a worker node needs none of
it."""
