"""The routed LoRA delta on CPU over each token's own slots, grouped by slot, in one kernel call.

For a projection (or a fused group of n members sharing one shrink) and one layer's slot rows
`A [S, n·r, d_in]`, each member's `Bt [S, r, w]` and its first output column, a call adds

    y[t, member columns] += Σ_j w[t, j] · (x[t] A_m[s]ᵀ) Bt_m[s],   s = slot_ids[t, j] - slot_base

for the step's `[T, W]` table (ids <= 0 and zero weights add nothing; scales are folded into the
slots). The stacked delta (`kernels.stacked`) multiplies every token by every slot of the step's
range; under a learned top-k that is S/k times the work. The C++ kernel (`csrc/topk_delta.cpp`)
sorts the (token, slot) pairs by slot, reads each used slot once for all its tokens and sums a
token's slots in fp32 before adding to `y` once; AVX-512F tiles where the CPU has them, else
AVX2/FMA; fp32 or bf16 `x`, slots and `y`. It is built and verified like the other CPU kernels
(`kernels.cpu_kernel`) and called as a torch op that checks its tensors in C++; where it cannot run,
`available()` is False (with a warning) and callers keep their PyTorch path. `topk_delta_reference`
is its twin, on `kernels.reference`'s segmented definition; `MOLORA_CPU_TOPK_DELTA=0` turns the
kernel off.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels import registry
from kernels.cpu_kernel import CpuKernel
from kernels.reference import routed_lora_segmented

SWITCH_ENV = registry.TOPK_DELTA.switch_env
DTYPES = (torch.float32, torch.bfloat16)
KERNEL = CpuKernel.of(registry.TOPK_DELTA)

Members = Sequence[tuple[torch.Tensor, int]]  # each member's `Bt [S, r, w]` and first column


def available() -> bool:
    """Whether the kernel is on and runs here (builds the library on the first call)."""
    return KERNEL.available()


def has_avx512() -> bool:
    """Whether the loaded kernel runs AVX-512 tiles on this CPU."""
    lib = KERNEL.library()
    return bool(lib is not None and lib.has_avx512())


def _check_slots(A: torch.Tensor, members: Members) -> int:
    """The members' rank, once `A` and every `Bt` agree on slots, rank, dtype and device."""
    if A.dim() != 3 or not A.is_floating_point() or not members:
        raise ValueError(f"A must be floating [S, n·r, d_in] with members, got {tuple(A.shape)}")
    rank = members[0][0].shape[1]
    if A.shape[1] != rank * len(members):
        raise ValueError(f"A has {A.shape[1]} rows per slot, {len(members)} members of rank {rank}")
    for bt, col in members:
        if bt.dim() != 3 or bt.shape[:2] != (A.shape[0], rank) or col < 0:
            raise ValueError(f"Bt must be [{A.shape[0]}, {rank}, w], got {tuple(bt.shape)}")
        if bt.dtype != A.dtype or bt.device != A.device:
            raise ValueError("every Bt must share A's dtype and device")
    return rank


def _check_step(
    y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, members: Members,
    slot_ids: torch.Tensor, weights: torch.Tensor,
) -> None:  # fmt: skip
    T = x.shape[0]
    if x.dim() != 2 or x.shape[1] != A.shape[2] or not x.is_floating_point():
        raise ValueError(f"x must be floating [T, {A.shape[2]}], got {x.dtype} {tuple(x.shape)}")
    if y.dim() != 2 or y.shape[0] != T or not y.is_floating_point():
        raise ValueError(f"y must be floating [{T}, D], got {y.dtype} {tuple(y.shape)}")
    if any(col + bt.shape[2] > y.shape[1] for bt, col in members):
        raise ValueError(f"a member's columns lie past y's {y.shape[1]}")
    if slot_ids.dim() != 2 or slot_ids.shape != weights.shape or slot_ids.shape[0] != T:
        raise ValueError(
            f"slot_ids and weights must both be [{T}, W], got {tuple(slot_ids.shape)} and "
            f"{tuple(weights.shape)}"
        )


