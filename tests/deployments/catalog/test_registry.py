"""Model-name resolution and OpenAI payload validation (no Ray, no engine)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.api.http_errors import validation_message
from deployments.api.request_models import ChatCompletionRequest, CompletionRequest
from deployments.catalog.model_names import BadModelName, ModelNotFound, Resolver
from deployments.protocol.openai_error import error_payload
from molora_runtime.routes import MixRoute, VocabRange, VocabRoute
from tests.deployments.serve_helpers import name_resolver


def resolver(**expose) -> Resolver:
    versions = {"math": ("v1", "v2"), "code": ("v1",), "poem": ("v1",)}
    return name_resolver(versions, "base-model", **expose)


def test_base_adapter_version_composition_and_mix():
    r = resolver()
    assert r.resolve("base-model").kind == "base"
    single = r.resolve("math@v1")
    assert single.kind == "single" and single.route.adapter == "math@v1"
    assert single.placement_adapters == ("math",)
    learned = r.resolve("mathcode")
    assert learned.kind == "learned"
    assert set(learned.placement_adapters) == {"math", "code", "composition:mathcode"}
    mix = r.resolve("math:0.7+code:0.3")
    # Bare names are pinned to the latest live version at admission.
    assert mix.kind == "mix" and mix.route.weights == {"math@v2": 0.7, "code@v1": 0.3}
    assert learned.route.composition == "mathcode@v1"


@pytest.mark.parametrize(
    ("model", "error"),
    [
        ("nope", ModelNotFound),
        ("math@v9", ModelNotFound),
        ("math:0.5+ghost:0.5", ModelNotFound),
        ("math:x", BadModelName),
        ("math:0.5+math:0.5", BadModelName),
        ("Bad Name:1", BadModelName),
    ],
)
def test_bad_names(model, error):
    with pytest.raises(error):
        resolver().resolve(model)


def test_explicit_route_refs_are_checked():
    r = resolver()
    route = VocabRoute(ranges=[VocabRange(start=0, end=100, adapter="math")], default="code")
    assert set(r.resolve("base-model", route).placement_adapters) == {"math", "code"}
    with pytest.raises(ModelNotFound):
        r.resolve("base-model", MixRoute(weights={"ghost": 1.0}))


def test_expose_filters_and_named_routes():
    r = resolver(
        adapters=["math"],
        compositions=[],
        routes={"textimg": {"kind": "single", "adapter": "math"}},
    )
    assert set(r.adapters) == {"math"}
    assert r.resolve("textimg").kind == "single"
    with pytest.raises(ModelNotFound):
        r.resolve("code")
    with pytest.raises(ModelNotFound):
        r.resolve("mathcode")
    with pytest.raises(BadModelName):
        resolver(mixes=False).resolve("math:1")


def test_requests_reject_unknown_and_unsupported_parameters():
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temprature": 1}
        )
    message, param = validation_message(info.value)
    assert param == "temprature" and "unknown parameter" in message
    for bad in ({"n": 17}, {"presence_penalty": 3.0}, {"temperature": -1}, {"max_tokens": 0}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"model": "m", "prompt": "x", **bad})
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"]})
    ok = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3], "stop": "x"})
    assert ok.stop_list() == ["x"]


def test_chat_content_parts_and_molora_route():
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            "molora": {
                "route": {"kind": "mix", "weights": {"math": 1.0}},
                "return_attribution": True,
            },
        }
    )
    assert req.engine_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]
    assert req.molora.route.kind == "mix"


def test_error_shape():
    body = error_payload(404, "model 'x' does not exist", "model")
    assert body == {
        "error": {
            "message": "model 'x' does not exist",
            "type": "not_found_error",
            "param": "model",
            "code": 404,
        }
    }
