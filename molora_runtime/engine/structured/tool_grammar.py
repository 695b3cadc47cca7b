"""The grammar of forced tool calls: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks.

`tool_choice: "required"` or a named function is guaranteed by grammar, as vLLM does: one block (or,
with parallel calls, one or more separated by newlines), each naming one of the offered functions
with arguments matching its parameters' JSON Schema. The block form is the Hermes one, which Qwen3
uses too, so the API's parser reads forced and freely chosen calls alike.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


class ToolFunction(BaseModel):
    """One callable function: its name and the JSON Schema of its arguments."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ToolCallFormat(BaseModel):
    """Output that is only tool calls: among `functions`, one call or (`parallel`) one or more."""

    model_config = ConfigDict(extra="forbid")

    functions: list[ToolFunction] = Field(min_length=1, max_length=128)
    parallel: bool = False


def _arguments_schema(parameters: dict[str, Any]) -> dict[str, Any]:
    """Arguments are a JSON object even where the parameters schema leaves the type open."""
    if not parameters:
        return {"type": "object"}
    return parameters if "type" in parameters else {"type": "object", **parameters}


def structural_tag(fmt: ToolCallFormat) -> str:
    """xgrammar's structural tag (JSON text) for `fmt`."""
    tags = [
        {
            "type": "tag",
            # json.dumps escapes nothing in a valid name; it keeps the quoting exact.
            "begin": f'{CALL_OPEN}\n{{"name": {json.dumps(f.name)}, "arguments": ',
            "content": {
                "type": "json_schema",
                "json_schema": _arguments_schema(f.parameters),
                "max_whitespace_cnt": 1,  # no run of whitespace a sampler can loop in
            },
            "end": f"}}\n{CALL_CLOSE}",
        }
        for f in fmt.functions
    ]
    return json.dumps(
        {
            "type": "structural_tag",
            "format": {
                "type": "tags_with_separator",
                "tags": tags,
                "separator": "\n",
                "at_least_one": True,
                "stop_after_first": not fmt.parallel,
            },
        }
    )
