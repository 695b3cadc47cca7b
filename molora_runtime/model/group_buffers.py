"""Slot buffers of a fused projection group (q/k/v, gate/up) laid out for ONE shrink per group.

The CPU serving path (`kernels.stacked`) runs a projection's routed delta as a shrink GEMM and
an expand GEMM over one layer's slots. A fused group lays its members out so that the shrink is
paid once for all of them:

- `A [L, S, n·r, d_in]`: one slot's block holds the n targeted members' A rows back to back, so
  slots `[first, first + count)` of a layer are one contiguous `[count·n·r, d_in]` matrix.
- `Bt [L, Σ S·r·w]`: each targeted member's own `[S, r, w]` block per layer (member-major), so
  a member's slots `[first, first + count)` are one contiguous `[count·r, w]` matrix and the
  expand runs per member into its own output columns (`routed_lora_stacked_group`), with no
  zero blocks multiplied. Members the adapters never target have no block and no delta.

Each targeted member keeps an ordinary stacked `LoRABuffers` made of views into these tensors, so
hot-set writes and slot clears go through the member unchanged, and every view shares its
base's version counter (the packed bf16 copies see every write).
"""

from __future__ import annotations

import torch

from kernels.stacked import routed_lora_stacked_group
from molora_runtime.model.layers import LoRABuffers
from molora_runtime.model.packed_linear import PackedPairs


class GroupLoRABuffers:
    """Stacked-layout slot buffers shared by the targeted members of one fused group."""

    def __init__(
        self,
        slots: int,
        layers: int,
        rank: int,
        d_in: int,
        widths: list[int],
        targeted: list[bool],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """`widths`: output width of every member, in fused order; `targeted`: which have LoRA."""
        n = sum(targeted)
        if n == 0:
            raise ValueError("a group buffer needs at least one targeted member")
        self.member_rank = rank
        self.width = sum(widths)
        hit_widths = [w for w, hit in zip(widths, targeted, strict=True) if hit]
        self.A = torch.zeros(layers, slots, n * rank, d_in, dtype=dtype, device=device)
        self.Bt = torch.zeros(layers, slots * rank * sum(hit_widths), dtype=dtype, device=device)
        self.packed_pairs = PackedPairs()  # packed copies of stacked pairs (CPU bf16)
        self.members: list[LoRABuffers | None] = []
        self._expanders: list[tuple[LoRABuffers, int]] = []  # targeted member, first column
        block, col, offset = 0, 0, 0
        for width, hit in zip(widths, targeted, strict=True):
            if hit:
                rows = slice(block * rank, (block + 1) * rank)
                size = slots * rank * width
                bt = self.Bt[:, offset : offset + size].unflatten(1, (slots, rank, width))
                member = LoRABuffers(self.A[:, :, rows], bt, True)
                self.members.append(member)
                self._expanders.append((member, col))
                block += 1
                offset += size
            else:
                self.members.append(None)
            col += width
        # `slot_views` per (layer, first, count): the buffers never move (see `LoRABuffers`)
        self._slot_views: dict[
            tuple[int, int, int], tuple[torch.Tensor, list[tuple[torch.Tensor, int]]]
        ] = {}

    @property
    def rank(self) -> int:
        """Rows of one slot's block (n·r): the rank the stacked weight matrix expands to."""
        return self.A.shape[2]

    @property
    def nbytes(self) -> int:
        return (self.A.numel() + self.Bt.numel()) * self.A.element_size()

    def slot_views(
        self, layer: int, first: int, count: int
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, int]]]:
        """`A_flat [count·n·r, d_in]` of one layer's slot range and each targeted member's
        `Bt_flat [count·r, w]` with its first output column: views, made once per range."""
        key = (layer, first, count)
        views = self._slot_views.get(key)
        if views is None:
            rows = count * self.member_rank
            A = self.A[layer, first : first + count].reshape(count * self.rank, -1)
            pairs = [
                (m.B[layer, first : first + count].reshape(rows, -1), col)
                for m, col in self._expanders
            ]
            views = self._slot_views[key] = (A, pairs)
        return views

    def member_pairs(self, layer: int, first: int, count: int) -> list[tuple[torch.Tensor, int]]:
        """Each targeted member's `Bt_flat [count·r, w]` (a view) and its first output column."""
        return self.slot_views(layer, first, count)[1]

    def stacked_pair(self, layer: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`A_flat [count·n·r, d_in]` (a view) and the block-structured `Bt_flat [count·n·r, D]`
        (a copy: member i's rows are non-zero only in its own columns), for a one-GEMM expand
        (the oneDNN-packed bf16 path, which packs it once per slot-buffer version)."""
        r = self.member_rank
        A, pairs = self.slot_views(layer, first, count)
        Bt = torch.zeros(count, self.rank, self.width, dtype=self.Bt.dtype, device=self.Bt.device)
        for i, (bt_flat, col) in enumerate(pairs):
            block = bt_flat.view(count, r, -1)
            Bt[:, i * r : (i + 1) * r, col : col + block.shape[-1]] = block
        return A, Bt.reshape(count * self.rank, self.width)

    def add_stacked_delta(
        self, x: torch.Tensor, out: torch.Tensor, layer: int, first: int, count: int,
        expanded: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Add the group's routed delta of `x` to the fused output `out`: one shrink, one
        expand per targeted member."""
        A, pairs = self.slot_views(layer, first, count)
        return routed_lora_stacked_group(x, A, pairs, self.member_rank, expanded, out)

    @property
    def stacked_Bt(self) -> torch.Tensor:
        return self.Bt
