"""The OpenAI error shape every refusal takes: `{"error": {"message", "type", "param", "code"}}`.

The gate and admission (deployments/access/) refuse requests before the ingress
(deployments/api/) sees them, and the ingress answers replica errors and its own; all of them
speak this one body, so it sits on the protocol floor that both import.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error shape: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorBody


ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


def error_payload(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    body = ErrorBody(
        message=message, type=ERROR_TYPES.get(status, "error"), param=param, code=status
    )
    return ErrorResponse(error=body).model_dump()
