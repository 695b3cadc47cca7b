"""Parse a request body as JSON the way an attacker cannot abuse: bounded nesting, valid Unicode.

pydantic's parser refuses invalid UTF-8, lone surrogates and runaway nesting without recursing in
Python; the configured depth limit and the path of a bad string are added here, so every refusal
is a `BodyError` (a 400) that says why and where, before any model sees the data.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import JsonValue, TypeAdapter, ValidationError

DEFAULT_MAX_DEPTH = 32
_JSON: TypeAdapter[JsonValue] = TypeAdapter(JsonValue)


class BodyError(ValueError):
    """The body is not acceptable JSON; the message says why (and where)."""


def _path(parts: list[str | int]) -> str:
    return ".".join(str(p) for p in parts) or "<body>"


def check_depth(data: Any, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
    """Refuse nesting deeper than `max_depth`, naming where it happens."""
    stack: list[tuple[Any, int, list[str | int]]] = [(data, 0, [])]
    while stack:
        value, depth, path = stack.pop()
        if not isinstance(value, dict | list):
            continue
        if depth >= max_depth:
            raise BodyError(f"JSON nesting is deeper than {max_depth} levels at {_path(path)}")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        stack.extend((item, depth + 1, [*path, key]) for key, item in items)


def _unicode_error(raw: bytes, reason: str) -> BodyError:
    """Name the string holding a lone surrogate (the standard parser accepts it, so it can find it)."""
    try:
        stack: list[tuple[Any, list[str | int]]] = [(json.loads(raw), [])]
    except (ValueError, RecursionError):
        return BodyError(f"invalid Unicode: {reason}")
    while stack:
        value, path = stack.pop()
        texts = (
            [value] if isinstance(value, str) else list(value) if isinstance(value, dict) else []
        )
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                return BodyError(
                    f"invalid Unicode at {_path(path)}: {exc.reason} (a lone surrogate?)"
                )
        if isinstance(value, dict | list):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack.extend((item, [*path, key]) for key, item in items)
    return BodyError(f"invalid Unicode: {reason}")


def parse_body(raw: bytes, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """The JSON value of `raw`, parsed by pydantic and checked by `check_depth`; raises BodyError."""
    try:
        data = _JSON.validate_json(raw)
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"].removeprefix("Invalid JSON: ")
        if "recursion limit" in reason:
            raise BodyError(f"JSON nesting is deeper than {max_depth} levels") from None
        if "surrogate" in reason or "hex escape" in reason:
            raise _unicode_error(raw, reason) from None
        raise BodyError(f"request body is not valid JSON: {reason}") from None
    check_depth(data, max_depth)
    return data
