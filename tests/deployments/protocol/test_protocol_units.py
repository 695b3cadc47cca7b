"""The typed replica protocol and the ingress's body guard, without a cluster: what the replica
encodes the ingress decodes field for field, a misspelt or missing key is an error (not a
silently dropped field), and every engine or store failure maps to its honest status."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from adapter_store.errors import IntegrityError, NotFoundError, StoreUnavailableError
from deployments.api.json_guard import BodyError, parse_body
from deployments.protocol.errors import error_item, output_error, status_of
from deployments.protocol.wire import (
    DeltaItem,
    ErrorItem,
    InfoItem,
    TokenAttributionItem,
    UsageItem,
    decode,
    encode,
)
from deployments.replica.fanout import delta_wire
from molora_runtime.engine.types import GenerationOutput, TokenAttribution
from molora_runtime.errors import (
    AdapterLoadError,
    AdapterNotFoundError,
    EngineOverloadedError,
    EngineStoppedError,
    NonFiniteLogitsError,
    SequenceStepError,
)


def test_items_round_trip() -> None:
    items = [
        InfoItem(replica="r1", hot_set_hit=True),
        DeltaItem(
            text="ab",
            token_ids=[5, 6],
            attribution=[
                TokenAttributionItem(token_id=5, adapters={"math": 1.0}),
                TokenAttributionItem(token_id=6, adapters={"code": 0.5}),
            ],
            finish_reason="length",
        ),
        UsageItem(prompt_tokens=3, completion_tokens=2),
        ErrorItem(status=400, message="bad", param="seed"),
    ]
    for item in items:
        assert decode(encode(item)) == item


@pytest.mark.parametrize(
    "raw",
    [
        {"type": "delta", "text": "x", "engine_error": "boom"},  # a field nobody reads
        {"type": "error", "message": "no status"},
        {"type": "telepathy"},
        {"text": "no type"},
        {"type": "delta", "finish_reason": "error"},  # errors travel as error items only
    ],
)
def test_malformed_items_are_refused(raw) -> None:
    with pytest.raises(ValidationError):
        decode(raw)


def test_delta_of_a_multi_token_increment() -> None:
    out = GenerationOutput(
        request_id="r",
        new_token_ids=[1, 2, 3],
        text_delta="abc",
        finished=True,
        finish_reason="stop",
        attribution=[TokenAttribution(token_id=t, adapters={"a": 1.0}) for t in (1, 2, 3)],
    )
    item = decode(delta_wire(out))
    assert isinstance(item, DeltaItem)
    assert item.token_ids == [1, 2, 3] and item.text == "abc" and item.finish_reason == "stop"
    assert [a.token_id for a in item.attribution or []] == [1, 2, 3]


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (AdapterLoadError("adapter 'x': tensor holds NaN or Inf values"), 400),
        (NonFiniteLogitsError("nan"), 400),
        (AdapterNotFoundError("gone"), 404),
        (NotFoundError("gone"), 404),
        (EngineOverloadedError("full"), 429),
        (EngineStoppedError("stopping"), 503),
        (StoreUnavailableError("store down"), 503),
        (IntegrityError("checksum"), 502),
        (SequenceStepError("the request failed inside the model step: X"), 500),
        (RuntimeError("bug"), 500),
    ],
)
def test_statuses(exc, status) -> None:
    assert status_of(exc) == status
    item = error_item(exc)
    assert item.status == status and item.message


def test_engine_error_output_keeps_its_own_message_and_status() -> None:
    exc = AdapterLoadError("adapter 'nanad': tensor 'k' holds NaN or Inf values")
    out = GenerationOutput("r", [], "", True, "error", error=str(exc), exception=exc)
    item = output_error(out)
    assert item.status == 400 and item.message == str(exc)
    store = StoreUnavailableError("adapter math is not cached and the store is down")
    down = GenerationOutput("r", [], "", True, "error", error=str(store), exception=store)
    assert output_error(down).status == 503


def test_body_guard() -> None:
    ok = {"a": [[[{"b": "text 🧪"}]]]}
    assert parse_body(json.dumps(ok).encode(), max_depth=5) == ok
    with pytest.raises(BodyError, match="deeper than 4 levels"):
        parse_body(json.dumps(ok).encode(), max_depth=4)
    with pytest.raises(BodyError, match="deeper than 32"):
        parse_body(b"[" * 5000 + b"]" * 5000)
    with pytest.raises(BodyError, match=r"invalid Unicode at a\.0"):
        parse_body(b'{"a": ["\\ud800"]}')
    with pytest.raises(BodyError, match="not valid JSON"):
        parse_body(b"\xff{")
