"""Step/loss/ETA progress lines for the training commands (plain prints: logs stay greppable)."""

from __future__ import annotations

import sys
import time


class Progress:
    """Prints `step i/n loss x (avg y) elapsed ETA` every `every` steps."""

    def __init__(self, total: int, start: int = 0, every: int = 10, label: str = "train") -> None:
        self.total, self.start, self.every, self.label = total, start, every, label
        self.t0 = time.monotonic()
        self.recent: list[float] = []

    def update(self, step: int, loss: float, **extra: float) -> None:
        self.recent = [*self.recent[-(self.every - 1) :], loss] if self.every > 1 else [loss]
        if step % self.every and step != self.total:
            return
        elapsed = time.monotonic() - self.t0
        done = max(step - self.start, 1)
        eta = elapsed / done * (self.total - step)
        avg = sum(self.recent) / len(self.recent)
        more = "".join(f" {k} {v:.4f}" for k, v in extra.items())
        print(
            f"[{self.label}] step {step}/{self.total} loss {loss:.4f} (avg {avg:.4f}){more} "
            f"elapsed {elapsed:.0f}s ETA {eta:.0f}s",
            file=sys.stderr,
            flush=True,
        )
