"""The OpenAI error shape for every failure the HTTP API answers, and one exception handler.

Every endpoint raises `ApiError` or `AccessError` (or lets FastAPI's own errors through);
the handlers installed by `install_handlers` turn each into `{"error": {...}}` with its status,
and 429/503 carry `Retry-After`.
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from adapter_store.errors import ReadOnlyStoreError
from deployments.access.gate import AccessError
from deployments.access.gate import error_response as access_error_response
from deployments.api.json_guard import BodyError, parse_body
from deployments.api.request_models import OPENAI_UNSUPPORTED
from deployments.protocol.openai_error import error_payload


class ApiError(Exception):
    """An error answered in the OpenAI shape."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(
    status: int, message: str, param: str | None = None, retry_after: int = 1
) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if status in (429, 503) else None
    return JSONResponse(error_payload(status, message, param), status_code=status, headers=headers)


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.message, exc.param)


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(exc.status_code, str(exc.detail))


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    return error_response(400, str(exc))


async def _read_only(_: Request, exc: Exception) -> JSONResponse:
    return error_response(403, str(exc))


async def _access_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, AccessError)
    return access_error_response(exc)


def install_handlers(app: FastAPI) -> None:
    """Map `ApiError`, access refusals, HTTP and request-validation errors to the OpenAI
    error shape."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(AccessError, _access_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ReadOnlyStoreError, _read_only)


_UNION_TAGS = {"str", "int", "float", "bool", "none"}


def _param_path(loc: tuple[Any, ...]) -> list[str]:
    """A location without pydantic's validator and union-member tags (`list[str]`, `int`)."""
    return [
        str(p)
        for p in loc
        if not str(p).startswith(("function-", "tagged-union"))
        and "[" not in str(p)
        and str(p) not in _UNION_TAGS
    ]


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """The most specific error as `param: message`, with `param` the dotted path of the bad
    field (for a union, the member that got furthest: `prompt.1`, not "not a string")."""
    errors = exc.errors()
    err = max(
        errors, key=lambda e: len([p for p in e["loc"] if not str(p).startswith("function-")])
    )
    loc = _param_path(err["loc"])
    param = ".".join(loc) or None
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        named = ".".join(p for p in loc if not p.isdigit())
        msg = OPENAI_UNSUPPORTED.get(named, "unknown parameter")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param


PayloadT = TypeVar("PayloadT", bound=BaseModel)


def read_payload(raw: bytes, cls: type[PayloadT], max_bytes: int, max_depth: int) -> PayloadT:
    """A request body as `cls`: 413 over `max_bytes`, 400 for bad JSON, a non-object or a field
    that fails validation (naming it)."""
    if len(raw) > max_bytes:
        raise ApiError(413, f"request body exceeds {max_bytes} bytes")
    try:
        data = parse_body(raw, max_depth)
    except BodyError as exc:
        raise ApiError(400, str(exc)) from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise ApiError(400, message, param) from None
