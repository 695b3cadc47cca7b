"""Triton entry points: choose decode (BGMV) or prefill (SGMV) kernels and group outputs.

Loaded lazily by the runtime's LoRA backend (never at `import kernels`). On CUDA tensors the kernels are
compiled; on CPU tensors they only run when `TRITON_INTERPRET=1` was set before triton was
imported (the tests do that). No backward: the backend sends autograd calls to the reference twin.
"""

from __future__ import annotations

import torch

from kernels.device_plan import DevicePlan, build_device_plan
from kernels.triton_bgmv import bgmv
from kernels.triton_common import MAX_OUTPUTS, MAX_RANK, GroupLaunch
from kernels.triton_sgmv import sgmv

# Up to this many (token, j) pairs the per-pair gather kernels win: each pair is one program and
# small batches need split-K to fill the GPU, while SGMV tiles need >= 16 tokens per slot to pay.
# Provisional until the first GPU run of `python -m benchmarks.kernels` (benchmarks/results/*cuda*.json).
DECODE_MAX_PAIRS = 128

MODES = ("auto", "bgmv", "sgmv")


def _check(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slot_ids: torch.Tensor) -> None:
    if x.dim() != 2 or A.dim() != 3 or B.dim() != 3 or slot_ids.dim() != 2:
        raise ValueError("expected x [T, d_in], A [S, r, d_in], B [S, d_out, r], slot_ids [T, k]")
    if A.shape[2] != x.shape[1] or B.shape[2] != A.shape[1] or B.shape[0] != A.shape[0]:
        raise ValueError(f"shape mismatch: x {x.shape}, A {A.shape}, B {B.shape}")
    if A.dtype != x.dtype or B.dtype != x.dtype:
        raise ValueError(f"dtype mismatch: x {x.dtype}, A {A.dtype}, B {B.dtype}")
    if A.shape[1] > MAX_RANK:
        raise ValueError(f"rank {A.shape[1]} exceeds {MAX_RANK}")


def routed_lora_multi_triton(
    x: torch.Tensor,
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    mode: str = "auto",
    plan: DevicePlan | None = None,
) -> list[torch.Tensor]:
    """Deltas for several (A, B) sharing x and the routing; one shrink+expand per 3 outputs.

    `plan` (`kernels.device_plan.build_device_plan(slot_ids, weights)`, cached per routing
    table by the caller) skips rebuilding the int32 ids and SGMV segments in every projection.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    for A, B in pairs:
        _check(x, A, B, slot_ids)
    if len({A.shape[1] for A, _ in pairs}) != 1:
        raise ValueError("fused outputs must share the (padded) rank")
    T, K = slot_ids.shape
    outs = [torch.empty(T, B.shape[1], dtype=x.dtype, device=x.device) for _, B in pairs]
    if T == 0 or K == 0:
        return [o.zero_() for o in outs]
    if plan is None:
        plan = build_device_plan(slot_ids, weights)
    ids, w = plan.slot_ids, plan.weights
    if mode == "auto":
        mode = "bgmv" if T * K <= DECODE_MAX_PAIRS else "sgmv"
    for i in range(0, len(pairs), MAX_OUTPUTS):
        group = pairs[i : i + MAX_OUTPUTS]
        As, Bs = [a for a, _ in group], [b for _, b in group]
        launch = GroupLaunch(x, As, Bs, ids, w, outs[i : i + MAX_OUTPUTS])
        if mode == "bgmv":
            bgmv(launch)
        else:
            sgmv(launch, groups=plan.groups(As[0].shape[0]))
    return outs


def routed_lora_triton(
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    mode: str = "auto",
    plan: DevicePlan | None = None,
) -> torch.Tensor:
    """Routed LoRA delta [T, d_out] in x.dtype via the Triton kernels (fp32 accumulation)."""
    return routed_lora_multi_triton(x, [(A, B)], slot_ids, weights, mode, plan)[0]
