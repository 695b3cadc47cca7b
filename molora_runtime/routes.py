"""RouteSpec: the only routing vocabulary the engine understands.

A request names how each of its tokens picks adapters:
- `base`: no adapter;
- `single`: one adapter for every token;
- `mix`: a static weighted sum of adapters for every token;
- `vocab`: a token's own input id picks the adapter (id ranges, e.g. text vs image tokens);
- `learned`: a composition's per-layer top-k gate picks adapters from the hidden state (MoLoRA).
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from adapter_store.errors import InvalidInputError
from adapter_store.names import parse_ref


def check_ref(ref: str) -> str:
    """Validate an adapter/composition reference `name` or `name@version` (the store's rules)."""
    try:
        parse_ref(ref)
    except InvalidInputError as exc:
        raise ValueError(str(exc)) from None
    return ref


class _Route(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

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
    weights: dict[str, float]

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
    model_config = ConfigDict(extra="forbid", frozen=True)
    start: int = Field(ge=0)
    end: int = Field(gt=0, description="exclusive")
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
    ranges: list[VocabRange]
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
    temperature: float | None = Field(None, gt=0, description="override the gate temperature")

    _check = field_validator("composition")(classmethod(lambda cls, v: check_ref(v)))


RouteSpec = Annotated[
    BaseRoute | SingleRoute | MixRoute | VocabRoute | LearnedRoute, Field(discriminator="kind")
]


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
