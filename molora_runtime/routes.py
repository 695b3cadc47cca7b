"""RouteSpec: the only routing vocabulary the engine understands.

A request names how each of its tokens picks adapters:
- `base`: no adapter;
- `single`: one adapter for every token;
- `mix`: a static weighted sum of adapters for every token;
- `vocab`: a token's own input id picks the adapter (id ranges, e.g. text vs image tokens);
- `learned`: a composition's per-layer top-k gate picks adapters from the hidden state (MoLoRA).

Bounds live here so the HTTP API and the offline `LLM` API refuse the same inputs. Static ones
(in the JSON schema): mix weights finite with |w| <= MAX_MIX_WEIGHT, vocab ids below
MAX_VOCAB_ID, gate temperature in [MIN_GATE_TEMPERATURE, MAX_GATE_TEMPERATURE], top_k in
[1, 16]. Served ones (`RouteLimits`, configured per engine, checked by `check_route_limits`
against the model): |w| <= max_abs_mix_weight, vocab ranges inside [0, vocab_size).
Negative mix weights are a feature (task negation: subtract an adapter's behaviour), bounded
like positive ones.

Each kind answers for itself (its refs, width, limits, prefix-cache key text, routing-table rows,
metric label), so the engine and the router call methods instead of branching on the kind: a new
kind touches this file only, plus `RouteTable` and its kernel path if its tokens pick adapters in
a new way.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, ClassVar, Literal, Protocol, Self, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from adapter_store.composition_spec import (
    MAX_GATE_TEMPERATURE,
    MIN_GATE_TEMPERATURE,
    CompositionSpec,
)
from adapter_store.errors import InvalidInputError
from adapter_store.names import parse_ref

MAX_MIX_WEIGHT = 100.0
MAX_VOCAB_ID = 2**31 - 1
MAX_VOCAB_RANGES = 256
MAX_MIX_ADAPTERS = 64

MixWeight: TypeAlias = Annotated[
    float, Field(ge=-MAX_MIX_WEIGHT, le=MAX_MIX_WEIGHT, allow_inf_nan=False)
]
VocabId: TypeAlias = Annotated[int, Field(ge=0, le=MAX_VOCAB_ID)]


class RouteLimits(BaseModel):
    """Bounds a server or offline engine enforces on top of the static ones (configurable)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_abs_mix_weight: float = Field(
        2.0,
        gt=0,
        le=MAX_MIX_WEIGHT,
        description="|weight| bound of each adapter in a static mix (negatives allowed)",
    )


def check_ref(ref: str) -> str:
    """Validate an adapter/composition reference `name` or `name@version` (the store's rules)."""
    try:
        parse_ref(ref)
    except InvalidInputError as exc:
        raise ValueError(str(exc)) from None
    return ref


class RouteTable(Protocol):
    """One request's rows of a step's per-token routing table, as its route fills them.

    The engine owns the rows (tensors of slots, weights and gate indices) and the hot-set that
    turns refs into slots; a route only says which of the three ways its tokens pick adapters.
    """

    def every_token(self, columns: Sequence[tuple[str, float]]) -> None:
        """Every token weighs these (adapter ref, weight) columns, in order."""

    def by_token_id(self, ranges: Sequence[VocabRange], default: str | None) -> None:
        """A token's input id picks its adapter (weight 1) from `ranges`, else `default`; an
        adapter of None is the base model (weight 0)."""

    def by_gate(self, composition: str, top_k: int | None, temperature: float | None) -> None:
        """The composition's learned gate picks each token's adapters; a None override keeps
        the composition's configured top-k or temperature."""


class RefKeys(Protocol):
    """The prefix-cache key text of the files behind a ref (the engine reads and hashes them)."""

    def adapter_key(self, ref: str | None) -> str:
        """An adapter's key text (its ref and files' digest); `base` for None."""

    def composition_key(self, ref: str) -> tuple[str, CompositionSpec]:
        """A composition's key text (its ref and files' digest) and its config."""


