"""Plain-PyTorch reference implementations of the routed-LoRA op (the correctness twins).

Every function here computes exactly the same thing,

    delta[t] = Σ_j  weights[t, j] · B[s] @ (A[s] @ x[t]),   s = slot_ids[t, j],  skipped if s <= 0,

in fp32 and returns it in `x.dtype`. They differ only in how the work is laid out, which decides
their speed on a given device and token count (see `python -m benchmarks.kernels`). All of them are
differentiable w.r.t. `x`, `weights`, `A` and `B`, because learned-router training
backpropagates through the op into the gate weights. `A`/`B` may be strided views
(`A_buf[:, layer]`); nothing here assumes contiguity. They also never rely on slot 0 being the
all-zero slot: ids <= 0 are skipped explicitly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.plan import build_segment_plan, routed_lora_planned

RoutedLoRAFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


def _active_weights(slot_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """fp32 weights with inactive (id <= 0) entries zeroed, keeping the autograd graph."""
    return torch.where(slot_ids > 0, weights.float(), torch.zeros((), device=weights.device))


def routed_lora_dense(
    x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Obvious per-(token, j) loop in fp32: slow, but the definition every variant is held to."""
    T, k = slot_ids.shape
    xf = x.float()
    rows = []
    ids = slot_ids.tolist()
    for t in range(T):
        row = torch.zeros(B.shape[1], dtype=torch.float32, device=x.device)
        for j in range(k):
            s = ids[t][j]
            if s <= 0:
                continue
            row = row + weights[t, j].float() * (B[s].float() @ (A[s].float() @ xf[t]))
        rows.append(row)
    if not rows:
        return torch.zeros(0, B.shape[1], dtype=x.dtype, device=x.device)
    return torch.stack(rows).to(x.dtype)


def routed_lora_segmented(
    x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Group (token, j) pairs by slot and run two small GEMMs per used slot (SGMV twin).

    The grouping is the per-step segment plan, built here per call; the engine builds it once
    per routing table and reuses it across projections (`kernels.plan`).
    """
    return routed_lora_planned(x, A, B, build_segment_plan(slot_ids, weights))


def routed_lora_masked(
    x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Per used slot, run the LoRA on all T tokens and scale rows by that slot's summed weight.

    No gathers or scatters: wasteful in flops when many slots are used, but each step is a plain
    GEMM, which makes it fast on CPU at small T.
    """
    w = _active_weights(slot_ids, weights)
    xf = x.float()
    out = torch.zeros(x.shape[0], B.shape[1], dtype=torch.float32, device=x.device)
    for s in torch.unique(slot_ids[slot_ids > 0]).tolist():
        coef = (w * (slot_ids == s)).sum(dim=1, keepdim=True)
        out += coef * ((xf @ A[s].float().t()) @ B[s].float().t())
    return out.to(x.dtype)


def routed_lora_onehot(
    x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """All slots as one wide LoRA of rank S·r, gated per token by a [T, S] weight matrix.

    Two GEMMs regardless of routing: h = x A_allᵀ [T, S·r], scaled by the one-hot weights,
    then h B_allᵀ. Costs S× the flops of one adapter, with no data-dependent control flow.
    """
    S, r, d_in = A.shape
    d_out = B.shape[1]
    w = _active_weights(slot_ids, weights)
    gate = torch.zeros(x.shape[0], S, dtype=torch.float32, device=x.device)
    gate = gate.scatter_add(1, slot_ids.clamp(min=0).long(), w)
    a_all = A.float().reshape(S * r, d_in)
    b_all = B.float().permute(1, 0, 2).reshape(d_out, S * r)
    h = (x.float() @ a_all.t()).view(-1, S, r) * gate[:, :, None]
    return (h.reshape(-1, S * r) @ b_all.t()).to(x.dtype)


def routed_lora_gather(
    x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Gather each token's adapter matrices and batch-multiply (BGMV twin).

    Materialises [T, k, r, d] copies of the weights, so it is memory-bound and slow on CPU; it
    is kept because it is the exact data-flow of the per-token Triton decode kernel.
    """
    w = _active_weights(slot_ids, weights)
    idx = slot_ids.clamp(min=0).long()
    a_g = A[idx].float()  # [T, k, r, d_in]
    b_g = B[idx].float()  # [T, k, d_out, r]
    h = torch.einsum("tkrd,td->tkr", a_g, x.float()) * w[:, :, None]
    return torch.einsum("tkor,tkr->to", b_g, h).to(x.dtype)


REFERENCE_VARIANTS: dict[str, RoutedLoRAFn] = {
    "dense": routed_lora_dense,
    "segmented": routed_lora_segmented,
    "masked": routed_lora_masked,
    "onehot": routed_lora_onehot,
    "gather": routed_lora_gather,
}
