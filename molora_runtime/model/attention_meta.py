"""How the tokens of one forward attend: through the paged KV cache (serving) or densely (training).

The serving cache is paged: each layer's K and V are `[num_blocks, kv_heads, block_size, hd]`,
and a sequence owns a list of blocks (its block table). A token at position p of a sequence lives
in block `table[p // block_size]` at offset `p % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSegment:
    """`length` consecutive tokens of one sequence starting at token `start` of the step."""

    start: int
    length: int
    start_pos: int  # position of the first token (tokens before it are already cached)
    blocks: torch.Tensor  # [ceil((start_pos + length) / block_size)] the blocks it attends over


@dataclass
class DecodePlan:
    """Eager decode's gather of every decode's real context, built once a step for all layers.

    `index` picks `[D * kv_heads * nblk]` rows of a layer's cache viewed as
    `[num_blocks * kv_heads, block_size, hd]`, so the gathered keys are directly the
    `[D * kv_heads, nblk * block_size, hd]` operand of one batched GEMM; `mask` hides the tail.
    """

    index: torch.Tensor
    mask: torch.Tensor  # [D, 1, 1, nblk * block_size] additive fp32
    length: int  # nblk * block_size


@dataclass
class CacheAttention:
    """Serving path: the first `num_decode` tokens are single-token decodes, then prefill segments.

    A captured decode step (`static=True`) attends through the padded `block_tables`, so every
    tensor keeps its shape and address between replays; the eager step uses `decode_plan`.
    """

    slot_blocks: torch.Tensor  # [N] block each token's K/V is written to
    slot_offsets: torch.Tensor  # [N] offset inside that block
    positions: torch.Tensor  # [N]
    num_decode: int
    block_tables: torch.Tensor  # [num_decode, max_blocks] int32, padded with the scratch block
    context_lens: torch.Tensor  # [num_decode] int32 = position + 1
    prefill_segments: list[PrefillSegment] = field(default_factory=list)
    static: bool = False
    decode_plan: DecodePlan | None = None


@dataclass
class DenseAttention:
    """Training path: a [B, T] batch, causal, optional right padding (no KV cache)."""

    batch: int
    seq_len: int
    positions: torch.Tensor  # [B * T]


class KVCache:
    """Paged key/value tensors `[L, num_blocks + 1, kv_heads, block_size, head_dim]`.

    The last block is scratch: padded graph replays write there and padded block tables point at
    it, so it is never handed to a sequence. Shapes never change, so captured graphs stay valid.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, num_blocks + 1, kv_heads, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_heads = kv_heads
        self.scratch_block = num_blocks

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks `src[i]` into `dst[i]` (a forked prefill's KV)."""
        if src:
            s = torch.tensor(src, device=self.k.device)
            d = torch.tensor(dst, device=self.k.device)
            self.k[:, d] = self.k[:, s]
            self.v[:, d] = self.v[:, s]

    def zero_blocks(self, blocks: list[int]) -> None:
        """Wipe blocks (NaN K/V of a failed sequence would survive masking in the next owner)."""
        if blocks:
            b = torch.tensor(blocks, device=self.k.device)
            self.k[:, b] = 0
            self.v[:, b] = 0

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


def decode_plan(
    tables: list[list[int]],
    context_lens: list[int],
    kv: KVCache,
    device: torch.device,
) -> DecodePlan:
    """The gather index and mask of one eager step's decodes (see `DecodePlan`)."""
    bs, hkv = kv.block_size, kv.kv_heads
    nblk = max(-(-n // bs) for n in context_lens)
    padded = [t[:nblk] + [kv.scratch_block] * (nblk - min(len(t), nblk)) for t in tables]
    bt = torch.tensor(padded, dtype=torch.long, device=device)  # [D, nblk]
    heads = torch.arange(hkv, device=device)
    index = (bt[:, None, :] * hkv + heads[None, :, None]).reshape(-1)
    length = nblk * bs
    lens = torch.tensor(context_lens, dtype=torch.long, device=device)
    visible = torch.arange(length, device=device)[None, :] < lens[:, None]
    mask = torch.zeros(visible.shape, dtype=torch.float32, device=device)
    mask = mask.masked_fill_(~visible, float("-inf")).view(len(tables), 1, 1, length)
    return DecodePlan(index=index, mask=mask, length=length)


def step_attention(
    slots: list[tuple[int, int]],
    positions: list[int],
    decode_tables: list[list[int]],
    prefills: list[tuple[int, int, int, list[int]]],
    kv: KVCache,
    device: torch.device,
) -> CacheAttention:
    """One eager step's attention metadata from host lists (decodes first, then prefills).

    slots: (block, offset) each token writes; decode_tables: each decode's block table;
    prefills: (start in step, length, start position, block table) of each prefill chunk.
    """
    num_decode = len(decode_tables)
    lens = [p + 1 for p in positions[:num_decode]]
    bs = kv.block_size
    segments = [
        PrefillSegment(
            start,
            n,
            pos,
            torch.tensor(table[: -(-(pos + n) // bs)], dtype=torch.long, device=device),
        )
        for start, n, pos, table in prefills
    ]
    width = max((len(t) for t in decode_tables), default=0)
    padded = [t + [kv.scratch_block] * (width - len(t)) for t in decode_tables]
    return CacheAttention(
        slot_blocks=torch.tensor([b for b, _ in slots], dtype=torch.long, device=device),
        slot_offsets=torch.tensor([o for _, o in slots], dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        num_decode=num_decode,
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device).view(num_decode, width),
        context_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        prefill_segments=segments,
        decode_plan=decode_plan(decode_tables, lens, kv, device) if num_decode else None,
    )