class _Route(BaseModel):
    # strict: JSON types are never coerced ("0.5" is not a weight)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    # Runs the base model alone: a batch of such routes needs no LoRA context at all.
    is_base: ClassVar[bool] = False
    # A composition's gate picks adapters from the hidden state (records layers, has a summary).
    is_learned: ClassVar[bool] = False

    def adapters(self) -> list[str]:
        """Adapters this route may touch (compositions report their experts separately)."""
        return []

    def refs(self) -> list[str]:
        """The adapter or composition refs this route names: a learned route names its
        composition, which is what its client asked for, not the experts its gate picks."""
        return self.adapters()

    @property
    def gate_composition(self) -> str | None:
        """The composition whose gate routes the tokens; None for a static route."""
        return None

    @property
    def name(self) -> str | None:
        """The one adapter or composition ref the route stands for; None when it stands for
        none (base) or several (mix, vocab), so a per-name count stays bounded."""
        return None

    @property
    def label(self) -> str:
        """A metric label bounded by the catalog: the adapter or composition name (no
        version), else the kind; never a string the caller built (a mix, a vocab table)."""
        return (self.name or self.kind).partition("@")[0]

    def with_refs(self, refs: Mapping[str, str]) -> Self:
        """A copy naming `refs[r]` for each adapter or composition ref `r` it names (e.g. pinned
        to a version); refs missing from `refs` stay."""
        return self

    def width(self, composition: CompositionSpec | None = None) -> int:
        """Adapters one token weighs at once (columns of the routing table it fills);
        `composition` supplies a learned route's default top-k."""
        return 0

    def check_width(self, width: int, composition: CompositionSpec | None = None) -> None:
        """Refuse a route that weighs more adapters per token than the table is `width` wide.
        Raises ValueError naming the bound."""
        k = self.width(composition)
        if k > width:
            raise ValueError(
                f"{self._width_term(k)} exceeds hot_set.max_adapters_per_token={width}"
            )

    def _width_term(self, k: int) -> str:
        """How the width error names a width of `k` for this kind."""
        return f"{k} adapters per token"

    def check_limits(self, limits: RouteLimits, vocab_size: int) -> None:
        """Refuse a route the engine would serve badly (see `check_route_limits`)."""

    def key_text(self, keys: RefKeys) -> str:
        """This route's part of the prefix-cache identity text (after model and kind): every
        weight its tokens' KV depends on."""
        return ""

    def fill(self, table: RouteTable) -> None:
        """Fill this route's rows of a step's routing table (the base model fills nothing)."""

    def adapts_ids(self, start: int, end: int) -> bool:
        """Whether the route's id table sends some token id in [start, end) to an adapter;
        only a vocab route picks adapters by id."""
        return False


class BaseRoute(_Route):
    kind: Literal["base"] = "base"

    is_base: ClassVar[bool] = True


class SingleRoute(_Route):
    kind: Literal["single"] = "single"
    adapter: str

    _check = field_validator("adapter")(classmethod(lambda cls, v: check_ref(v)))

    def adapters(self) -> list[str]:
        return [self.adapter]

    @property
    def name(self) -> str | None:
        return self.adapter

    def with_refs(self, refs: Mapping[str, str]) -> Self:
        return self.model_copy(update={"adapter": refs.get(self.adapter, self.adapter)})

    def width(self, composition: CompositionSpec | None = None) -> int:
        return 1

    def key_text(self, keys: RefKeys) -> str:
        return f";adapter={keys.adapter_key(self.adapter)}"

    def fill(self, table: RouteTable) -> None:
        table.every_token([(self.adapter, 1.0)])


class MixRoute(_Route):
    kind: Literal["mix"] = "mix"
    weights: dict[str, MixWeight] = Field(max_length=MAX_MIX_ADAPTERS)

    @field_validator("weights")
    @classmethod
    def _valid(cls, value: dict[str, float]) -> dict[str, float]:
        if not value:
            raise ValueError("a mix needs at least one adapter")
        for name, weight in value.items():
            check_ref(name)
            if not math.isfinite(weight):
                raise ValueError(f"mix weight of {name!r} is not finite")
        return value

    def adapters(self) -> list[str]:
        return list(self.weights)

    def with_refs(self, refs: Mapping[str, str]) -> Self:
        """Raises ValueError when two of its adapters become one ref (their weights would merge)."""
        weights = {refs.get(n, n): w for n, w in self.weights.items()}
        if len(weights) < len(self.weights):
            raise ValueError("a mix names one adapter version twice")
        return self.model_copy(update={"weights": weights})

    def width(self, composition: CompositionSpec | None = None) -> int:
        return len(self.weights)

    def _width_term(self, k: int) -> str:
        return f"a mix of {k} adapters"

    def check_limits(self, limits: RouteLimits, vocab_size: int) -> None:
        bound = limits.max_abs_mix_weight
        for name, weight in self.weights.items():
            if not abs(weight) <= bound:
                raise ValueError(
                    f"mix weight {weight} of {name!r} is outside [-{bound}, {bound}] "
                    "(routes.max_abs_mix_weight)"
                )

    def key_text(self, keys: RefKeys) -> str:
        mix = ";".join(f"{keys.adapter_key(n)}*{w!r}" for n, w in self.weights.items())
        return f";mix={mix}"

    def fill(self, table: RouteTable) -> None:
        table.every_token(list(self.weights.items()))


