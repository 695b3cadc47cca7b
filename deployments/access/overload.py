"""An honest `Retry-After` for overload answers, from what this ingress observes.

When the engine queue or the cluster queue is full, the useful answer is how long until a slot
frees up: the requests this ingress has in flight drain `slots` at a time (the engine's
`max_num_seqs`), each batch taking about the recent mean request time. Both numbers are local
to the ingress replica (it sees neither other routers' traffic nor the replica count), so this
is an estimate, clamped to [`floor_s`, `cap_s`].
"""

from __future__ import annotations

import math
import time


class WaitEstimator:
    """Tracks requests in flight and an exponential moving average of their duration."""

    def __init__(self, floor_s: float, slots: int, cap_s: float = 60.0, alpha: float = 0.2):
        self.floor_s, self.slots, self.cap_s, self.alpha = floor_s, max(1, slots), cap_s, alpha
        self.in_flight = 0
        self.mean_s: float | None = None

    def start(self) -> float:
        self.in_flight += 1
        return time.perf_counter()

    def finish(self, started: float, ok: bool = True) -> None:
        """One request ended; only completed ones teach the service time."""
        self.in_flight = max(0, self.in_flight - 1)
        if not ok:
            return
        took = time.perf_counter() - started
        self.mean_s = (
            took if self.mean_s is None else self.mean_s + self.alpha * (took - self.mean_s)
        )

    def service_s(self) -> float:
        """Recent mean request time (the floor until a request has completed)."""
        return self.mean_s if self.mean_s is not None else self.floor_s

    def wait_s(self) -> float:
        """Seconds until a new request would likely find room."""
        batches = math.ceil((self.in_flight + 1) / self.slots)
        return min(self.cap_s, max(self.floor_s, batches * self.service_s()))

    def retry_after(self) -> int:
        return max(1, math.ceil(self.wait_s()))