class GroupedDelta:
    """One layer's slot buffers, checked once: `A [S, n·r, d_in]` (member i's rows at i·r),
    each member's `Bt [S, r, w]` and first output column, slot id of row 0 `slot_base`. Each
    call adds the routed delta of one step into `y` in place, on the kernel where it runs (CPU
    tensors in fp32 or bf16 with contiguous slot rows, no autograd), else on
    `topk_delta_reference`."""

    def __init__(self, A: torch.Tensor, members: Members, slot_base: int = 0) -> None:
        self.rank = _check_slots(A, members)
        self.A, self.members, self.slot_base = A, list(members), slot_base
        self.kernel = (
            A.is_cpu
            and A.dtype in DTYPES
            and A.stride(2) == 1
            and A.stride(1) == A.shape[2]
            and all(bt.stride(2) == 1 and bt.stride(1) == bt.shape[2] for bt, _ in members)
            and available()
        )
        # the op's member arguments, made once
        self._bts = [bt for bt, _ in members]
        self._cols = [col for _, col in members]

    def __call__(
        self, y: torch.Tensor, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor,
        *, allow_avx512: bool = True,
    ) -> torch.Tensor:  # fmt: skip
        """`y` with the delta of `x` added (in place where the kernel runs). The op checks
        every tensor (ValueError: shapes, dtypes, layout, an id outside the slot rows); a
        decode step calls this once per projection with the same table, whose conversions
        are made once per table (`_table`)."""
        grad = torch.is_grad_enabled() and (
            x.requires_grad or weights.requires_grad or y.requires_grad
        )
        kernel = self.kernel and x.is_cpu and y.is_cpu and x.dtype in DTYPES and y.dtype in DTYPES
        if grad or not kernel:
            _check_step(y, x, self.A, self.members, slot_ids, weights)
            return topk_delta_reference(
                y, x, self.A, self.members, slot_ids, weights, self.slot_base
            )
        ids, w = _table(slot_ids, weights)
        xs = x if x.stride(-1) == 1 else x.contiguous()  # the kernel reads unit-stride rows
        ys = y if y.stride(-1) == 1 else y.contiguous()
        KERNEL.ops().topk_delta.default(
            xs, ids, w, self.A, self._bts, self._cols, self.slot_base, ys, allow_avx512
        )
        return y if ys is y else y.copy_(ys)


# the last table `_table` prepared: (slot_ids, weights, the op's copies), or None; one element,
# replaced whole, so a reader on another thread sees either table or none
_LAST_TABLE: list[tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None] = [
    None
]


def _table(slot_ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A routing table as the op takes it (int64 ids, fp32 weights, contiguous), prepared once
    for the projections that share it (kept only where no conversion was needed, so the kernel
    reads the table itself)."""
    last = _LAST_TABLE[0]
    if last is not None and last[0] is slot_ids and last[1] is weights:
        return last[2]
    ids = slot_ids.to(torch.long).contiguous()
    w = weights.to("cpu", torch.float32).contiguous()
    _LAST_TABLE[0] = (slot_ids, weights, (ids, w)) if ids is slot_ids and w is weights else None
    return ids, w


def topk_delta_reference(
    y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, members: Members,
    slot_ids: torch.Tensor, weights: torch.Tensor, slot_base: int = 0,
) -> torch.Tensor:  # fmt: skip
    """The twin: per member, `kernels.reference.routed_lora_segmented` in fp32 over the slot
    rows (ids shifted by `slot_base`; row 0 of a zero-based buffer is the no-adapter slot),
    added to `y`'s columns and rounded once. Differentiable; in place unless autograd needs."""
    rank = _check_slots(A, members)
    _check_step(y, x, A, members, slot_ids, weights)
    rows = A.shape[0]
    ids = slot_ids.long()
    valid = (ids > 0) & (weights != 0)
    if bool(((ids - slot_base < 0) | (ids - slot_base >= rows))[valid].any()):
        raise ValueError(f"a slot id lies outside {slot_base}..{slot_base + rows - 1}")
    # the segmented twin reads row s for id s and skips ids <= 0: slot row r becomes id r + 1
    # of the slots behind one zero row, and ids are kept only where they add something
    zero = torch.zeros((), dtype=ids.dtype, device=ids.device)
    local = torch.where(valid, ids - slot_base + 1, zero)
    out = y.float() if torch.is_grad_enabled() and y.requires_grad else None
    deltas = []
    for i, (bt, col) in enumerate(members):
        a = A[:, i * rank : (i + 1) * rank]
        b = bt.transpose(1, 2)
        a = torch.cat([a.new_zeros(1, *a.shape[1:]), a])
        b = torch.cat([b.new_zeros(1, *b.shape[1:]), b])
        deltas.append((col, routed_lora_segmented(x.float(), a, b, local, weights)))
    if out is not None:
        for col, delta in deltas:
            out = out.index_add(1, torch.arange(col, col + delta.shape[1]), delta)
        return out.to(y.dtype)
    for col, delta in deltas:
        block = y[:, col : col + delta.shape[1]]
        block.copy_(block.float() + delta)
    return y


if __name__ == "__main__":  # build ahead: `make models`, the image
    raise SystemExit(KERNEL.build_ahead())
