"""Slot buffers of a fused projection group (q/k/v, gate/up) laid out for ONE shrink + ONE expand.

The CPU serving path (`kernels.stacked`) runs a projection's routed delta as two GEMMs over one
layer's slots. A fused group would pay that per member; laid out as below it pays it once:

- `A [L, S, n·r, d_in]`: one slot's block holds the n targeted members' A rows back to back, so
  slots `[first, first + count)` of a layer are one contiguous `[count·n·r, d_in]` matrix.
- `Bt [L, S, n·r, D]` (D = the fused output width, every member of the group): block-structured,
  member i's rows `i·r..(i+1)·r` are non-zero only in its own output columns, so one GEMM writes
  the whole fused output before it is split. Members the adapters never target own columns that
  stay zero, so their delta is exactly zero.

Each targeted member keeps an ordinary stacked `LoRABuffers` made of views into these tensors, so
hot-set writes and slot clears go through the member unchanged. Costs n× the expand flops and
Bt memory of separate members; at CPU decode sizes the step is bound by per-op overhead instead.
"""

from __future__ import annotations

import torch

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
        self.A = torch.zeros(layers, slots, n * rank, d_in, dtype=dtype, device=device)
        self.Bt = torch.zeros(layers, slots, n * rank, sum(widths), dtype=dtype, device=device)
        self.packed_pairs = PackedPairs()  # oneDNN copies of stacked pairs (CPU bf16)
        self.members: list[LoRABuffers | None] = []
        block, col = 0, 0
        for width, hit in zip(widths, targeted, strict=True):
            if hit:
                rows = slice(block * rank, (block + 1) * rank)
                self.members.append(
                    LoRABuffers(self.A[:, :, rows], self.Bt[:, :, rows, col : col + width], True)
                )
                block += 1
            else:
                self.members.append(None)
            col += width

    @property
    def rank(self) -> int:
        """Rows of one slot's block (n·r): the rank the stacked weight matrix expands to."""
        return self.A.shape[2]

    @property
    def nbytes(self) -> int:
        return (self.A.numel() + self.Bt.numel()) * self.A.element_size()

    def stacked_pair(self, layer: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`A_flat [count·n·r, d_in]`, `Bt_flat [count·n·r, D]` over slots first..first+count-1."""
        A = self.A[layer, first : first + count].reshape(count * self.rank, -1)
        Bt = self.Bt[layer, first : first + count].reshape(count * self.rank, -1)
        return A, Bt

    @property
    def stacked_Bt(self) -> torch.Tensor:
        return self.Bt
