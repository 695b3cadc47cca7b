"""One table from exceptions to HTTP statuses, used by the replica (to encode) and the ingress.

Replicas send errors back as plain `{"error": {...}}` stream items instead of raising, so the
ingress can answer with the right status before it has sent any header, and nothing depends
on how Ray wraps exceptions.
"""

from __future__ import annotations

from typing import Any

from molora_runtime.errors import (
    AdapterLoadError,
    AdapterNotFoundError,
    EngineOverloadedError,
    EngineStoppedError,
    HotSetFullError,
    InvalidRequestError,
)

RETRYABLE = frozenset({429, 503})


def status_of(exc: BaseException) -> int:
    """HTTP status for an engine error (500 when it is our fault)."""
    if isinstance(exc, AdapterNotFoundError):
        return 404
    if isinstance(exc, InvalidRequestError | AdapterLoadError | HotSetFullError):
        return 400
    if isinstance(exc, EngineOverloadedError):
        return 429
    if isinstance(exc, EngineStoppedError):
        return 503
    return 500


def error_item(exc: BaseException) -> dict[str, Any]:
    """Stream item carrying an error from a replica to the ingress."""
    status = status_of(exc)
    message = str(exc) or type(exc).__name__
    if status == 500:
        message = f"internal error: {type(exc).__name__}: {message}"
    return {"error": {"status": status, "message": message}}
