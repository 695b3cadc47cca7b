"""RouteSpec parsing and validation."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from molora_runtime.routes import (
    LearnedRoute,
    MixRoute,
    RouteSpec,
    SingleRoute,
    VocabRoute,
    parse_mix,
)

ROUTE = TypeAdapter(RouteSpec)


def test_parse_mix_accepts_plus_and_comma() -> None:
    assert parse_mix("math:0.7+style:0.3") == MixRoute(weights={"math": 0.7, "style": 0.3})
    assert parse_mix("math:0.7,style:0.3").weights == {"math": 0.7, "style": 0.3}


@pytest.mark.parametrize("text", ["math", "math:x", "math:0.5+math:0.5", "Bad:1"])
def test_parse_mix_rejects_bad_terms(text: str) -> None:
    with pytest.raises(ValueError):
        parse_mix(text)


def test_discriminated_union_round_trip() -> None:
    for route in (
        SingleRoute(adapter="math@v2"),
        MixRoute(weights={"a": 0.5, "b": 0.5}),
        VocabRoute(ranges=[{"start": 0, "end": 100, "adapter": "text"}], default="image"),
        LearnedRoute(composition="reasoning", top_k=2),
    ):
        assert ROUTE.validate_python(route.model_dump()) == route


@pytest.mark.parametrize(
    "payload",
    [
        {"kind": "single", "adapter": "../x"},
        {"kind": "single", "adapter": ""},
        {"kind": "mix", "weights": {}},
        {"kind": "vocab", "ranges": [{"start": 5, "end": 5, "adapter": "a"}]},
        {
            "kind": "vocab",
            "ranges": [
                {"start": 0, "end": 10, "adapter": "a"},
                {"start": 5, "end": 20, "adapter": "b"},
            ],
        },
        {"kind": "learned", "composition": "c", "top_k": 0},
        {"kind": "nope"},
    ],
)
def test_invalid_routes_are_refused(payload: dict) -> None:
    with pytest.raises(ValidationError):
        ROUTE.validate_python(payload)
