"""Ray Serve LLM's `<base>:<adapter>` model ids beside static mixes (`a:0.7+b:0.3`): a colon
followed by a number is a weight, one adapter name after the base name is that adapter, and
what could mean both is a 400 that says why."""

from __future__ import annotations

import pytest

from deployments.catalog.model_names import BadModelName, ModelNotFound, Resolver
from molora_runtime.routes import LearnedRoute, MixRoute, SingleRoute
from tests.deployments.serve_helpers import name_resolver

NAMES = ("math", "code", "7", "hidden")


def _resolver(base: str = "tiny-base", **expose: object) -> Resolver:
    expose = {"adapters": ["math", "code", "7"], **expose}
    return name_resolver({n: ("v1", "v2") for n in NAMES}, base, **expose)


def test_base_colon_adapter_names_that_adapter() -> None:
    r = _resolver()
    for model, pinned in (("tiny-base:math", "math@v2"), ("tiny-base:math@v1", "math@v1")):
        got = r.resolve(model)
        assert isinstance(got.route, SingleRoute) and got.route.adapter == pinned
    learned = r.resolve("tiny-base:mathcode").route
    assert isinstance(learned, LearnedRoute) and learned.composition == "mathcode@v1"
    # Mixes keep their meaning, and the base model its own name.
    mix = r.resolve("math:0.7+code:0.3").route
    assert isinstance(mix, MixRoute) and mix.weights == {"math@v2": 0.7, "code@v2": 0.3}
    assert r.resolve("tiny-base").kind == "base"
    # Works with mixes disabled: it is not a mix.
    assert _resolver(mixes=False).resolve("tiny-base:code").route.adapter == "code@v2"


def test_a_number_after_the_colon_is_a_weight() -> None:
    # The served name is also an adapter's: `code:0.5` weights it, `code:math` names math.
    r = _resolver(base="code")
    mix = r.resolve("code:0.5").route
    assert isinstance(mix, MixRoute) and mix.weights == {"code@v2": 0.5}
    assert r.resolve("code:math").route.adapter == "math@v2"
    with pytest.raises(ModelNotFound):  # a weight for an adapter named like the base
        _resolver().resolve("tiny-base:0.5")


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("tiny-base:7", "ambiguous: adapter '7' on the base model, or a mix"),
        ("tiny-base:math:0.5", "write a mix without it"),
        ("tiny-base:math+code:0.5", "takes one adapter or composition"),
        ("tiny-base:math,code", "takes one adapter"),
        ("tiny-base:", "takes one adapter"),
        ("tiny-base:Math", "invalid name"),
        ("tiny-base:../x", "invalid name"),
    ],
)
def test_ambiguous_or_malformed_ids_are_400(model: str, says: str) -> None:
    with pytest.raises(BadModelName, match=says.replace("(", r"\(")):
        _resolver().resolve(model)


@pytest.mark.parametrize("model", ["tiny-base:ghost", "tiny-base:hidden", "tiny-base:math@v9"])
def test_unknown_or_hidden_adapters_are_404(model: str) -> None:
    with pytest.raises(ModelNotFound):
        _resolver().resolve(model)
