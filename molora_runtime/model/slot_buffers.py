"""The hot-set's static slot buffers: per projection (or fused group), per layer, per slot.

Two layouts, fixed per engine by its LoRA backend:

- kernel layout (CUDA, training): `A[S, L, r, d_in]`, `B[S, L, d_out, r]`, what the Triton
  kernels and the reference twins read, one layer as `A[:, layer]`.
- stacked layout (CPU): `A[L, S, r, d_in]`, `Bt[L, S, r, d_out]`, so one layer's slots are one
  contiguous `[S·r, d]` matrix each (`kernels.stacked`). A fused group (q/k/v, gate/up) shares
  one `A[L, S, n·r, d_in]` for its n targeted members (one shrink per group) and keeps each
  member's `Bt` block apart (one expand per member, no zero blocks).

A rank pool's stacked buffers hold no zero slot: their `slot_base` is 1, so slot id `s` of the
pool's local numbering (1-based; <= 0 is "no adapter") is row `s - 1`.

Either way the tensors are allocated once and written in place, so their addresses never change
(a captured graph stays valid), and every write is bounded: the values a slot holds after scale
and cast are finite and at most `MAX_ABS_WEIGHT`, so a slot a token does not use can add only
exact zeros to that token's row.
"""

from __future__ import annotations

import torch

from adapter_store.rules import MAX_ABS_WEIGHT
from kernels.stacked import SlotGate, routed_lora_stacked, routed_lora_stacked_group


class SlotValueError(ValueError):
    """An adapter's tensors would not fit a slot: non-finite or over the bound after the cast."""


