"""One layer's learned top-k routing on CPU in one kernel call, from the gate's input.

Given the gate's input `x [T, d]` and one composition's gate `weight [n, d]`, `bias [n]` over its n
experts, a route is the logits `x Wᵀ + b`, each token's top-k experts and their softmax weights and
its `[T, W]` slot table (the experts' hot-set slots, zero-padded to W columns), which the grouped
LoRA delta (`kernels.cpu_topk_delta`) reads. In PyTorch that is about six small ops per decoder
layer whose dispatch outweighs their arithmetic at decode sizes; the C++ kernel
(`csrc/topk_route.cpp`) is one loop. It is built and verified like the panel GEMM
(`kernels.cpu_extension_build`) and called as a torch op that checks its tensors in C++; where it
cannot be built or the CPU lacks AVX2/FMA, `available()` is False (with a warning) and callers run
`topk_route_reference`, its twin. The kernel sums each logit in its own order (fp32 rounding apart
from `addmm`'s); ties between equal logits go to the lower expert index.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from kernels import registry
from kernels.cpu_kernel import CpuKernel

log = logging.getLogger(__name__)

SWITCH_ENV = registry.TOPK_ROUTE.switch_env
MAX_K = 64  # must equal MAX_K in the C++ source


@dataclass(frozen=True)
class Route:
    """A layer's routing of T tokens (see the module docstring)."""

    logits: torch.Tensor  # [T, n] fp32 gate logits, bias added, before temperature
    experts: torch.Tensor  # [T, k] int64 expert index within the composition
    weights: torch.Tensor  # [T, k] fp32, each row sums to 1
    slot_ids: torch.Tensor  # [T, W] int64 hot-set slots, 0 past k
    slot_weights: torch.Tensor  # [T, W] fp32, 0 past k


