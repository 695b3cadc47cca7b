"""Incremental detokenization with stop strings that never leak into the streamed text."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Decodes a sequence's output ids and decides how much text is safe to emit."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1

    def update(self, output_ids: list[int], search_from: int = 0) -> tuple[str, bool]:
        """Full text so far (cut at a stop string) and whether a stop string was hit; stop
        strings are looked for from character `search_from` on (min_tokens: earlier ones count
        as text)."""
        if self.tokenizer is None:
            return "", False
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        hits = [text.find(s, search_from) for s in self.stop]
        hits = [h for h in hits if h >= 0]
        if hits:
            return text[: min(hits)], True
        return text, False

    def safe_length(self, text: str, finished: bool) -> int:
        """Characters that may be emitted now (hold back a possible stop-string prefix)."""
        if finished:
            return len(text)
        n = len(text)
        while n and text[n - 1] == "\ufffd":  # an incomplete UTF-8 sequence
            n -= 1
        return max(0, n - self.holdback)
