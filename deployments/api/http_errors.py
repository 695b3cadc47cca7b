"""The OpenAI error shape for every failure the HTTP API answers, and one exception handler.

Every endpoint raises `ApiError` or `AccessError` (or lets FastAPI's own errors through);
the handlers installed by `install_handlers` turn each into `{"error": {...}}` with its status,
and 429/503 carry `Retry-After`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.access.gate import AccessError
from deployments.access.gate import error_response as access_error_response
from deployments.api.response_models import error_payload


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
    msg = "unknown parameter" if err["type"] == "extra_forbidden" else err["msg"]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param
