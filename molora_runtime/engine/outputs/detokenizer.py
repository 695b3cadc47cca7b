"""Incremental detokenization with stop strings that never leak into the streamed text.

Each update decodes only a short window of the newest tokens (vLLM's prefix/read offsets):
`decode(ids[prefix:])` minus `decode(ids[prefix:read])` is the new text, correct for byte-level
and SentencePiece tokenizers alike because both windows start at the same token. Re-decoding the
whole output every token would make a long completion quadratic. A window that ends inside a
multi-byte character (it decodes to U+FFFD) is held until the character completes.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a sequence's output ids and decides how much text is safe to emit."""

    def __init__(
        self,
        tokenizer: Any,
        stop: list[str],
        hidden: frozenset[int] = frozenset(),
        include_stop: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.hidden = hidden  # ids that are not text (image codes): never decoded
        self.include_stop = include_stop  # the text ends after the stop string, not before it
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # settled text (every character complete)
        self._prefix = 0  # first id of the context window
        self._read = 0  # ids before this are in `text`
        self._prefix_text = ""  # decode(ids[_prefix:_read])
        self._searched = 0  # stop strings cannot start before this index of `text`

    def _decode(self, ids: list[int]) -> str:
        if self.hidden:
            ids = [t for t in ids if t not in self.hidden]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, output_ids: list[int], search_from: int = 0) -> tuple[str, str | None]:
        """Full text so far (cut at a stop string) and the stop string hit (None if none);
        stop strings are looked for from character `search_from` on (min_tokens: earlier ones
        count as text). The earliest match wins."""
        if self.tokenizer is None:
            return "", None
        window = self._decode(output_ids[self._prefix :])
        pending = window[len(self._prefix_text) :]
        if pending and not window.endswith(REPLACEMENT):
            self.text += pending
            self._prefix, self._read = self._read, len(output_ids)
            self._prefix_text = self._decode(output_ids[self._prefix : self._read])
            pending = ""
        full = self.text + pending
        if self.stop:
            start = max(0, self._searched - self.holdback, search_from)
            hits = [(h, s) for s in self.stop if (h := full.find(s, start)) >= 0]
            if hits:
                at, stop = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
                return full[: at + len(stop) if self.include_stop else at], stop
            self._searched = len(self.text)
        return full, None

    def safe_length(self, text: str, finished: bool) -> int:
        """Characters that may be emitted now (hold back a possible stop-string prefix)."""
        if finished:
            return len(text)
        n = len(text)
        while n and text[n - 1] == REPLACEMENT:  # an incomplete UTF-8 sequence
            n -= 1
        return max(0, n - self.holdback)
