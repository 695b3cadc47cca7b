"""Parse a request body as JSON the way an attacker cannot abuse: bounded nesting, valid Unicode.

`json.loads` recurses per nesting level (a deep body is a RecursionError, i.e. a 500) and
accepts lone surrogates like "\\ud800" (which break the tokenizer later). Both become a
`BodyError` here, with the path of the offending value, before any model sees the data.
"""

from __future__ import annotations

import json
from typing import Any

DEFAULT_MAX_DEPTH = 32


class BodyError(ValueError):
    """The body is not acceptable JSON; the message says why (and where)."""


def _path(parts: list[str | int]) -> str:
    return ".".join(str(p) for p in parts) or "<body>"


def check_tree(data: Any, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
    """Refuse nesting deeper than `max_depth` and strings that are not valid UTF-8 text."""
    stack: list[tuple[Any, int, list[str | int]]] = [(data, 0, [])]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if not isinstance(value, dict | list):
            continue
        if depth >= max_depth:
            raise BodyError(f"JSON nesting is deeper than {max_depth} levels at {_path(path)}")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path)
                stack.append((item, depth + 1, [*path, key]))
        else:
            stack.extend((item, depth + 1, [*path, i]) for i, item in enumerate(value))


def _check_text(text: str, path: list[str | int]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BodyError(
            f"invalid Unicode at {_path(path)}: {exc.reason} (a lone surrogate?)"
        ) from None


def parse_body(raw: bytes, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """The JSON value of `raw`, checked by `check_tree`; raises BodyError."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BodyError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BodyError(f"JSON nesting is deeper than {max_depth} levels") from None
    check_tree(data, max_depth)
    return data
