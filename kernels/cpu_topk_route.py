"""One layer's learned top-k routing on CPU in one kernel call, from the gate's input.

Given the gate's input `x [T, d]` and one composition's gate `weight [n, d]`, `bias [n]` over
its n experts, a route is the logits `x Wᵀ + b`, each token's top-k experts and their softmax
weights and its `[T, W]` slot table (the experts' hot-set slots, zero-padded to W columns), which
the grouped LoRA delta (`kernels.cpu_topk_delta`) reads. In PyTorch that is about six small ops
per decoder layer whose dispatch outweighs their arithmetic at decode sizes; the C++ kernel
(`csrc/topk_route.cpp`) is one loop.
It is built and verified like the panel GEMM (`kernels.cpu_extension_build`); where it cannot
be built or the CPU lacks AVX2/FMA, `available()` is False (with a warning) and callers run
`topk_route_reference`, its twin. The kernel sums each logit in its own order (fp32 rounding
apart from `addmm`'s); ties between equal logits go to the lower expert index.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from kernels.cpu_kernel import CpuKernel

log = logging.getLogger(__name__)

SWITCH_ENV = "MOLORA_CPU_TOPK_ROUTE"
MAX_K = 64  # must equal MAX_K in the C++ source


@dataclass(frozen=True)
class Route:
    """A layer's routing of T tokens (see the module docstring)."""

    logits: torch.Tensor  # [T, n] fp32 gate logits, bias added, before temperature
    experts: torch.Tensor  # [T, k] int64 expert index within the composition
    weights: torch.Tensor  # [T, k] fp32, each row sums to 1
    slot_ids: torch.Tensor  # [T, W] int64 hot-set slots, 0 past k
    slot_weights: torch.Tensor  # [T, W] fp32, 0 past k


KERNEL = CpuKernel.from_csrc(
    "molora_topk_route", "topk_route.cpp", SWITCH_ENV, "CPU top-k route",
    "the gate runs PyTorch ops", cflags=("-O3", "-mavx2", "-mfma"),
)  # fmt: skip


def available() -> bool:
    """Whether the kernel is on and runs here (builds the library on the first call;
    `MOLORA_CPU_TOPK_ROUTE=0` turns it off)."""
    return KERNEL.available()


def _check(
    weight: torch.Tensor, bias: torch.Tensor, k: int, expert_slots: torch.Tensor, width: int
) -> None:
    if weight.dtype != torch.float32 or bias.dtype != torch.float32:
        raise ValueError(f"the gate must be fp32, got {weight.dtype}/{bias.dtype}")
    n = weight.shape[0]
    if weight.dim() != 2 or bias.shape != (n,):
        raise ValueError(
            f"weight [n, d] and bias [n] do not agree: {tuple(weight.shape)}, {tuple(bias.shape)}"
        )
    if not 1 <= k <= min(n, width, MAX_K):
        raise ValueError(f"top_k={k} must lie in 1..min(experts={n}, width={width}, {MAX_K})")
    if expert_slots.shape != (n,):
        raise ValueError(f"expert_slots must be [{n}], got {tuple(expert_slots.shape)}")


def _check_input(x: torch.Tensor, d: int) -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != d:
        raise ValueError(f"x must be fp32 [T, {d}], got {x.dtype} {tuple(x.shape)}")


class TopKRouter:
    """One composition's routing, checked once: a gate `weight [n, d]` and `bias [n]` per
    layer, top-k, temperature, the experts' slots and the slot table's width. Each call routes one layer's input `x [T, d]` on the kernel where it
    runs (a CPU input, no autograd, contiguous gates), else on `topk_route_reference`."""

    def __init__(
        self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor], k: int,
        temperature: float, expert_slots: torch.Tensor, width: int,
    ) -> None:  # fmt: skip
        for weight, bias in zip(weights, biases, strict=True):
            _check(weight, bias, k, expert_slots, width)
        self.weights, self.biases = list(weights), list(biases)
        self.k, self.temperature, self.width = k, float(temperature), width
        self.expert_slots = expert_slots
        self.n, self.d = weights[0].shape if weights else (0, 0)
        gates = (*self.weights, *self.biases)
        self.kernel = (
            all(t.is_cpu and t.is_contiguous() for t in gates)
            and expert_slots.is_cpu
            and available()
        )
        if self.kernel:  # the kernel's own int64 copy, made once
            self._slots = expert_slots.to(torch.long).contiguous()

    def __call__(self, layer: int, x: torch.Tensor) -> Route:
        _check_input(x, self.d)
        weight, bias = self.weights[layer], self.biases[layer]
        grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        if not (self.kernel and x.is_cpu) or grad:
            return topk_route_reference(
                x, weight, bias, self.k, self.temperature, self.expert_slots, self.width
            )
        lib = KERNEL.library()
        assert lib is not None
        x = x.contiguous()
        T, k, width = x.shape[0], self.k, self.width
        logits = torch.empty(T, self.n)
        experts = torch.empty(T, k, dtype=torch.long)
        slot_ids = torch.empty(T, width, dtype=torch.long)
        slot_weights = torch.empty(T, width)
        bad = lib.route_fp32(
            x.data_ptr(), self.d, weight.data_ptr(), bias.data_ptr(), logits.data_ptr(), T,
            self.n, k, self.temperature, self._slots.data_ptr(), slot_ids.data_ptr(),
            slot_weights.data_ptr(), width, experts.data_ptr(),
        )  # fmt: skip
        if bad:  # _check refused such a k at construction
            raise ValueError(f"top_k={k} does not fit {self.n} experts and width {width}")
        return Route(logits, experts, slot_weights[:, :k], slot_ids, slot_weights)


def topk_route(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, temperature: float,
    expert_slots: torch.Tensor, width: int,
) -> Route:  # fmt: skip
    """One layer through a one-layer `TopKRouter`: the kernel on CPU where it runs."""
    return TopKRouter([weight], [bias], k, temperature, expert_slots, width)(0, x)


def topk_route_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, temperature: float,
    expert_slots: torch.Tensor, width: int,
) -> Route:  # fmt: skip
    """The twin in PyTorch ops, on any device: the logits by `addmm`, top-k of
    `logits / temperature`, a softmax over the k values (top-1: an argmax and weight 1) and the
    slot table."""
    _check(weight, bias, k, expert_slots, width)
    _check_input(x, weight.shape[1])
    logits = torch.addmm(bias, x, weight.t())
    T = logits.shape[0]
    if k == 1:  # argmax is unchanged by a positive temperature, and one weight is 1
        experts = logits.argmax(dim=-1, keepdim=True)
        weights = torch.ones(T, 1, device=logits.device)
    else:
        scaled = logits if temperature == 1.0 else logits / temperature
        vals, experts = torch.topk(scaled, k, dim=-1)
        weights = torch.softmax(vals, dim=-1)
    slot_ids = F.pad(expert_slots[experts], (0, width - k))
    slot_weights = F.pad(weights, (0, width - k))
    return Route(logits, experts, weights, slot_ids, slot_weights)


if __name__ == "__main__":  # build ahead: `make models`, the image
    raise SystemExit(KERNEL.build_ahead())
