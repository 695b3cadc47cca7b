"""Plain-PyTorch reference implementations of the routed-LoRA op (the correctness twins).

Every function here computes exactly the same thing,

    delta[t] = Σ_j  weights[t, j] · B[s] @ (A[s] @ x[t]),   s = slot_ids[t, j],  skipped if s <= 0,

in fp32 and returns it in `x.dtype`: `dense` is the definition, `segmented` and `gather` are the
data flow of the SGMV and BGMV Triton kernels (their twins; `segmented` is also the
differentiable path the LoRA backend takes under autograd). All of them are
differentiable w.r.t. `x`, `weights`, `A` and `B`, because learned-router training
backpropagates through the op into the gate weights. `A`/`B` may be strided views
(`A_buf[:, layer]`); nothing here assumes contiguity. They also never rely on slot 0 being the
all-zero slot: ids <= 0 are skipped explicitly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

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

    Each slot reads only the rows that use it, so it is also the differentiable path (router
    training): autograd flows into x, the weights, A and B.
    """
    out = torch.zeros(x.shape[0], B.shape[1], dtype=torch.float32, device=x.device)
    k = slot_ids.shape[1]
    flat = slot_ids.reshape(-1)
    w = weights.reshape(-1).float()
    for s in torch.unique(flat[flat > 0]).tolist():
        pairs = torch.nonzero(flat == s).squeeze(1)
        rows = pairs // k
        ys = (x.index_select(0, rows).float() @ A[s].float().t()) @ B[s].float().t()
        out = out.index_add(0, rows, ys * w[pairs, None])
    return out.to(x.dtype)


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
    "gather": routed_lora_gather,
}
