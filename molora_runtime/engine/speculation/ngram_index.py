"""The n-gram lookup drafts come from: for each n-gram of a growing token stream, where its
latest continuation starts."""

from __future__ import annotations

from collections.abc import Sequence as Tokens

SEPARATOR = -1  # between answers in a route's memory: no match spans two answers


class NgramIndex:
    """The latest start of the continuation after every n-gram (n in [lo, hi]) of one growing
    token stream: `extend` indexes what was appended since, `match` looks the stream's own tail
    up (or another stream's tail, for a shared memory)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(lo, hi + 1)}
        self.indexed = 0  # continuations [0, indexed) are in the tables

    def extend(self, stream: Tokens[int]) -> None:
        """Index every n-gram of `stream` that now has a continuation (ends before its last
        token)."""
        for end in range(max(self.indexed, self.lo), len(stream)):
            for n in range(self.lo, min(self.hi, end) + 1):
                gram = tuple(stream[end - n : end])
                if SEPARATOR not in gram:
                    self.tables[n][gram] = end
        self.indexed = max(self.indexed, len(stream))

    def match(self, tail: Tokens[int]) -> tuple[int, int]:
        """(n, continuation start) of the longest indexed n-gram ending `tail`; (0, -1) if none."""
        for n in range(min(self.hi, len(tail)), self.lo - 1, -1):
            start = self.tables[n].get(tuple(tail[len(tail) - n :]))
            if start is not None:
                return n, start
        return 0, -1
