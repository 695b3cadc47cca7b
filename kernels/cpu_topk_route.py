"""One layer's learned top-k routing on CPU in one kernel call, from the gate's input.

Given the gate's input `x [T, d]` and one composition's gate `weight [n, d]`, `bias [n]` over
its n experts, a route is the logits `x Wᵀ + b`, each token's top-k experts and their softmax
weights, its `[T, W]` slot table (the experts' hot-set slots,
zero-padded to W columns) and, for the stacked LoRA delta, the per-token weight of every slot of
the stacked range expanded to each buffer rank in `ranks` (one `[T, Σ count·rank]` block table
and where it is 0). In PyTorch that is about nine small ops per decoder layer whose dispatch
outweighs their arithmetic at decode sizes; the C++ kernel (`csrc/topk_route.cpp`) is one loop.
It is built and verified like the panel GEMM (`kernels.cpu_extension_build`); where it cannot
be built or the CPU lacks AVX2/FMA, `available()` is False (with a warning) and callers run
`topk_route_reference`, its twin. The kernel sums each logit in its own order (fp32 rounding
apart from `addmm`'s); ties between equal logits go to the lower expert index.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch.nn import functional as F

from kernels import cpu_extension_build, cpu_panel_gemm
from kernels.cpu_extension_build import ExtensionSpec

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "topk_route.cpp"
SPEC = ExtensionSpec(name="molora_topk_route", source=SOURCE, cflags=("-O3", "-mavx2", "-mfma"))
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
    rows: torch.Tensor  # [T, Σ count·rank] fp32 rank-expanded weight of each stacked slot
    inactive: torch.Tensor  # [T, Σ count·rank] bool, rows == 0


def build() -> ModuleType:
    """The kernel's extension module: the verified cached build, else a fresh one. Raises
    RuntimeError with the reason (no compiler, no ninja, the compiler's output)."""
    if cpu_panel_gemm.compiler() is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    return cpu_extension_build.load(SPEC)


_extension = cpu_extension_build.LazyExtension(
    lambda: build(), "CPU top-k route kernel unavailable, the gate runs PyTorch ops", log
)


def available() -> bool:
    """Whether the kernel is on and runs here (builds the library on the first call)."""
    if os.environ.get(SWITCH_ENV, "1") == "0" or not cpu_panel_gemm.cpu_supported():
        return False
    return _extension.get() is not None


def _check(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, expert_slots: torch.Tensor,
    local_slots: torch.Tensor | None, ranks: Sequence[int], width: int,
) -> None:  # fmt: skip
    if any(t.dtype != torch.float32 for t in (x, weight, bias)):
        raise ValueError(
            f"x, weight and bias must be fp32, got {x.dtype}/{weight.dtype}/{bias.dtype}"
        )
    n = weight.shape[0]
    if x.dim() != 2 or weight.shape != (n, x.shape[1]) or bias.shape != (n,):
        raise ValueError(
            f"x [T, d], weight [n, d] and bias [n] do not agree: {tuple(x.shape)}, "
            f"{tuple(weight.shape)}, {tuple(bias.shape)}"
        )
    if not 1 <= k <= min(n, width, MAX_K):
        raise ValueError(f"top_k={k} must lie in 1..min(experts={n}, width={width}, {MAX_K})")
    if expert_slots.shape != (n,):
        raise ValueError(f"expert_slots must be [{n}], got {tuple(expert_slots.shape)}")
    if ranks and (local_slots is None or local_slots.shape != (n,)):
        raise ValueError("rank blocks need each expert's local slot [n]")
    if any(r < 1 for r in ranks):
        raise ValueError(f"ranks must be positive, got {list(ranks)}")


def topk_route(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, temperature: float,
    expert_slots: torch.Tensor, local_slots: torch.Tensor | None, count: int,
    ranks: Sequence[int], width: int,
) -> Route:  # fmt: skip
    """The kernel: `topk_route_reference` in one call (CPU tensors)."""
    lib = _extension.get()
    if lib is None:
        raise RuntimeError("the CPU top-k route kernel is not available here")
    _check(x, weight, bias, k, expert_slots, local_slots, ranks, width)
    (T, d), n = x.shape, weight.shape[0]
    x, weight, bias = x.contiguous(), weight.contiguous(), bias.contiguous()
    slots = expert_slots.to(torch.long).contiguous()
    local = (local_slots if ranks else slots).to(torch.long).contiguous()  # type: ignore[union-attr]
    rank_t = _rank_tensor(tuple(ranks))
    total = count * sum(ranks)
    logits = torch.empty(T, n)
    experts = torch.empty(T, k, dtype=torch.long)
    slot_ids = torch.empty(T, width, dtype=torch.long)
    slot_weights = torch.empty(T, width)
    rows = torch.empty(T, total)
    inactive = torch.empty(T, total, dtype=torch.bool)
    bad = lib.route_fp32(
        x.data_ptr(), d, weight.data_ptr(), bias.data_ptr(), logits.data_ptr(), T, n, k, float(temperature), slots.data_ptr(), local.data_ptr(), count,
        rank_t.data_ptr(), len(ranks), slot_ids.data_ptr(), slot_weights.data_ptr(), width,
        experts.data_ptr(), rows.data_ptr(), inactive.data_ptr(),
    )  # fmt: skip
    if bad:
        raise ValueError(f"an expert's local slot lies outside the stacked range 0..{count - 1}")
    return Route(logits, experts, slot_weights[:, :k], slot_ids, slot_weights, rows, inactive)


def topk_route_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, temperature: float,
    expert_slots: torch.Tensor, local_slots: torch.Tensor | None, count: int,
    ranks: Sequence[int], width: int,
) -> Route:  # fmt: skip
    """The twin in PyTorch ops, on any device: the logits by `addmm`, top-k of
    `logits / temperature`, a softmax over the k values (top-1: an argmax and weight 1), the
    slot table and the rank blocks."""
    _check(x, weight, bias, k, expert_slots, local_slots, ranks, width)
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
    if not ranks:
        empty = torch.empty(T, 0, device=logits.device)
        return Route(logits, experts, weights, slot_ids, slot_weights, empty, empty.bool())
    assert local_slots is not None
    eye = torch.eye(count, device=logits.device)[local_slots]  # [n, count]
    expander = torch.cat([eye.repeat_interleave(r, dim=1) for r in ranks], dim=1)
    rows = (F.one_hot(experts, logits.shape[1]).float() * weights[..., None]).sum(1) @ expander
    return Route(logits, experts, weights, slot_ids, slot_weights, rows, rows == 0)


_rank_tensors: dict[tuple[int, ...], torch.Tensor] = {}


def _rank_tensor(ranks: tuple[int, ...]) -> torch.Tensor:
    """The kernel's int64 copy of `ranks`, made once per distinct tuple."""
    t = _rank_tensors.get(ranks)
    if t is None:
        t = _rank_tensors[ranks] = torch.tensor(ranks, dtype=torch.long)
    return t
