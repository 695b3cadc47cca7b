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
(`kernels.cpu_kernel`); where it cannot run, `available()` is False (with a warning) and callers
keep their PyTorch path. `topk_delta_reference` is its twin, on `kernels.reference`'s segmented
definition; `MOLORA_CPU_TOPK_DELTA=0` turns the kernel off.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.cpu_kernel import CpuKernel
from kernels.reference import routed_lora_segmented

SWITCH_ENV = "MOLORA_CPU_TOPK_DELTA"
DTYPES = (torch.float32, torch.bfloat16)
KERNEL = CpuKernel.from_csrc(
    "molora_topk_delta", "topk_delta.cpp", SWITCH_ENV, "CPU grouped top-k LoRA delta",
    "the LoRA delta runs the stacked PyTorch path",
)  # fmt: skip

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
    tensors in fp32 or bf16, no autograd), else on `topk_delta_reference`."""

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
        if self.kernel:  # address, slot stride, width, first column, first A row per member
            self._members = torch.tensor(
                [
                    [bt.data_ptr(), bt.stride(0), bt.shape[2], col, i * self.rank]
                    for i, (bt, col) in enumerate(members)
                ],
                dtype=torch.long,
            )
            self._lib = KERNEL.library()
            self._d_in, self._a_dtype = A.shape[2], 2 * (A.dtype != torch.float32)
            self._width = max(col + bt.shape[2] for bt, col in members)  # y's columns needed
            # the slot rows' arguments: A's address, slot stride, rows, slots, slot base, the
            # members' table, count and rank
            self._slots = (
                A.data_ptr(), A.stride(0), A.shape[1], A.shape[0], slot_base,
                self._members.data_ptr(), len(members), self.rank,
            )  # fmt: skip

    def __call__(
        self, y: torch.Tensor, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor,
        *, allow_avx512: bool = True,
    ) -> torch.Tensor:  # fmt: skip
        """`y` with the delta of `x` added (in place where the kernel runs).

        A decode step calls this once per projection with the same table, so the table's
        checks and conversions are made once per table (`_table_args`) and the rest of a
        call checks only what the kernel's pointers rely on."""
        A = self.A
        grad = torch.is_grad_enabled() and (
            x.requires_grad or weights.requires_grad or y.requires_grad
        )
        if grad or not self.kernel:
            _check_step(y, x, A, self.members, slot_ids, weights)
            return topk_delta_reference(y, x, A, self.members, slot_ids, weights, self.slot_base)
        table = _table_args(slot_ids, weights)
        xs, ys = x.shape, y.shape
        fits = (
            len(xs) == 2 and xs[1] == self._d_in and len(ys) == 2 and ys[0] == xs[0] == table[3]
            and ys[1] >= self._width and x.dtype in DTYPES and y.dtype in DTYPES and x.is_cpu
            and y.is_cpu and x.stride(1) == 1 and y.stride(1) == 1
        )  # fmt: skip
        if not fits:
            _check_step(y, x, A, self.members, slot_ids, weights)
            if not (x.dtype in DTYPES and y.dtype in DTYPES and x.is_cpu and y.is_cpu):
                return topk_delta_reference(
                    y, x, A, self.members, slot_ids, weights, self.slot_base
                )
            out = self(y.contiguous(), x.contiguous(), slot_ids, weights, allow_avx512=allow_avx512)
            return out if out is y else y.copy_(out)
        dtypes = (x.dtype != torch.float32) + self._a_dtype + 4 * (y.dtype != torch.float32)
        bad = self._lib.topk_delta(
            x.data_ptr(), x.stride(0), xs[1], xs[0], table[0], table[1], table[2], *self._slots,
            y.data_ptr(), y.stride(0), dtypes, torch.get_num_threads(), allow_avx512,
        )  # fmt: skip
        if bad:
            raise ValueError(
                f"a slot id lies outside {self.slot_base}..{self.slot_base + A.shape[0] - 1}"
            )
        return y


# the last table `_table_args` prepared: (slot_ids, weights, its arguments), or None; one
# element, replaced whole, so a reader on another thread sees either table or none
_LAST_TABLE: list[tuple[torch.Tensor, torch.Tensor, tuple] | None] = [None]


def _table_args(slot_ids: torch.Tensor, weights: torch.Tensor) -> tuple:
    """A routing table's kernel arguments (ids address, weights address, W, T, and the
    converted tensors, kept alive with them), prepared once for the projections that share it
    (kept only where no conversion was needed, so the kernel reads the table itself)."""
    last = _LAST_TABLE[0]
    if last is not None and last[0] is slot_ids and last[1] is weights:
        return last[2]
    T = slot_ids.shape[0] if slot_ids.dim() == 2 else -1
    if slot_ids.dim() != 2 or slot_ids.shape != weights.shape or not slot_ids.is_cpu:
        raise ValueError(
            f"slot_ids and weights must both be CPU [T, W], got {tuple(slot_ids.shape)} and "
            f"{tuple(weights.shape)}"
        )
    ids = slot_ids.to(torch.long).contiguous()
    w = weights.to("cpu", torch.float32).contiguous()
    args = (ids.data_ptr(), w.data_ptr(), ids.shape[1], T, ids, w)
    _LAST_TABLE[0] = (slot_ids, weights, args) if ids is slot_ids and w is weights else None
    return args


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
