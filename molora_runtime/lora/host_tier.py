"""The host tier: parsed adapters in host memory, fetched by background workers.

A miss in the hot-set used to fetch the adapter (store download, checksum, safetensors parse)
inside the engine step, so every running sequence waited for one request's cold adapter.
Here a miss starts a background fetch instead; the request waits in the queue without holding
back the batch, and once the parsed weights are in host memory the step only copies them into
a slot. A failed fetch fails only the requests that need that adapter.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from adapter_store.counters import TierCounters
from molora_runtime.lora.peft_adapter import AdapterWeights
from molora_runtime.lora.pinned_lru import PinnedLRU

Reader = Callable[[str], AdapterWeights]


@dataclass
class HostTierCounters(TierCounters):
    """`loads` counts finished reads (in the background or inline); `failures` the reads that raised."""

    failures: int = 0
    fetch_seconds: list[float] = field(default_factory=list)  # drained by the metrics exporter


class HostTier:
    """LRU of parsed adapters within a byte budget, filled by `workers` background threads."""

    def __init__(
        self,
        read: Reader,
        budget_bytes: int,
        workers: int = 2,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self._read = read
        self.budget_bytes = budget_bytes
        self.on_ready = on_ready  # called from a worker when a fetch ends (wakes the step loop)
        self._lock = threading.Lock()
        self._cache: PinnedLRU[str, AdapterWeights] = PinnedLRU()  # pins: hot_set.pinned
        self._bytes = 0
        self._loading: set[str] = set()
        self._pending: dict[str, Future[None]] = {}  # the background fetch of each loading name
        self._failed: dict[str, BaseException] = {}
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="molora-fetch")
        self._done = threading.Event()
        self.counters = HostTierCounters()

    # ----- queries ---------------------------------------------------------------------------
    def get(self, name: str) -> AdapterWeights | None:
        """The parsed adapter if resident (marks it recently used)."""
        with self._lock:
            return self._lookup(name)

    def _lookup(self, name: str) -> AdapterWeights | None:
        """`get` for a caller that holds the lock."""
        weights = self._cache.get(name)
        if weights is not None:
            self.counters.hits += 1
        return weights

    def resident(self) -> list[str]:
        with self._lock:
            return self._cache.keys()

    def loading(self) -> list[str]:
        with self._lock:
            return sorted(self._loading)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def pin(self, name: str) -> None:
        """Keep `name` through eviction once it is (or when it becomes) resident."""
        with self._lock:
            self._cache.pin(name)

    # ----- fetching --------------------------------------------------------------------------
    def ready(self, name: str) -> bool:
        """True when `name` is parsed in host memory; else start fetching it and say False.

        Raises the fetch's error (once) when the last fetch of `name` failed, so the request
        that needs it fails with the reason and a later request tries the store again.
        """
        with self._lock:
            if name in self._cache:
                return True
            failure = self._failed.pop(name, None)
            if failure is not None:
                raise failure
            if name not in self._loading:
                self._loading.add(name)
                self.counters.misses += 1
                self._pending[name] = self._pool.submit(self._fetch, name)
            return False

    def warm(self, name: str) -> bool:
        """Like `ready` for a queued request's adapter, but never raises: a failure stays
        recorded for the request that needs it (and is not fetched again until then)."""
        with self._lock:
            if name in self._cache:
                return True
            if name in self._failed or name in self._loading:
                return False
        return self.ready(name)

    def read_now(self, name: str) -> AdapterWeights:
        """Fetch synchronously (start-up pinning, an idle engine, offline use); the result is
        kept. A fetch of `name` already running in the background is joined, not repeated:
        the same files are not read and parsed twice."""
        cached = self.get(name)
        if cached is not None:
            return cached
        with self._lock:
            pending = self._pending.get(name)
        if pending is not None:
            joined = self._join(name, pending)
            if joined is not None:
                return joined
        weights = self._read(name)
        with self._lock:
            self.counters.misses += 1
            self.counters.loads += 1
            self._keep(name, weights)
        return weights

    def _join(self, name: str, pending: Future[None]) -> AdapterWeights | None:
        """Wait for the background fetch of `name`: its weights, its error (raised once, as
        `ready` would), or None when it was cancelled or its result is gone (read again)."""
        with contextlib.suppress(CancelledError):
            pending.result()
        with self._lock:
            weights = self._lookup(name)
            if weights is not None:
                return weights
            failure = self._failed.pop(name, None)
        if failure is not None:
            raise failure
        return None

    def _fetch(self, name: str) -> None:
        start = time.perf_counter()
        try:
            weights = self._read(name)
        except BaseException as exc:
            with self._lock:
                self._loading.discard(name)
                self._pending.pop(name, None)
                self._failed[name] = exc
                self.counters.failures += 1
        else:
            with self._lock:
                self._loading.discard(name)
                self._pending.pop(name, None)
                self._keep(name, weights)
                self.counters.loads += 1
                self.counters.fetch_seconds.append(time.perf_counter() - start)
        self._done.set()
        if self.on_ready is not None:
            self.on_ready()

    def wait(self, timeout: float) -> bool:
        """Block until some fetch ends (or `timeout`): a step loop with nothing else to do
        sleeps here instead of spinning."""
        with self._lock:
            if not self._loading:
                return False
            self._done.clear()
        return self._done.wait(timeout)

    def _keep(self, name: str, weights: AdapterWeights) -> None:
        """Insert under the byte budget, evicting least recently used unpinned ones (caller
        holds the lock). An adapter larger than the whole budget is still kept, or it could
        never reach a slot."""
        if name in self._cache:
            return
        self._cache.put(name, weights)
        self._bytes += weights.nbytes()
        while self._bytes > self.budget_bytes:
            victim = next(self._cache.victims(keep=[name]), None)
            if victim is None:  # only pinned ones (and the newcomer) left: over budget, kept
                break
            self._bytes -= self._cache.pop(victim).nbytes()
            self.counters.evictions += 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