@dataclass(frozen=True)
class RouteTables:
    """Every layer's route of one step's T tokens, one `[L, T, ...]` buffer per field of
    `Route`: each layer is written in place (no allocation per layer) and the step's routing
    reads back whole, with no stacking of per-layer tensors. With `static`, the tokens whose
    `learned` flag is off keep their own route's rows (`static_ids`, `static_weights` `[T, W]`)
    in the slot table. With `stats`, the kernel also folds each layer's route statistics of the
    learned tokens into it (`route_stats_reference`'s columns). Made by `TopKRouter.tables`."""

    logits: torch.Tensor  # [L, T, n]
    experts: torch.Tensor  # [L, T, k]
    slot_ids: torch.Tensor  # [L, T, W]
    slot_weights: torch.Tensor  # [L, T, W]
    stats: torch.Tensor | None  # [L, columns] float64
    static: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # learned, ids, weights

    @classmethod
    def empty(
        cls, layers: int, tokens: int, n: int, k: int, width: int, stats_columns: int = 0,
        static: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> RouteTables:  # fmt: skip
        fields = (
            torch.empty(layers, tokens, n),
            torch.empty(layers, tokens, k, dtype=torch.long),
            torch.empty(layers, tokens, width, dtype=torch.long),
            torch.empty(layers, tokens, width),
        )
        stats = torch.zeros(layers, stats_columns, dtype=torch.float64) if stats_columns else None
        if static is not None:
            learned, ids, weights = static
            if learned.shape != (tokens,) or not ids.shape == weights.shape == (tokens, width):
                raise ValueError(f"static rows must be [{tokens}] and [{tokens}, {width}]")
            static = (  # as the op reads them
                learned.to("cpu", torch.uint8).contiguous(),
                ids.to("cpu", torch.long).contiguous(),
                weights.to("cpu", torch.float32).contiguous(),
            )
        return cls(*fields, stats, static)


def stats_columns(n: int, entropy_edges: int, top1_edges: int) -> int:
    """Columns of a route statistics row over n experts (`route_stats_reference`)."""
    return 3 + entropy_edges + top1_edges + 2 * n


def route_stats_reference(
    logits: torch.Tensor, top1_weight: torch.Tensor, selected: torch.Tensor, mask: torch.Tensor,
    entropy_edges: torch.Tensor, top1_edges: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Per layer, the route statistics of the tokens in `mask` `[T]`, from their tempered gate
    logits `[L, T, n]`, top-1 weights `[L, T]` and how often each selected each expert
    `[L, T, n]`: a float64 `[L, stats_columns(n, ...)]` of tokens, the sums of routing entropy
    (of the softmax over the n experts, over log n: 0 one-hot, 1 uniform, 0 with one expert) and
    of top-1 weight, their cumulative histograms (value <= each edge), then per expert the
    tokens that rank it first and the selections. The twin of the kernel's statistics, and the
    path of every step the kernel does not route."""
    L, _, n = logits.shape
    logp = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(logp.exp() * logp).nan_to_num(0.0).sum(-1)  # [L, T]
    entropy = entropy / math.log(n) if n > 1 else torch.zeros_like(entropy)
    m = mask.to(torch.float64)[None, :]  # [1, T]
    first = F.one_hot(logits.argmax(-1), n).to(torch.float64)  # [L, T, n]
    cols = [
        m.expand(L, -1).sum(1, keepdim=True),
        (entropy.double() * m).sum(1, keepdim=True),
        (top1_weight.double() * m).sum(1, keepdim=True),
        ((entropy[..., None] <= entropy_edges) * m[..., None]).sum(1),
        ((top1_weight[..., None] <= top1_edges) * m[..., None]).sum(1),
        (first * m[..., None]).sum(1),
        (selected.double() * m[..., None]).sum(1),
    ]
    return torch.cat(cols, dim=1)


KERNEL = CpuKernel.of(registry.TOPK_ROUTE)


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
    layer, top-k, temperature, the experts' slots and the slot table's width, and optionally
    the route statistics' histogram edges (fp32 `[E]`, `[W]`). Each call routes one layer's
    input `x [T, d]` on the kernel where it runs (a CPU input, no autograd, contiguous gates),
    else on `topk_route_reference`."""

    def __init__(
        self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor], k: int,
        temperature: float, expert_slots: torch.Tensor, width: int,
        stats_edges: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        for weight, bias in zip(weights, biases, strict=True):
            _check(weight, bias, k, expert_slots, width)
        self.stats_edges, self.columns = None, 0  # columns of a statistics row (0: none)
        if stats_edges is not None:
            ent, top1 = (e.detach().to("cpu", torch.float32).contiguous() for e in stats_edges)
            self.stats_edges = (ent, top1)
            self.columns = stats_columns(weights[0].shape[0] if weights else 0, len(ent), len(top1))
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
        if self.kernel:  # the op's own int64 copy of the slots and its edge arguments, made once
            self._slots = expert_slots.to(torch.long).contiguous()
            self._edges = self.stats_edges or (None, None)

    def __call__(self, layer: int, x: torch.Tensor) -> Route:
        _check_input(x, self.d)
        weight, bias = self.weights[layer], self.biases[layer]
        grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        if not (self.kernel and x.is_cpu) or grad:
            return topk_route_reference(
                x, weight, bias, self.k, self.temperature, self.expert_slots, self.width
            )
        one = RouteTables.empty(1, x.shape[0], self.n, self.k, self.width)
        KERNEL.ops().route_into.default(
            x.contiguous(), weight, bias, self.k, self.temperature, self._slots, 0, one.logits,
            one.experts, one.slot_ids, one.slot_weights, None, None, None, None, None, None,
        )  # fmt: skip
        slot_weights = one.slot_weights[0]
        return Route(one.logits[0], one.experts[0], slot_weights[:, : self.k], one.slot_ids[0],
                     slot_weights)  # fmt: skip

    def writes_in_place(self, x: torch.Tensor) -> bool:
        """Whether `route_into` takes input `x` (the kernel runs on it, without autograd)."""
        return self.kernel and x.is_cpu and not (torch.is_grad_enabled() and x.requires_grad)

    def tables(
        self, tokens: int,
        static: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> RouteTables:  # fmt: skip
        """Empty buffers for every layer's route of `tokens` tokens (and zeroed statistics
        where the router has edges); `static`: (learned [T] bool, slot ids, weights [T, W]) of
        a step that also has tokens on other routes."""
        L, n, k, width = len(self.weights), self.n, self.k, self.width
        return RouteTables.empty(L, tokens, n, k, width, self.columns, static)

    def route_into(self, layer: int, x: torch.Tensor, out: RouteTables) -> None:
        """`self(layer, x)` written into `out`'s rows of `layer` (where `writes_in_place(x)`).
        A decode step makes one call per layer, so the Python side only picks the layer's gate;
        the op checks x, the tables and the statistics against this router in C++."""
        if not (0 <= layer < len(self.weights) and self.writes_in_place(x)):
            raise ValueError(
                f"route_into takes a layer < {len(self.weights)}, a CPU input without autograd "
                f"and this router's `tables(T)`"
            )
        ent, top1 = self._edges
        static = out.static or (None, None, None)
        KERNEL.ops().route_into.default(
            x, self.weights[layer], self.biases[layer], self.k, self.temperature, self._slots,
            layer, out.logits, out.experts, out.slot_ids, out.slot_weights, out.stats, ent,
            top1, *static,
        )  # fmt: skip


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