class VocabRange(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    start: VocabId
    end: VocabId = Field(description="exclusive")
    adapter: str | None = Field(description="None routes the range to the base model")

    @model_validator(mode="after")
    def _ordered(self) -> VocabRange:
        if self.end <= self.start:
            raise ValueError(f"vocab range [{self.start}, {self.end}) is empty")
        if self.adapter is not None:
            check_ref(self.adapter)
        return self


class VocabRoute(_Route):
    kind: Literal["vocab"] = "vocab"
    ranges: list[VocabRange] = Field(max_length=MAX_VOCAB_RANGES)
    default: str | None = Field(
        None, description="adapter for ids outside every range; None = base"
    )

    @model_validator(mode="after")
    def _disjoint(self) -> VocabRoute:
        if not self.ranges:
            raise ValueError("a vocab route needs at least one range")
        spans = sorted((r.start, r.end) for r in self.ranges)
        for (s0, e0), (s1, _) in itertools.pairwise(spans):
            if s1 < e0:
                raise ValueError(f"vocab ranges overlap: [{s0}, {e0}) and one starting at {s1}")
        if self.default is not None:
            check_ref(self.default)
        return self

    def adapters(self) -> list[str]:
        names = [r.adapter for r in self.ranges if r.adapter] + (
            [self.default] if self.default else []
        )
        return list(dict.fromkeys(names))

    def with_refs(self, refs: Mapping[str, str]) -> Self:
        ranges = [
            r.model_copy(update={"adapter": refs.get(r.adapter, r.adapter)}) if r.adapter else r
            for r in self.ranges
        ]
        default = refs.get(self.default, self.default) if self.default else None
        return self.model_copy(update={"ranges": ranges, "default": default})

    def width(self, composition: CompositionSpec | None = None) -> int:
        return 1

    def check_limits(self, limits: RouteLimits, vocab_size: int) -> None:
        for r in self.ranges:
            if not 0 <= r.start < r.end <= vocab_size:
                raise ValueError(
                    f"vocab range [{r.start}, {r.end}) is outside this model's vocabulary "
                    f"[0, {vocab_size})"
                )

    def key_text(self, keys: RefKeys) -> str:
        table = ";".join(f"[{r.start},{r.end})->{keys.adapter_key(r.adapter)}" for r in self.ranges)
        return f";vocab={table};default={keys.adapter_key(self.default)}"

    def fill(self, table: RouteTable) -> None:
        table.by_token_id(self.ranges, self.default)

    def adapts_ids(self, start: int, end: int) -> bool:
        return any(r.adapter and r.start < end and start < r.end for r in self.ranges)


class LearnedRoute(_Route):
    kind: Literal["learned"] = "learned"
    composition: str
    top_k: int | None = Field(None, ge=1, le=16, description="override the composition's top-k")
    temperature: float | None = Field(
        None,
        ge=MIN_GATE_TEMPERATURE,
        le=MAX_GATE_TEMPERATURE,
        description="override the gate temperature",
    )

    is_learned: ClassVar[bool] = True

    _check = field_validator("composition")(classmethod(lambda cls, v: check_ref(v)))

    def refs(self) -> list[str]:
        return [self.composition]

    @property
    def gate_composition(self) -> str | None:
        return self.composition

    @property
    def name(self) -> str | None:
        return self.composition

    def with_refs(self, refs: Mapping[str, str]) -> Self:
        return self.model_copy(update={"composition": refs.get(self.composition, self.composition)})

    def width(self, composition: CompositionSpec | None = None) -> int:
        return self.top_k or (composition.top_k if composition is not None else None) or 1

    def _width_term(self, k: int) -> str:
        return f"top_k={k}"

    def check_width(self, width: int, composition: CompositionSpec | None = None) -> None:
        """Also refuses a top-k override past the composition's experts."""
        if composition is not None and self.top_k is not None:
            experts = len(composition.adapters)
            if self.top_k > experts:
                raise ValueError(
                    f"top_k={self.top_k} exceeds the {experts} experts of "
                    f"composition {self.composition!r}"
                )
        super().check_width(width, composition)

    def key_text(self, keys: RefKeys) -> str:
        composition, cfg = keys.composition_key(self.composition)
        top_k = self.top_k if self.top_k is not None else cfg.top_k
        temp = self.temperature if self.temperature is not None else cfg.temperature
        experts = ";".join(keys.adapter_key(a) for a in cfg.adapters)
        return f";composition={composition};experts={experts};top_k={top_k};temperature={temp!r}"

    def fill(self, table: RouteTable) -> None:
        table.by_gate(self.composition, self.top_k, self.temperature)


RouteSpec = Annotated[
    BaseRoute | SingleRoute | MixRoute | VocabRoute | LearnedRoute, Field(discriminator="kind")
]


def check_route_limits(route: RouteSpec, limits: RouteLimits, vocab_size: int) -> None:
    """Refuse a route the engine would serve badly: weights past the served bound, vocab
    ranges outside this model's vocabulary. Raises ValueError naming the bound."""
    route.check_limits(limits, vocab_size)


def parse_mix(text: str) -> MixRoute:
    """Parse a static mix written as `a:0.7+b:0.3` (or `a:0.7,b:0.3`)."""
    weights: dict[str, float] = {}
    for part in re.split(r"[+,]", text):
        name, sep, weight = part.strip().partition(":")
        if not sep:
            raise ValueError(f"mix term {part!r} must be 'adapter:weight'")
        try:
            value = float(weight)
        except ValueError:
            raise ValueError(f"mix weight {weight!r} of {name!r} is not a number") from None
        if name in weights:
            raise ValueError(f"adapter {name!r} appears twice in the mix")
        weights[name] = value
    return MixRoute(weights=weights)
