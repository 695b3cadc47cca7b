"""Request bounds the engine enforces for every caller (HTTP and offline alike): each refusal is
an InvalidRequestError naming the bound, raised before anything is queued."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from molora_runtime.engine.types import SamplingParams
from molora_runtime.errors import InvalidRequestError
from molora_runtime.routes import LearnedRoute, MixRoute, VocabRoute
from tests.molora_runtime.rt_util import request


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory(max_model_len=64, routes={"max_abs_mix_weight": 1.5})


@pytest.mark.parametrize(
    ("route", "fragment"),
    [
        (MixRoute(weights={"a": 1.6}), "outside [-1.5, 1.5]"),
        (MixRoute(weights={"a": 0.5, "b": -1.51}), "outside [-1.5, 1.5]"),
        (VocabRoute(ranges=[{"start": 0, "end": 257, "adapter": "a"}]), "[0, 256)"),
        (VocabRoute(ranges=[{"start": 300, "end": 400, "adapter": "a"}]), "[0, 256)"),
        (LearnedRoute(composition="moe", top_k=4), "exceeds the 3 experts"),
    ],
)
def test_route_limits(engine, route, fragment) -> None:
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(request("x", [1, 2, 3], route, 4))
    assert fragment in str(info.value)
    assert not engine.has_work()


def test_negative_weights_within_the_bound_are_served(engine) -> None:
    engine.validate_request(request("x", [1, 2], MixRoute(weights={"a": 1.0, "b": -0.5}), 4))


def test_stop_token_ids_inside_the_vocabulary(engine) -> None:
    sampling = SamplingParams(max_tokens=4, stop_token_ids=[3, 256])
    with pytest.raises(InvalidRequestError, match=r"stop_token_ids \[256\].*\[0, 256\)"):
        engine.add_request(request("x", [1, 2], "a", sampling=sampling))


def test_context_overflow_names_both_numbers_unless_clamping(engine) -> None:
    strict = SamplingParams(max_tokens=10, clamp_to_context=False)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(request("x", list(range(60)), "a", sampling=strict))
    message = str(info.value)
    assert (
        "64 tokens" in message and "60 in the prompt" in message and "10 in max_tokens" in message
    )
    engine.validate_request(request("x", list(range(54)), "a", sampling=strict))  # fits exactly
    engine.validate_request(request("x", list(range(60)), "a", 10))  # clamped by default


@pytest.mark.parametrize(
    "kwargs",
    [
        {"seed": 2**64},
        {"seed": -1},
        {"temperature": float("nan")},
        {"top_k": 2**40},
        {"max_tokens": 2**40},
        {"stop_token_ids": [-1]},
    ],
)
def test_sampling_bounds(kwargs) -> None:
    with pytest.raises(ValidationError):
        SamplingParams(**kwargs)


def test_extreme_seeds_sample(tiny_engine_factory) -> None:
    from tests.molora_runtime.rt_util import run_to_completion

    engine = tiny_engine_factory()
    reqs = [
        request(
            f"s{seed}",
            [1, 2, 3],
            "a",
            sampling=SamplingParams(max_tokens=3, temperature=1, seed=seed),
        )
        for seed in (0, 2**63, 2**64 - 1)
    ]
    results = run_to_completion(engine, reqs)
    assert all(r["finish_reason"] == "length" and len(r["tokens"]) == 3 for r in results.values())


def test_invalid_unicode_prompt_is_a_request_error(tiny_chat_model) -> None:
    from tests.molora_runtime.rt_util import build_engine

    engine = build_engine(tiny_chat_model)
    for kwargs in ({"prompt": "a\ud800b"}, {"messages": [{"role": "user", "content": "\udfff"}]}):
        with pytest.raises(InvalidRequestError, match="cannot"):
            engine.validate_request(request("x", None, None, 4, **kwargs))
