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
    # CPU eager decode: (first row, number of rows) of the span holding every decode's KV row,
    # each decode's index inside it, and each span row's context length (0 = not decoding).
    decode_span: tuple[int, int] | None = None
    decode_span_index: torch.Tensor | None = None
    span_context_lens: torch.Tensor | None = None
    _mask: torch.Tensor | None = field(default=None, repr=False)
    _span_mask: torch.Tensor | None = field(default=None, repr=False)

    def span_mask(self, length: int) -> torch.Tensor:
        """[rows, 1, 1, length] additive fp32 mask over the decode span (built once a step)."""
        mask = self._span_mask
        if mask is None or mask.shape[-1] != length:
            lens = self.span_context_lens
            assert lens is not None
            kpos = torch.arange(length, device=lens.device)
            # Rows that are not decoding keep their first key so softmax stays finite.
            visible = (kpos[None, :] < lens.clamp(min=1)[:, None]).view(-1, 1, 1, length)
            mask = torch.zeros(visible.shape, dtype=torch.float32, device=lens.device)
            mask = mask.masked_fill_(~visible, float("-inf"))
            self._span_mask = mask
        return mask

    def decode_mask(self, length: int) -> torch.Tensor:
        """[D, 1, 1, length] mask of each decode's real context, built once for every layer."""
        mask = self._mask
        if mask is None or mask.shape[-1] != length:
            D = self.decode_context_lens.shape[0]
            kpos = torch.arange(length, device=self.decode_context_lens.device)
            mask = (kpos[None, :] < self.decode_context_lens[:, None]).view(D, 1, 1, length)
            self._mask = mask
        return mask


@dataclass
class DenseAttention:
    """Training path: a [B, T] batch, causal, optional right padding (no KV cache)."""

    batch: int
    seq_len: int
    positions: torch.Tensor  # [B * T]


class KVCache:
    """Static per-layer key/value tensors [L, rows, kv_heads, max_len, head_dim].

    One row per running sequence (plus scratch rows for padded graph replays); shapes never
    change, so a captured decode graph stays valid. Heads before positions make a row's keys
    of one head contiguous, so a span of rows is directly the [rows·heads, len, hd] operand of
    a batched GEMM.
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
        shape = (num_layers, rows, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.rows = rows
        self.max_len = max_len

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of row `src` into row `dst` (row compaction)."""
        self.k[:, dst, :, :length].copy_(self.k[:, src, :, :length])
        self.v[:, dst, :, :length].copy_(self.v[:, src, :, :length])

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


def step_attention(
    rows: list[int],
    positions: list[int],
    num_decode: int,
    prefill_segments: list[PrefillSegment],
    device: torch.device,
) -> CacheAttention:
    """One eager step's attention metadata from host lists (decodes first, then prefills).

    On CPU, decodes read their KV rows through one span view when the rows are close enough
    together that computing the rows in between (at most as many again) costs less than
    gathering them.
    """
    decode_rows = rows[:num_decode]
    decode_lens = [p + 1 for p in positions[:num_decode]]
    meta = CacheAttention(
        kv_rows=torch.tensor(rows, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        num_decode=num_decode,
        decode_context_lens=torch.tensor(decode_lens, dtype=torch.long, device=device),
        prefill_segments=prefill_segments,
        max_decode_context=max(decode_lens, default=0),
    )
    if decode_rows and device.type == "cpu":
        lo, hi = min(decode_rows), max(decode_rows)
        span = hi - lo + 1
        if span <= 2 * num_decode:
            index = [r - lo for r in decode_rows]
            lens = [0] * span
            for i, n in zip(index, decode_lens, strict=True):
                lens[i] = n
            meta.decode_span = (lo, span)
            meta.decode_span_index = torch.tensor(index, dtype=torch.long, device=device)
            meta.span_context_lens = torch.tensor(lens, dtype=torch.long, device=device)
    return meta
