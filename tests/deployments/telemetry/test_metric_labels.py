"""The router's metric labels are bounded by the catalog: `route_label` and `metric_label`."""

from __future__ import annotations

from deployments.access.tenancy import metric_label, private_names
from deployments.api.tracking import route_label
from deployments.catalog.model_names import AdapterEntry, Catalog, CompositionEntry, Resolved
from molora_runtime.routes import (
    BaseRoute,
    LearnedRoute,
    SingleRoute,
    VocabRange,
    VocabRoute,
    parse_mix,
)

CATALOG = Catalog(
    adapters={
        "math": AdapterEntry("math", ("v1",), "v1"),
        "code": AdapterEntry("code", ("v1",), "v1"),
        "secret": AdapterEntry("secret", ("v1",), "v1", tenant="acme"),
    },
    compositions={"duo": CompositionEntry("duo", ("math", "code"), ("v1",), "v1")},
)


def test_a_thousand_mixes_are_one_label() -> None:
    labels = set()
    for i in range(1000):
        w = (i + 1) / 1002
        mix = parse_mix(f"math@v1:{w:.6f}+code@v1:{1 - w:.6f}")
        labels.add(route_label(Resolved(mix, ("math", "code"))))
    assert labels == {"mix"}


def test_catalog_names_kinds_and_aliases() -> None:
    assert route_label(Resolved(BaseRoute(), ())) == "base"
    assert route_label(Resolved(SingleRoute(adapter="math@v1"), ("math",))) == "math"
    learned = LearnedRoute(composition="duo@v1")
    assert route_label(Resolved(learned, ("math", "code", "composition:duo"))) == "duo"
    vocab = VocabRoute(ranges=[VocabRange(start=0, end=10, adapter="math@v1")], default="code@v1")
    assert route_label(Resolved(vocab, ("math", "code"))) == "vocab"
    # a configured route (operator-named) keeps its name
    assert route_label(Resolved(vocab, ("math", "code")), "math-then-code") == "math-then-code"


def test_private_names_are_hidden() -> None:
    single = Resolved(SingleRoute(adapter="secret@v1"), ("secret",))
    assert metric_label(route_label(single), single, CATALOG) == "private"
    mix = Resolved(parse_mix("secret@v1:0.5+math@v1:0.5"), ("secret", "math"))
    assert metric_label(route_label(mix), mix, CATALOG) == "private"
    assert private_names(CATALOG) == frozenset({"secret"})
