"""``/v1/models`` (zctl.serve.openai.models): the served model, and a 404 for any other."""

from __future__ import annotations

import httpx
import openai
import pytest

import tests.zctl.serve.test_app as ts

tiny, server, started = ts.tiny, ts.server, ts.started  # the API's fixtures, shared


def test_models_lists_the_served_model(server) -> None:
    models = server.client().models.list().data
    assert [m.id for m in models] == [ts.MODEL]
    raw = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert raw["max_model_len"] == 512 and [s["index"] for s in raw["stages"]] == [0, 1]
    assert server.client().models.retrieve(ts.MODEL).id == ts.MODEL
    with pytest.raises(openai.NotFoundError, match="not served here"):
        server.client().models.retrieve("gpt-4")
