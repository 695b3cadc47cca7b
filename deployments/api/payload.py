"""The base of every request payload: unknown keys are refused and JSON types are not coerced,
so a misspelt parameter or a `"5"` for 5 is a 400 naming it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Payload(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
