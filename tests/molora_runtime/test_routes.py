"""RouteSpec parsing and validation, and what each route kind answers for itself."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from adapter_store.composition_spec import CompositionSpec
from molora_runtime.routes import (
    BaseRoute,
    LearnedRoute,
    MixRoute,
    RouteLimits,
    RouteSpec,
    SingleRoute,
    VocabRange,
    VocabRoute,
    check_route_limits,
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


# -- each kind answers for itself -------------------------------------------------------------

SINGLE = SingleRoute(adapter="math@v2")
MIX = MixRoute(weights={"math": 0.7, "style": -0.3})
VOCAB = VocabRoute(
    ranges=[
        VocabRange(start=0, end=100, adapter="text"),
        VocabRange(start=100, end=200, adapter=None),
        VocabRange(start=200, end=300, adapter="text"),
    ],
    default="image",
)
LEARNED = LearnedRoute(composition="team~reasoning@v3", top_k=2, temperature=0.5)
EVERY_KIND = (BaseRoute(), SINGLE, MIX, VOCAB, LEARNED)


def _spec(adapters: list[str], top_k: int) -> CompositionSpec:
    return CompositionSpec(
        base_model="smollm2", adapters=adapters, top_k=top_k, num_layers=2, hidden_size=8
    )


def test_base_and_learned_flags() -> None:
    assert [r.is_base for r in EVERY_KIND] == [True, False, False, False, False]
    assert [r.is_learned for r in EVERY_KIND] == [False, False, False, False, True]


def test_refs_names_labels_and_gate_composition() -> None:
    assert [r.refs() for r in EVERY_KIND] == [
        [],
        ["math@v2"],
        ["math", "style"],
        ["text", "image"],
        ["team~reasoning@v3"],  # the composition, not its experts
    ]
    assert [r.name for r in EVERY_KIND] == [None, "math@v2", None, None, "team~reasoning@v3"]
    assert [r.label for r in EVERY_KIND] == ["base", "math", "mix", "vocab", "team~reasoning"]
    assert [r.gate_composition for r in EVERY_KIND] == [None] * 4 + ["team~reasoning@v3"]


def test_with_refs_replaces_every_named_ref() -> None:
    pins = {"math@v2": "math@v3", "math": "math@v1", "text": "text@v4", "image": "image@v5"}
    assert BaseRoute().with_refs(pins) == BaseRoute()
    assert SINGLE.with_refs(pins) == SingleRoute(adapter="math@v3")
    assert MIX.with_refs(pins).weights == {"math@v1": 0.7, "style": -0.3}  # unmapped refs stay
    pinned = VOCAB.with_refs(pins)
    assert [r.adapter for r in pinned.ranges] == ["text@v4", None, "text@v4"]
    assert pinned.default == "image@v5"
    assert LEARNED.with_refs({"team~reasoning@v3": "team~reasoning@v4"}).composition == (
        "team~reasoning@v4"
    )
    assert LEARNED.with_refs({}).top_k == 2


def test_with_refs_refuses_a_mix_whose_adapters_collapse() -> None:
    with pytest.raises(ValueError, match="a mix names one adapter version twice"):
        MixRoute(weights={"a": 0.5, "a@v1": 0.5}).with_refs({"a": "a@v1"})


def test_width_is_the_table_columns_a_token_fills() -> None:
    assert [r.width() for r in EVERY_KIND] == [0, 1, 2, 1, 2]
    default_k = LearnedRoute(composition="c")
    assert default_k.width() == 1
    assert default_k.width(_spec(["a", "b", "c"], top_k=3)) == 3
    assert LEARNED.width(_spec(["a", "b", "c"], top_k=3)) == 2  # the override wins


def test_check_width_names_the_bound() -> None:
    for route in EVERY_KIND:
        route.check_width(2, _spec(["a", "b"], top_k=1))
    with pytest.raises(ValueError) as mix:
        MIX.check_width(1)
    assert str(mix.value) == "a mix of 2 adapters exceeds hot_set.max_adapters_per_token=1"
    with pytest.raises(ValueError) as learned:
        LearnedRoute(composition="c").check_width(2, _spec(["a", "b", "c"], top_k=3))
    assert str(learned.value) == "top_k=3 exceeds hot_set.max_adapters_per_token=2"
    with pytest.raises(ValueError) as experts:
        LEARNED.check_width(4, _spec(["a"], top_k=1))
    assert str(experts.value) == (
        "top_k=2 exceeds the 1 experts of composition 'team~reasoning@v3'"
    )


def test_check_limits_of_mix_weights_and_vocab_ranges() -> None:
    limits = RouteLimits(max_abs_mix_weight=0.5)
    for route in (BaseRoute(), SINGLE, LEARNED):
        route.check_limits(limits, vocab_size=10)
    with pytest.raises(ValueError) as mix:
        MIX.check_limits(limits, vocab_size=10)
    assert str(mix.value) == (
        "mix weight 0.7 of 'math' is outside [-0.5, 0.5] (routes.max_abs_mix_weight)"
    )
    VOCAB.check_limits(limits, vocab_size=300)
    with pytest.raises(ValueError) as vocab:
        check_route_limits(VOCAB, limits, vocab_size=250)
    assert str(vocab.value) == (
        "vocab range [200, 300) is outside this model's vocabulary [0, 250)"
    )


class _Keys:
    """A `RefKeys` that names each ref's files by a fixed digest."""

    def adapter_key(self, ref: str | None) -> str:
        return "base" if ref is None else f"{ref}#d"

    def composition_key(self, ref: str) -> tuple[str, CompositionSpec]:
        spec = _spec(["x", "y"], top_k=1)
        return f"{ref}#g", spec.model_copy(update={"temperature": 1.5})


