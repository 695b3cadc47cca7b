"""One table from exceptions to HTTP statuses, used by the replica (to encode) and the ingress.

Replicas send errors back as typed `ErrorItem`s (deployments.protocol.wire) instead of raising,
so the ingress can answer with the right status before it has sent any header, and nothing
depends on how Ray wraps exceptions.
"""

from __future__ import annotations

from adapter_store.errors import (
    IntegrityError,
    InvalidInputError,
    NotFoundError,
    ReadOnlyStoreError,
    StoreAccessError,
    StoreUnavailableError,
)
from deployments.protocol.wire import ErrorItem
from molora_runtime.engine.types import GenerationOutput
from molora_runtime.errors import (
    AdapterLoadError,
    AdapterNotFoundError,
    EngineOverloadedError,
    EngineStoppedError,
    HotSetFullError,
    InvalidRequestError,
)

RETRYABLE = frozenset({429, 503})


def status_of(exc: BaseException | None) -> int:
    """HTTP status for an engine or store error (500 when it is our fault)."""
    if isinstance(exc, AdapterNotFoundError | NotFoundError):
        return 404
    if isinstance(exc, InvalidRequestError | AdapterLoadError | HotSetFullError):
        return 400
    if isinstance(exc, ReadOnlyStoreError):
        return 403  # a write to a store this server only reads
    if isinstance(exc, InvalidInputError):
        return 400  # the store refused a name or file the request named
    if isinstance(exc, EngineOverloadedError):
        return 429
    if isinstance(exc, EngineStoppedError | StoreUnavailableError):
        return 503
    if isinstance(exc, IntegrityError | StoreAccessError):
        return 502  # the store answered with something we cannot trust or use
    return 500


def error_item(exc: BaseException | None, message: str | None = None) -> ErrorItem:
    """The stream item carrying an error from a replica to the ingress."""
    status = status_of(exc)
    text = message or (str(exc) if exc is not None else "") or type(exc).__name__
    if status == 500 and not text.startswith("the request failed inside the model step"):
        text = f"internal error: {type(exc).__name__}: {text}"
    return ErrorItem(status=status, message=text)


def output_error(out: GenerationOutput) -> ErrorItem:
    """A request the engine ended with finish_reason "error": its own error, its own status."""
    return error_item(out.exception, out.error or "the request failed")


def stopped_item() -> ErrorItem:
    """A request the replica stopped before its end (its call cancelled: a draining replica)."""
    return ErrorItem(status=503, message="the model replica stopped the request; retry it")
