"""How the tokens of one forward attend: through the KV cache (serving) or densely (training)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSegment:
    """`length` consecutive tokens of one sequence starting at token `start` of the step."""

    start: int
    length: int
    row: int  # KV-cache row of the sequence
    start_pos: int  # position of the first token (tokens before it are already cached)


@dataclass
class CacheAttention:
    """Serving path: the first `num_decode` tokens are single-token decodes, then prefill segments.

    For a captured decode step `static_kv_len` fixes the attended length (masking the rest), so
    every tensor keeps its shape and address between replays.
    """

    kv_rows: torch.Tensor  # [N] cache row per token
    positions: torch.Tensor  # [N]
    num_decode: int
    decode_context_lens: torch.Tensor  # [num_decode] = position + 1
    prefill_segments: list[PrefillSegment] = field(default_factory=list)
    static_kv_len: int | None = None
    max_decode_context: int = 0  # host-side max of decode_context_lens (eager path)


@dataclass
class DenseAttention:
    """Training path: a [B, T] batch, causal, optional right padding (no KV cache)."""

    batch: int
    seq_len: int
    positions: torch.Tensor  # [B * T]


class KVCache:
    """Static per-layer key/value tensors [L, rows, max_len, kv_heads, head_dim].

    One row per running sequence (plus scratch rows for padded graph replays); shapes never
    change, so a captured decode graph stays valid.
    """

    def __init__(
        self,
        num_layers: int,
        rows: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, rows, max_len, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.rows = rows
        self.max_len = max_len

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
