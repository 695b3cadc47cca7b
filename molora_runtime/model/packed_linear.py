"""Base-weight GEMMs on CPU through weights packed once, not on every call.

`F.linear` on CPU hands oneDNN a plain row-major weight, which it reorders into its blocked
layout on each call. Packing once at load (as PyTorch's inductor does for frozen CPU graphs)
measured, per SmolLM2-135M projection on the 2-core dev box: 1.1-1.4x faster in bf16 and
1.5-3x in fp32 at 32 tokens, ~2x at one token (`/tmp`-free script in the issue-12 note).
Where the CPU has AVX2/FMA and a compiler, fp32 and bf16 weights go one step further: the panel
GEMM of `kernels.cpu_panel_gemm` runs fp32 1.3-1.5x faster than oneDNN's packed kernel at 1-32
rows and ~1.15x at prefill sizes, and bf16 panels (which oneDNN cannot pack on AVX2, where a plain
bf16 GEMM is ~3x slower than fp32) faster still at decode sizes. Any other CPU keeps oneDNN.

Only the serving forward uses the packed copy: anything that needs autograd through the GEMM,
any other device and any dtype oneDNN does not pack keeps `F.linear`. The plain weight stays
the source of truth (checkpoints, training, the embedding a tied LM head shares).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch.nn import functional as F

from kernels import cpu_panel_gemm
from kernels.cpu_panel_gemm import PanelWeight

log = logging.getLogger(__name__)

# oneDNN picks its blocked format for a typical token count; any count runs on it.
PACK_FOR_TOKENS = 32


def packing_supported(weight: torch.Tensor) -> bool:
    """Whether `weight` can be packed for oneDNN on this build and CPU."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


PackedWeight = torch.Tensor | PanelWeight  # oneDNN's blocked copy, or fp32/bf16 panels


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """The packed copy of base weight `weight [out, in]` that `linear` runs fastest on: fp32 or
    bf16 panels where the panel GEMM runs, else oneDNN's, else None (plain `F.linear`)."""
    if (
        weight.device.type == "cpu"
        and weight.dtype in cpu_panel_gemm.PANEL_DTYPES
        and weight.dim() == 2
        and cpu_panel_gemm.available()
    ):
        return cpu_panel_gemm.pack(weight)
    return pack_onednn(weight)


def packed_kind(packed: PackedWeight | None) -> str:
    """What a packed copy runs on, for the log line an operator reads at start."""
    if isinstance(packed, PanelWeight):
        return f"the panel GEMM ({str(packed.panels.dtype).removeprefix('torch.')} panels)"
    return "oneDNN (packed weights)" if packed is not None else "plain F.linear"


def pack_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed copy of `weight [out, in]`, or None where packing is not supported."""
    if not packing_supported(weight):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_TOKENS)
    except RuntimeError:  # an unusual shape or build: the plain path is always correct
        log.debug("oneDNN weight packing failed for %s", tuple(weight.shape), exc_info=True)
        return None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: PackedWeight | None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through `packed` when it is safe to."""
    if packed is None or x.dim() != 2 or (torch.is_grad_enabled() and x.requires_grad):
        return F.linear(x, weight, bias)
    if isinstance(packed, PanelWeight) and x.dtype != weight.dtype:
        return F.linear(x, weight, bias)  # an autocast or mixed caller: the plain GEMM is correct
    return packed_gemm(x, packed, bias)


def packed_gemm(
    x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ W.T (+ bias)` for a 2-D serving activation on `W`'s packed copy, either kind."""
    if isinstance(packed, PanelWeight):
        return cpu_panel_gemm.panel_linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackedPairs:
    """Packed copies (`pack_weight`: panels or oneDNN's) of a layer's stacked LoRA pair (CPU bf16
    serving), built on first use.

    At decode sizes a LoRA shrink or expand is a tiny GEMM whose time is per-call set-up, not
    flops; on a packed weight that set-up is cheaper (oneDNN: mixed 4-adapter bf16 decode step
    at 16 sequences, 1 thread, interleaved in one process: 55.8 -> 50.5 ms p50), and on an AVX2
    CPU, where oneDNN packs no bf16, the bf16 panels replace a plain bf16 GEMM. Copies are
    keyed by (layer, first slot, slot count) and all dropped when the slot buffers change: any
    in-place write to them (a hot-set load or clear) bumps the tensors' version counter, which
    their views (a group's members) share.
    """

    def __init__(self) -> None:
        self._versions: tuple[int, ...] | None = None
        self._pairs: dict[tuple[int, int, int], tuple[PackedWeight, PackedWeight] | None] = {}

    def get(
        self, A: torch.Tensor, Bt: torch.Tensor, key: tuple[int, int, int], pair: PairFn
    ) -> tuple[PackedWeight, PackedWeight] | None:
        """Packed `(A_flat, B_flat)` of `pair()` (`A_flat [S·r, d_in]`, `Bt_flat [S·r, d_out]`)
        for `key`, or None where packing is unsupported; `A`, `Bt` are the whole buffers."""
        versions = (A.data_ptr(), A._version, Bt.data_ptr(), Bt._version)
        if versions != self._versions:
            self._pairs.clear()
            self._versions = versions
        if key not in self._pairs:
            a_flat, bt_flat = pair()
            a_packed = pack_weight(a_flat.contiguous())
            b_packed = pack_weight(bt_flat.t().contiguous()) if a_packed is not None else None
            self._pairs[key] = (a_packed, b_packed) if b_packed is not None else None
        return self._pairs[key]


PairFn = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def packed_ready(x: torch.Tensor) -> bool:
    """Whether `x` should take a packed LoRA pair: a 2-D bf16 CPU serving activation (no
    autograd). fp32 keeps plain GEMMs: MKL's small fp32 GEMMs are already cheap (a mixed fp32
    decode step measured 79.8 ms plain vs 78.4 ms packed, within noise), bf16 ones are not."""
    return (
        x.dim() == 2
        and x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


def routed_lora_packed(
    x: torch.Tensor,
    A_packed: PackedWeight,
    B_packed: PackedWeight,
    expanded_weights: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """`kernels.stacked.routed_lora_stacked` (its twin) on packed weights: add the routed
    delta of `x [T, d_in]` to `out [T, d_out]` (which may be a strided view)."""
    h = packed_gemm(x, A_packed)
    h.mul_(expanded_weights.to(h.dtype))
    return out.add_(packed_gemm(h, B_packed))
