"""One sequence's matcher over its compiled grammar: the token mask before each sampling step and
the advance after it (xgrammar is imported here only when a request asks for a format)."""

from __future__ import annotations

from typing import Any

import torch

from molora_runtime.errors import InvalidRequestError


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        import xgrammar as xgr  # the optional `serve` extra

        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self.vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """Bool [vocab] of the tokens the grammar accepts next."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        bits = (self._bitmask[0, :, None] >> self._shifts) & 1
        return bits.bool().flatten()[: self.vocab_size]

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise InvalidRequestError(f"token {token} does not fit the response format")

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())
