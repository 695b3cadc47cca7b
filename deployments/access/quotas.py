"""Per-key quotas: requests/min and tokens/min token buckets, and a cap on concurrent requests.

Each bucket holds up to one minute's allowance and refills continuously, so a key may burst its
per-minute amount and then runs at the steady rate; an over-quota request is refused before it
reaches a replica, with `Retry-After` = the time until the bucket holds what it needs. Tokens are
charged up front at the request's `max_tokens` and settled against the real usage (prompt +
completion) when it ends, so a long prompt is paid for by the key's next requests.

Buckets live in the ingress replica that sees the request: with N router replicas a key's
effective limit is up to N times the configured one (documented in the README's Security section).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from dataclasses import dataclass, field

from deployments.access.auth import Principal
from deployments.config import Limits, QuotaConfig


class QuotaExceeded(Exception):
    """Refused by a quota; `retry_after_s` is when the same request would pass."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TokenBucket:
    """`capacity` units, refilled at `capacity` per minute; the level may go negative when a
    settled request used more than it was charged."""

    def __init__(self, per_min: float, now: float) -> None:
        self.capacity = per_min
        self.rate = per_min / 60.0
        self.level = per_min
        self.at = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until `amount` is available (0 = now)."""
        self._refill(now)
        return max(0.0, (min(amount, self.capacity) - self.level) / self.rate)

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount


@dataclass
class _KeyState:
    limits: Limits
    requests: TokenBucket | None
    tokens: TokenBucket | None
    leases: dict[int, float] = field(default_factory=dict)  # lease id -> expiry


class Lease:
    """One admitted request: `release(tokens)` settles its tokens and frees its slot (once)."""

    def __init__(self, book: QuotaBook, key_id: str, lease_id: int, charged: int) -> None:
        self._book, self._key, self._id, self.charged = book, key_id, lease_id, charged
        self._done = False

    def release(self, used_tokens: int | None = None) -> None:
        if self._done:
            return
        self._done = True
        self._book._release(self._key, self._id, self.charged, used_tokens)


class QuotaBook:
    """All keys' buckets in this ingress replica."""

    def __init__(self, cfg: QuotaConfig, lease_timeout_s: float) -> None:
        self.cfg = cfg
        self.lease_timeout_s = lease_timeout_s
        self._keys: dict[str, _KeyState] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def _state(self, principal: Principal, now: float) -> _KeyState:
        state = self._keys.get(principal.key_id)
        if state is None:
            limits = self.cfg.limits_for(principal)
            state = _KeyState(
                limits=limits,
                requests=TokenBucket(limits.requests_per_min, now)
                if limits.requests_per_min
                else None,
                tokens=TokenBucket(limits.tokens_per_min, now) if limits.tokens_per_min else None,
            )
            self._keys[principal.key_id] = state
        return state

    def admit(self, principal: Principal, max_tokens: int, busy_s: float) -> Lease:
        """Admit a request that may generate `max_tokens`, or raise `QuotaExceeded`.

        `busy_s` is the ingress' estimate of how long a running request takes: the
        Retry-After of a refusal for concurrency.
        """
        now = time.monotonic()
        with self._lock:
            state = self._state(principal, now)
            limits = state.limits
            state.leases = {i: t for i, t in state.leases.items() if t > now}
            if limits.max_concurrent is not None and len(state.leases) >= limits.max_concurrent:
                raise QuotaExceeded(
                    f"too many concurrent requests for this API key (limit "
                    f"{limits.max_concurrent}); retry when one finishes",
                    busy_s,
                )
            if state.requests is not None:
                wait = state.requests.wait_for(1, now)
                if wait > 0:
                    raise QuotaExceeded(
                        f"request rate limit of this API key reached "
                        f"({limits.requests_per_min:g} requests/min)",
                        wait,
                    )
            charged = 0
            if state.tokens is not None:
                charged = max_tokens
                wait = state.tokens.wait_for(charged, now)
                if wait > 0:
                    raise QuotaExceeded(
                        f"token rate limit of this API key reached "
                        f"({limits.tokens_per_min:g} tokens/min)",
                        wait,
                    )
                state.tokens.take(charged, now)
            if state.requests is not None:
                state.requests.take(1, now)
            lease_id = next(self._ids)
            state.leases[lease_id] = now + self.lease_timeout_s
            return Lease(self, principal.key_id, lease_id, charged)

    def _release(self, key_id: str, lease_id: int, charged: int, used: int | None) -> None:
        now = time.monotonic()
        with self._lock:
            state = self._keys.get(key_id)
            if state is None:
                return
            state.leases.pop(lease_id, None)
            if state.tokens is not None and used is not None:
                state.tokens.take(used - charged, now)


def retry_after_header(seconds: float) -> int:
    """Whole seconds for `Retry-After`, never 0 (a client would retry at once and fail)."""
    return max(1, math.ceil(seconds))
