"""Text-only deltas are written to SSE straight from the wire dict: the bytes must be what the
typed path (the protocol's pydantic chunk models) writes, and parse back into those models."""

from __future__ import annotations

import json
from typing import Any

import pytest

from deployments.api.chunks import typed_chunk
from deployments.api.request_models import ChatCompletionRequest, CompletionRequest
from deployments.api.response_models import ChatCompletionChunk, CompletionChunk
from deployments.api.response_shape import ResponseShape
from deployments.api.shaping import Shaper
from deployments.catalog.model_names import Resolved
from molora_runtime.routes import BaseRoute

KEY = "cmpl-plain"
TEXTS = ["plain", "", 'quote " and \\ back', "é ✓ \U0001f600 \u2028", "\x00\x1f</script>"]


def _shaper(chat: bool, **extra: Any) -> Shaper:
    body: dict[str, Any] = {"model": "base", "stream": True, **extra}
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
        req: Any = ChatCompletionRequest.model_validate(body)
    else:
        body["prompt"] = "hi"
        req = CompletionRequest.model_validate(body)
    resolved = Resolved(route=BaseRoute(), placement_adapters=())
    shaper = Shaper(ResponseShape.of(req, resolved, chat, KEY))
    shaper.sent_role.add(0)  # the choice's first chunk (role, molora info) went out typed
    return shaper


def _typed(shaper: Shaper, raw: dict[str, Any]) -> str:
    """The chunk the protocol's models write (the typed twin of the dict renderer)."""
    shaper.plain = False
    shaper.render = typed_chunk  # type: ignore[method-assign]
    try:
        return shaper.sse(raw)
    finally:
        shaper.plain = True
        del shaper.render


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish", [None, "stop", "length"])
def test_plain_delta_is_the_typed_chunk(chat: bool, text: str, finish: str | None) -> None:
    shaper = _shaper(chat)
    raw = {"type": "delta", "index": 0, "text": text, "token_ids": [5], "finish_reason": finish}
    fast, typed = shaper.sse(raw), _typed(shaper, raw)
    if not text and finish is None:
        assert fast == typed == ""  # nothing to say: no chunk
        return
    assert fast.startswith("data: ") and fast.endswith("\n\n")
    assert fast == typed
    model = ChatCompletionChunk if chat else CompletionChunk
    parsed = model.model_validate_json(fast[6:])
    assert parsed.id == KEY and parsed.choices[0].finish_reason == finish
    assert (parsed.choices[0].delta.content if chat else parsed.choices[0].text) == text


def test_rich_requests_take_the_typed_path() -> None:
    raw = {"type": "delta", "index": 0, "text": "x", "token_ids": [5], "finish_reason": None}
    assert not _shaper(True, logprobs=True).plain
    assert not _shaper(True, molora={"return_attribution": True}).plain
    shaper = _shaper(True)
    shaper.sent_role.clear()  # a choice's first delta carries the role: typed
    chunk = json.loads(shaper.sse(raw)[6:])
    assert chunk["choices"][0]["delta"]["role"] == "assistant"


def test_a_malformed_wire_delta_is_an_error_not_a_chunk() -> None:
    with pytest.raises(KeyError):
        _shaper(True).sse({"type": "delta", "index": 0, "token_ids": [1]})
