"""Chooses the routed-LoRA implementation for the device, token count and autograd need.

CUDA without autograd → Triton kernels (BGMV for decode-sized batches, SGMV for prefill).
CPU, or any call that must backpropagate (learned-router training) → the fastest PyTorch
reference twin for the token count. Triton is imported lazily, only for CUDA inputs or when
asked for explicitly (`backend="triton"`, e.g. under `TRITON_INTERPRET=1`), so importing
`kernels` never imports triton.
"""

from __future__ import annotations

import os

import torch

from kernels.device_plan import DevicePlan
from kernels.plan import SegmentPlan, routed_lora_planned
from kernels.reference import REFERENCE_VARIANTS

# CPU choice by token count T and buffer slots S (incl. the zero slot), from
# `python -m benchmarks.kernels --quick` on the shared 2-core dev box, 1 thread, d=1024, r=16
# (benchmarks/results/kernels_cpu_quick.json, "best_reference_by_T"): masked wins at T=1 for
# every S (plain GEMVs, no index ops); one-hot (two GEMMs of width S·r) wins for T <= 32 when
# S is small, but its S× flops lose to segmented beyond that; segmented (sorted, one GEMM pair
# per used slot) wins from T=64 on and for large S. Ties within ~10% are noise on that box.
CPU_MASKED_MAX_T = 4
CPU_ONEHOT_MAX_T = 32
CPU_ONEHOT_MAX_SLOTS = 8
# The stacked layout (`kernels.stacked`) computes every slot in a range for every token: two
# GEMMs of width count·r. On CPU at serving sizes a step is bound by per-op overhead, so that
# beats per-slot grouping until the range is a sizeable fraction of a projection's width
# (SmolLM2's narrowest is 192); past this many columns the segment plan takes over.
CPU_STACKED_MAX_COLUMNS = 256
# Differentiable path on CUDA: two GEMMs and no host syncs.
CUDA_GRAD_VARIANT = "onehot"

BACKEND_ENV = "MOLORA_KERNEL_BACKEND"
BACKENDS = ("auto", "triton", *REFERENCE_VARIANTS)


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def select_backend(
    x: torch.Tensor, num_slots: int, tensors: tuple[torch.Tensor, ...], backend: str | None
) -> str:
    """Name of the implementation to run: 'triton' or a key of REFERENCE_VARIANTS."""
    backend = backend or os.environ.get(BACKEND_ENV, "auto")
    if backend not in BACKENDS:
        raise ValueError(f"unknown routed-LoRA backend {backend!r}; expected one of {BACKENDS}")
    if backend != "auto":
        return backend
    if x.is_cuda:
        return CUDA_GRAD_VARIANT if _needs_grad(x, *tensors) else "triton"
    return cpu_variant(x.shape[0], num_slots)


def cpu_variant(T: int, num_slots: int) -> str:
    """Fastest reference variant on CPU for T tokens over `num_slots` buffer slots."""
    if T <= CPU_MASKED_MAX_T:
        return "masked"
    if T <= CPU_ONEHOT_MAX_T and num_slots <= CPU_ONEHOT_MAX_SLOTS:
        return "onehot"
    return "segmented"


def stacked_is_cheaper(num_slots: int, rank: int) -> bool:
    """Whether the stacked two-GEMM delta over `num_slots` slots of rank `rank` should run."""
    return num_slots * rank <= CPU_STACKED_MAX_COLUMNS


def _check_triton_device(x: torch.Tensor) -> None:
    """Triton runs CUDA tensors, or CPU tensors only under the interpreter."""
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "backend 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton import"
        )


def routed_lora(
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    *,
    backend: str | None = None,
    plan: SegmentPlan | None = None,
    meta: DevicePlan | None = None,
) -> torch.Tensor:
    """Return the routed LoRA delta [T, d_out] for x [T, d_in]; see the package docstring.

    `plan` (from `kernels.plan.build_segment_plan(slot_ids, weights)`, built once per routing
    table) lets the CPU path skip re-sorting tokens by slot in every projection; `meta`
    (`kernels.device_plan.build_device_plan`) does the same for the Triton path.
    """
    if plan is not None and not x.is_cuda and backend is None:
        return routed_lora_planned(x, A, B, plan)
    name = select_backend(x, A.shape[0], (A, B, weights), backend)
    if name == "triton":
        _check_triton_device(x)
        from kernels.triton_ops import routed_lora_triton

        return routed_lora_triton(x, A, B, slot_ids, weights, plan=meta)
    return REFERENCE_VARIANTS[name](x, A, B, slot_ids, weights)


def routed_lora_multi(
    x: torch.Tensor,
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    *,
    backend: str | None = None,
    plan: SegmentPlan | None = None,
    meta: DevicePlan | None = None,
) -> list[torch.Tensor]:
    """Deltas for several projections sharing x and routing (fused q/k/v, gate/up).

    On CUDA the shrinks (and expands) of up to three outputs run as one launch each, reading
    `meta` when the caller built it once per table; the reference path simply loops (over the
    prebuilt CPU `plan` when given).
    """
    if plan is not None and not x.is_cuda and backend is None:
        return [routed_lora_planned(x, A, B, plan) for A, B in pairs]
    flat = tuple(t for pair in pairs for t in pair)
    name = select_backend(x, pairs[0][0].shape[0], (*flat, weights), backend)
    if name == "triton":
        _check_triton_device(x)
        from kernels.triton_ops import routed_lora_multi_triton

        return routed_lora_multi_triton(x, pairs, slot_ids, weights, plan=meta)
    fn = REFERENCE_VARIANTS[name]
    return [fn(x, A, B, slot_ids, weights) for A, B in pairs]