def test_key_text_names_every_weight_of_the_route() -> None:
    assert [r.key_text(_Keys()) for r in EVERY_KIND] == [
        "",
        ";adapter=math@v2#d",
        ";mix=math#d*0.7;style#d*-0.3",
        ";vocab=[0,100)->text#d;[100,200)->base;[200,300)->text#d;default=image#d",
        ";composition=team~reasoning@v3#g;experts=x#d;y#d;top_k=2;temperature=0.5",
    ]
    defaults = LearnedRoute(composition="c").key_text(_Keys())
    assert defaults == ";composition=c#g;experts=x#d;y#d;top_k=1;temperature=1.5"


class _Table:
    """A `RouteTable` that records how the route filled it."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def every_token(self, columns: list[tuple[str, float]]) -> None:
        self.calls.append(("every_token", list(columns)))

    def by_token_id(self, ranges: list[VocabRange], default: str | None) -> None:
        self.calls.append(("by_token_id", [(r.start, r.end, r.adapter) for r in ranges], default))

    def by_gate(self, composition: str, top_k: int | None, temperature: float | None) -> None:
        self.calls.append(("by_gate", composition, top_k, temperature))


def test_fill_says_how_tokens_pick_adapters() -> None:
    filled = []
    for route in EVERY_KIND:
        table = _Table()
        route.fill(table)
        filled.append(table.calls)
    assert filled == [
        [],
        [("every_token", [("math@v2", 1.0)])],
        [("every_token", [("math", 0.7), ("style", -0.3)])],
        [("by_token_id", [(0, 100, "text"), (100, 200, None), (200, 300, "text")], "image")],
        [("by_gate", "team~reasoning@v3", 2, 0.5)],
    ]


def test_only_a_vocab_table_adapts_ids() -> None:
    assert VOCAB.adapts_ids(50, 60)
    assert VOCAB.adapts_ids(150, 201)  # overlaps the third range by one id
    assert not VOCAB.adapts_ids(100, 200)  # that range runs the base model
    assert not VOCAB.adapts_ids(300, 400)  # the default is not an id range
    assert [r.adapts_ids(0, 1000) for r in EVERY_KIND] == [False, False, False, True, False]
