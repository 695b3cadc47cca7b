"""The recent answers of one tenant on one route, indexed so a new request on that route can
draft from them (`suffix`); bounded, the newer half kept."""

from __future__ import annotations

from collections.abc import Sequence as Tokens

from molora_runtime.engine.speculation.ngram_index import SEPARATOR, NgramIndex

ROUTE_MEMORY_TOKENS = 1 << 16  # tokens of recent answers kept per tenant and route


class RouteMemory:
    """Recent answers of one tenant on one route, as one stream with separators."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.stream: list[int] = []
        self.index = NgramIndex(lo, hi)

    def add(self, answer: Tokens[int]) -> None:
        if len(self.stream) + len(answer) + 1 > ROUTE_MEMORY_TOKENS:  # keep the newer half
            self.stream = self.stream[len(self.stream) // 2 :]
            self.index = NgramIndex(self.lo, self.hi)
        self.stream.extend(answer)
        self.stream.append(SEPARATOR)
        self.index.extend(self.stream)
