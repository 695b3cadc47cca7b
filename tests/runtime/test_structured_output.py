"""response_format: a random tiny model under the grammar mask still emits valid JSON that
validates against the schema (greedy and sampled, with n > 1 siblings), and a bad schema fails
before queueing."""

from __future__ import annotations

import json

import jsonschema
import pytest

from molora_runtime.engine.structured import ResponseFormat
from molora_runtime.engine.types import GenerationRequest, SamplingParams
from molora_runtime.errors import InvalidRequestError
from tests.runtime.rt_util import build_engine, run_to_completion

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["ok", "color", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def chat_engine(tiny_chat_model):
    return lambda: build_engine(tiny_chat_model)


def _req(rid: str, fmt: ResponseFormat, **sampling) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid,
        messages=[{"role": "user", "content": "Give me JSON."}],
        sampling=SamplingParams(max_tokens=120, **sampling),
        response_format=fmt,
    )


@pytest.mark.parametrize(
    "sampling",
    [{}, {"temperature": 1.0, "seed": 3}, {"temperature": 0.8, "seed": 9, "presence_penalty": 1.0}],
)
def test_json_schema_outputs_validate(chat_engine, sampling) -> None:
    fmt = ResponseFormat(type="json_schema", json_schema=SCHEMA)
    reqs = [
        _req(f"r{i}", fmt, **{**sampling, "seed": sampling.get("seed", 0) + i}) for i in range(3)
    ]
    got = run_to_completion(chat_engine(), reqs)
    for res in got.values():
        assert res["finish_reason"] == "stop", res
        jsonschema.validate(json.loads(res["text"]), SCHEMA)


def test_json_object_is_valid_json(chat_engine) -> None:
    fmt = ResponseFormat(type="json_object")
    got = run_to_completion(chat_engine(), [_req("j", fmt, temperature=0.7, seed=1)])["j"]
    if got["finish_reason"] == "stop":
        assert isinstance(json.loads(got["text"]), dict)
    else:  # out of tokens: still a valid JSON prefix, starting an object
        assert got["text"].lstrip().startswith("{")


def test_invalid_schema_is_refused_before_queueing(chat_engine) -> None:
    engine = chat_engine()
    bad = ResponseFormat(type="json_schema", json_schema={"type": "frobnicate"})
    with pytest.raises(InvalidRequestError, match="invalid response_format schema"):
        engine.add_request(_req("x", bad))
    assert not engine.has_work()


def test_huge_schema_is_refused_within_the_compile_budget(chat_engine) -> None:
    """A 640 KB enum would take xgrammar tens of seconds: it is refused before compiling, and a
    json_object request of another tenant is served right after."""
    engine = chat_engine()
    enum = [f"value-{i:06d}" for i in range(40_000)]
    bomb = ResponseFormat(type="json_schema", json_schema={"enum": enum})
    with pytest.raises(InvalidRequestError, match="over the 65536 this server compiles"):
        engine.add_request(_req("bomb", bomb))
    assert not engine.has_work()
    got = run_to_completion(engine, [_req("j", ResponseFormat(type="json_object"))])["j"]
    assert got["error"] is None and got["text"].lstrip().startswith("{")
