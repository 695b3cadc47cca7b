"""OpenAI tool-calling payloads: tool definitions, `tool_choice`, and calls in chat history.

`tools` are rendered by the model's chat template; `tool_choice` "required" or a named function
becomes a tool-call grammar for the engine (a valid call is guaranteed), "auto" lets the model
choose and the API parses its output (deployments/api/tool_calls.py), "none" calls nothing.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from deployments.api.payload import Payload

MAX_TOOLS = 128  # OpenAI's bound
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's function names
MAX_ARGUMENTS_CHARS = 256 * 1024
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


class FunctionDefinition(Payload):
    name: str = Field(pattern=FUNCTION_NAME, description="a-z, A-Z, 0-9, _ and -; at most 64")
    description: str | None = Field(None, max_length=16384)
    parameters: dict[str, Any] | None = Field(
        None, description="JSON Schema of the arguments (an object); absent = no arguments"
    )
    strict: bool | None = Field(None, description="accepted; forced calls always follow it")

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("parameters must be a JSON Schema of type 'object' (the arguments)")
        return value


class ToolDefinition(Payload):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Payload):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(Payload):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(Payload):
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str = Field(max_length=MAX_ARGUMENTS_CHARS, description="JSON text (an object)")


class ToolCallIn(Payload):
    """A call an assistant message made earlier in the conversation."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: ToolCallFunction

    def for_template(self) -> dict[str, Any]:
        """Arguments as an object where they are JSON, as templates write `arguments | tojson`."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        if not isinstance(arguments, dict):
            arguments = self.function.arguments
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.function.name, "arguments": arguments},
        }


ToolCallsIn = Annotated[list[ToolCallIn], Field(min_length=1, max_length=MAX_TOOLS)]


class ToolFields(Payload):
    """The chat request's tool fields and what they ask of the engine."""

    tools: list[ToolDefinition] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = Field(
        None, description="none, auto (default with tools), required, or a named function"
    )
    parallel_tool_calls: bool = Field(
        True, description="more than one call per turn (required / auto); a named function: one"
    )

    @model_validator(mode="after")
    def _consistent(self) -> ToolFields:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        return self

    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """What the request lets the model do (no tools: none)."""
        if not self.tools:
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tool definitions as the chat template gets them (exclude unset fields)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_call_format(self) -> dict[str, Any] | None:
        """The engine's tool-call grammar for "required" and a named function, else None."""
        mode = self.tool_mode()
        if mode not in ("required", "named"):
            return None
        assert self.tools is not None
        chosen = self.tool_choice.function.name if mode == "named" else None  # type: ignore[union-attr]
        functions = [
            {"name": t.function.name, "parameters": t.function.parameters or NO_ARGUMENTS}
            for t in self.tools
            if chosen is None or t.function.name == chosen
        ]
        parallel = mode == "required" and self.parallel_tool_calls
        return {"type": "tool_calls", "tool_calls": {"functions": functions, "parallel": parallel}}
