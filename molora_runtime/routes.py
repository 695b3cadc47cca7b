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
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Annotated, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from adapter_store.composition_spec import MAX_GATE_TEMPERATURE, MIN_GATE_TEMPERATURE
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


class _Route(BaseModel):
    # strict: JSON types are never coerced ("0.5" is not a weight)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    def adapters(self) -> list[str]:
        """Adapters this route may touch (compositions report their experts separately)."""
        return []


class BaseRoute(_Route):
    kind: Literal["base"] = "base"


class SingleRoute(_Route):
    kind: Literal["single"] = "single"
    adapter: str

    _check = field_validator("adapter")(classmethod(lambda cls, v: check_ref(v)))

    def adapters(self) -> list[str]:
        return [self.adapter]


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

    _check = field_validator("composition")(classmethod(lambda cls, v: check_ref(v)))


RouteSpec = Annotated[
    BaseRoute | SingleRoute | MixRoute | VocabRoute | LearnedRoute, Field(discriminator="kind")
]


def check_route_limits(route: RouteSpec, limits: RouteLimits, vocab_size: int) -> None:
    """Refuse a route the engine would serve badly: weights past the served bound, vocab
    ranges outside this model's vocabulary. Raises ValueError naming the bound."""
    if isinstance(route, MixRoute):
        bound = limits.max_abs_mix_weight
        for name, weight in route.weights.items():
            if not abs(weight) <= bound:
                raise ValueError(
                    f"mix weight {weight} of {name!r} is outside [-{bound}, {bound}] "
                    "(routes.max_abs_mix_weight)"
                )
    if isinstance(route, VocabRoute):
        for r in route.ranges:
            if not 0 <= r.start < r.end <= vocab_size:
                raise ValueError(
                    f"vocab range [{r.start}, {r.end}) is outside this model's vocabulary "
                    f"[0, {vocab_size})"
                )


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
