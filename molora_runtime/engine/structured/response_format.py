"""What a request's `response_format` asks of the engine; it names the grammar's cache key, so two
requests with the same format share one compiled grammar."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from molora_runtime.engine.structured.tool_grammar import ToolCallFormat


class ResponseFormat(BaseModel):
    """What the engine needs: JSON (any object), JSON matching `json_schema`, or tool calls."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["json_object", "json_schema", "tool_calls"]
    json_schema: dict[str, Any] | None = Field(None, description="the JSON Schema (json_schema)")
    tool_calls: ToolCallFormat | None = Field(None, description="the functions (tool_calls)")

    def key(self) -> str:
        return json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"))
