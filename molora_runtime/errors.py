"""Errors the engine raises; the serving layer maps each to an HTTP status."""

from __future__ import annotations


class MoLoRAError(Exception):
    """Base of every error the runtime raises on purpose."""


class AdapterNotFoundError(LookupError):
    """The named adapter or composition does not exist in the source."""


class InvalidRequestError(MoLoRAError, ValueError):
    """The request itself is wrong (prompt too long, bad route, bad sampling) → 400."""


class AdapterLoadError(MoLoRAError, ValueError):
    """An adapter or composition exists but its files are unusable (names adapter and tensor)."""


class HotSetFullError(MoLoRAError, RuntimeError):
    """One batch would need more adapters than the hot-set has slots."""


class EngineOverloadedError(MoLoRAError, RuntimeError):
    """The waiting queue is full → 429/503 with Retry-After."""


class EngineStoppedError(MoLoRAError, RuntimeError):
    """The engine is shutting down or its step loop died."""


class NonFiniteLogitsError(InvalidRequestError):
    """One sequence's logits hold NaN/Inf (its route or data blew up); only it fails → 400."""


class SequenceStepError(MoLoRAError, RuntimeError):
    """A step raised and bisection pinned it on this sequence alone; only it fails → 500."""


__all__ = [
    "AdapterLoadError",
    "AdapterNotFoundError",
    "EngineOverloadedError",
    "EngineStoppedError",
    "HotSetFullError",
    "InvalidRequestError",
    "MoLoRAError",
    "NonFiniteLogitsError",
    "SequenceStepError",
]
