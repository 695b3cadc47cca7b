"""Request-body schemas for /openapi.json without letting FastAPI parse the body.

The handlers take the raw `Request` (the ingress parses with its own limits: size, nesting,
Unicode, strict types), so FastAPI knows no body model. Each route gets `openapi_extra` with
its pydantic model's JSON schema, inlined (no `$defs`: an operation's schema cannot point into
a document-level `$defs`), and the OpenAI error shape as its 4xx/5xx response.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from deployments.protocol.openai_error import ErrorResponse


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s validation JSON schema with every local `$ref` replaced by its definition."""
    schema = model.model_json_schema(mode="validation")
    defs = schema.pop("$defs", {})

    def resolve(node: Any, seen: tuple[str, ...] = ()) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                name = ref.removeprefix("#/$defs/")
                if name in seen:
                    raise ValueError(f"recursive schema {name!r} cannot be inlined")
                rest = {k: v for k, v in node.items() if k != "$ref"}
                return {**resolve(defs[name], (*seen, name)), **resolve(rest, seen)}
            return {k: resolve(v, seen) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v, seen) for v in node]
        return node

    return resolve(schema)


def body_docs(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a POST route whose body is `model` (JSON)."""
    error = {"content": {"application/json": {"schema": inline_schema(ErrorResponse)}}}
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": inline_schema(model)}},
        },
        "responses": {
            "400": {"description": "invalid request (OpenAI error shape)", **error},
            "404": {"description": "unknown model or adapter", **error},
            "429": {"description": "overloaded; retry after Retry-After", **error},
            "503": {"description": "no healthy replica or the store is down", **error},
        },
    }