def bounded(t: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    """`t` cast to `dtype`, refused unless every value is finite and |value| <= MAX_ABS_WEIGHT."""
    cast = t.to(dtype)
    peak = cast.abs().max().item() if cast.numel() else 0.0
    if not peak <= MAX_ABS_WEIGHT:  # also catches NaN
        raise SlotValueError(
            f"{what} holds |values| up to {peak:.3g} after scale and cast to "
            f"{str(dtype).removeprefix('torch.')}, over the bound {MAX_ABS_WEIGHT:g} on slot contents"
        )
    return cast


class LoRABuffers:
    """One projection's slot buffers, in the kernel or the stacked layout (see the module)."""

    def __init__(
        self, A: torch.Tensor, B: torch.Tensor, stacked: bool = False, slot_base: int = 0
    ) -> None:
        self.A = A
        self.B = B  # kernel layout: B; stacked layout: Bt
        self.stacked = stacked
        self.slot_base = slot_base  # slot id of row 0 (stacked pools keep no zero slot)
        # Views of one layer's slot range, made once: a decode step asks for the same few
        # ranges in every layer (the buffers never move).
        self._views: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def allocate(
        cls, slots: int, layers: int, rank: int, d_in: int, d_out: int, dtype: torch.dtype,
        device: torch.device, stacked: bool, slot_base: int = 0,
    ) -> LoRABuffers:  # fmt: skip
        if stacked:
            A = torch.zeros(layers, slots, rank, d_in, dtype=dtype, device=device)
            Bt = torch.zeros(layers, slots, rank, d_out, dtype=dtype, device=device)
            return cls(A, Bt, stacked=True, slot_base=slot_base)
        A = torch.zeros(slots, layers, rank, d_in, dtype=dtype, device=device)
        B = torch.zeros(slots, layers, d_out, rank, dtype=dtype, device=device)
        return cls(A, B)

    @property
    def rank(self) -> int:
        return self.A.shape[2]

    @property
    def columns(self) -> list[tuple[LoRABuffers, int]]:
        """A lone projection is a group of one member at column 0 (`GroupBuffers.columns`),
        so every backend reads both kinds of buffers alike."""
        return [(self, 0)]

    @property
    def Bt(self) -> torch.Tensor:
        """The stacked layout's `Bt [L, S, r, d_out]` (`GroupBuffers.Bt`)."""
        assert self.stacked, "only the stacked layout holds Bt"
        return self.B

    @property
    def width(self) -> int:
        """Output columns of the projection."""
        return self.B.shape[3] if self.stacked else self.B.shape[2]

    @property
    def nbytes(self) -> int:
        return (self.A.numel() + self.B.numel()) * self.A.element_size()

    def kernel_pair(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`A [S, r, d_in]`, `B [S, d_out, r]` of one layer (views; strided when stacked)."""
        assert self.slot_base == 0, "the kernel view indexes rows by slot id"
        if self.stacked:
            return self.A[layer], self.B[layer].transpose(1, 2)
        return self.A[:, layer], self.B[:, layer]

    def stacked_pair(self, layer: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`A_flat [count·r, d_in]`, `Bt_flat [count·r, d_out]` over slots first..first+count-1."""
        key = (layer, first, count)
        views = self._views.get(key)
        if views is None:
            r, row = self.rank, first - self.slot_base
            A = self.A[layer, row : row + count].reshape(count * r, -1)
            Bt = self.B[layer, row : row + count].reshape(count * r, -1)
            views = self._views[key] = (A, Bt)
        return views

    def stacked_delta(
        self, y: torch.Tensor, x: torch.Tensor, layer: int, first: int, count: int, gate: SlotGate
    ) -> torch.Tensor:
        """`y` plus the stacked delta of `x` over slots first..first+count-1 of one layer
        (`GroupBuffers.stacked_delta`): one shrink, one expand."""
        A, Bt = self.stacked_pair(layer, first, count)
        return routed_lora_stacked(x, A, Bt, gate, out=y)

    def block_pair(self, layer: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`stacked_pair`: one member's expand has no other member's zero blocks
        (`GroupBuffers.block_pair`)."""
        return self.stacked_pair(layer, first, count)

    def slot_rows(self, layer: int) -> tuple[torch.Tensor, list[tuple[torch.Tensor, int]]]:
        """Stacked: one layer's `A [S, r, d_in]` and `Bt [S, r, d_out]` at column 0, every slot
        (`GroupBuffers.slot_rows`)."""
        assert self.stacked, "only the stacked layout keeps a layer's slots together"
        return self.A[layer], [(self.B[layer], 0)]

    def clear_slot(self, slot: int) -> None:
        """Zero row `slot` of the buffers (a row index, not a slot id)."""
        if self.stacked:
            self.A[:, slot].zero_()
            self.B[:, slot].zero_()
        else:
            self.A[slot].zero_()
            self.B[slot].zero_()

    def write(self, slot: int, layer: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Copy one layer's `a [r, d_in]`, `b [d_out, r]` (r <= max rank) into row `slot`, bounded."""
        r = a.shape[0]
        a = bounded(a, self.A.dtype, f"lora_A of layer {layer}")
        b = bounded(b, self.B.dtype, f"lora_B of layer {layer}")
        if self.stacked:
            self.A[layer, slot, :r].copy_(a)
            self.B[layer, slot, :r].copy_(b.t())
        else:
            self.A[slot, layer, :r].copy_(a)
            self.B[slot, layer, :, :r].copy_(b)


class GroupBuffers:
    """The slot buffers of a fused group's members (None: a member no adapter targets).

    Stacked (`stacked_group`): the members' buffers are views into one shared `A` and one `Bt`,
    so one shrink covers the group; kernel layout: each member keeps its own buffers.
    """

    def __init__(
        self,
        members: list[LoRABuffers | None],
        widths: list[int],
        A: torch.Tensor | None = None,
        Bt: torch.Tensor | None = None,
        slot_base: int = 0,
    ) -> None:
        """`widths`: output width of every member, in fused order."""
        self.members = members
        self.A, self.Bt = A, Bt
        self.slot_base = slot_base
        self.columns: list[tuple[LoRABuffers, int]] = []  # targeted member, first output column
        col = 0
        for m, width in zip(members, widths, strict=True):
            if m is not None:
                self.columns.append((m, col))
            col += width
        self.width = col
        self._views: dict[
            tuple[int, int, int], tuple[torch.Tensor, list[tuple[torch.Tensor, int]]]
        ] = {}

    @classmethod
    def stacked_group(
        cls, slots: int, layers: int, rank: int, d_in: int, widths: list[int],
        targeted: list[bool], dtype: torch.dtype, device: torch.device, slot_base: int = 0,
    ) -> GroupBuffers:  # fmt: skip
        """`A [L, S, n·r, d_in]` (a slot's block holds the n targeted members' A rows back to
        back) and `Bt [L, Σ S·r·w]` (each targeted member's own `[S, r, w]` block per layer)."""
        n = sum(targeted)
        if n == 0:
            raise ValueError("a group buffer needs at least one targeted member")
        hit = [w for w, t in zip(widths, targeted, strict=True) if t]
        A = torch.zeros(layers, slots, n * rank, d_in, dtype=dtype, device=device)
        Bt = torch.zeros(layers, slots * rank * sum(hit), dtype=dtype, device=device)
        members: list[LoRABuffers | None] = []
        block = offset = 0
        for width, t in zip(widths, targeted, strict=True):
            if not t:
                members.append(None)
                continue
            size = slots * rank * width
            bt = Bt[:, offset : offset + size].unflatten(1, (slots, rank, width))
            member_a = A[:, :, block * rank : (block + 1) * rank]
            members.append(LoRABuffers(member_a, bt, True, slot_base))
            block += 1
            offset += size
        return cls(members, widths, A, Bt, slot_base)

    @property
    def stacked(self) -> bool:
        return self.A is not None

    @property
    def rank(self) -> int:
        """Rows of one slot's block: the members' ranks together (stacked) or one member's."""
        return self.A.shape[2] if self.A is not None else self.columns[0][0].rank

    @property
    def member_rank(self) -> int:
        return self.columns[0][0].rank

    @property
    def nbytes(self) -> int:
        if self.A is not None and self.Bt is not None:
            return (self.A.numel() + self.Bt.numel()) * self.A.element_size()
        return sum(m.nbytes for m, _ in self.columns)

    def slot_views(
        self, layer: int, first: int, count: int
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, int]]]:
        """Stacked: `A_flat [count·n·r, d_in]` of one layer's slot range and each targeted
        member's `Bt_flat [count·r, w]` with its first output column (views, made once)."""
        assert self.A is not None, "only the stacked group layout shares one A"
        key = (layer, first, count)
        views = self._views.get(key)
        if views is None:
            rows, row = count * self.member_rank, first - self.slot_base
            A = self.A[layer, row : row + count].reshape(count * self.rank, -1)
            pairs = [
                (m.B[layer, row : row + count].reshape(rows, -1), col) for m, col in self.columns
            ]
            views = self._views[key] = (A, pairs)
        return views

    def stacked_delta(
        self, y: torch.Tensor, x: torch.Tensor, layer: int, first: int, count: int, gate: SlotGate
    ) -> torch.Tensor:
        """`y` plus the stacked delta of `x` over slots first..first+count-1 of one layer
        (`LoRABuffers.stacked_delta`): one shrink for the group, one expand per member."""
        A, member_bt = self.slot_views(layer, first, count)
        return routed_lora_stacked_group(x, A, member_bt, self.member_rank, gate, y)

    def slot_rows(self, layer: int) -> tuple[torch.Tensor, list[tuple[torch.Tensor, int]]]:
        """Stacked: one layer's shared `A [S, n·r, d_in]` and each targeted member's
        `Bt [S, r, w]` with its first output column, every slot (the grouped kernel's view)."""
        assert self.A is not None, "only the stacked group layout shares one A"
        return self.A[layer], [(m.B[layer], col) for m, col in self.columns]

    def block_pair(self, layer: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`A_flat [count·n·r, d_in]` (a view) and the block-structured `Bt_flat [count·n·r, D]`
        (a copy: member i's rows are non-zero only in its own columns), for a one-GEMM expand
        on packed weights."""
        r = self.member_rank
        A, pairs = self.slot_views(layer, first, count)
        assert self.Bt is not None
        Bt = torch.zeros(count, self.rank, self.width, dtype=self.Bt.dtype, device=self.Bt.device)
        for i, (bt_flat, col) in enumerate(pairs):
            block = bt_flat.view(count, r, -1)
            Bt[:, i * r : (i + 1) * r, col : col + block.shape[-1]] = block
        return A, Bt.reshape(count * self.rank, self.width)
