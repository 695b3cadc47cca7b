"""Base-weight GEMMs on CPU through weights packed once, not on every call, on the kind of GEMM
measured fastest for each weight's shape on this CPU.

`F.linear` on CPU hands oneDNN a plain row-major weight, which it reorders into its blocked
layout on each call; packing once at load (as PyTorch's inductor does for frozen CPU graphs)
saves that. Three kinds compute the same product: the panel GEMM of `kernels.cpu_panel_gemm`
(fp32 or bf16 panels, AVX2/FMA), oneDNN's packed kernel (native AVX512-BF16/AMX where the CPU has
them) and plain `F.linear`. Which is fastest depends on the CPU, the shape and the row count, so
`pack_chosen` has `kernels.chooser` time them on each distinct shape, keep the tables per machine
kind and log each shape's table once. `MOLORA_CPU_GEMM` (`panel`, `onednn`, `plain`; default
`auto`) forces one kind where it runs, for side-by-side runs.

Only the serving forward uses the packed copy: anything that needs autograd through the GEMM,
any other device and any dtype oneDNN does not pack keeps `F.linear`. The plain weight stays
the source of truth (checkpoints, training, the embedding a tied LM head shares).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch.nn import functional as F

from kernels import chooser, cpu_panel_gemm
from kernels.cpu_panel_gemm import PanelWeight

log = logging.getLogger(__name__)

# oneDNN picks its blocked format for a typical token count; any count runs on it.
PACK_FOR_TOKENS = 32
GEMM_ENV = "MOLORA_CPU_GEMM"
KINDS = ("panel", "onednn", "plain")
BASE_ROWS = (*chooser.DECODE_ROWS, chooser.PREFILL_ROWS)
HEAD_ROWS = chooser.DECODE_ROWS  # the LM head sees one row per sequence, prefill or not
# the base GEMMs' decision, kept per shape key for the process
CHOOSER = chooser.Chooser("CPU GEMM", GEMM_ENV, KINDS, unit="us per GEMM by rows", logger=log)


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
    """A packed copy of `weight [out, in]` chosen without measuring (the LoRA pairs, built while
    serving): fp32 or bf16 panels where the panel GEMM runs, else oneDNN's, else None."""
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


def packed_summary(packs: Sequence[PackedWeight | None]) -> str:
    """How many weights run on each kind, most first: `the panel GEMM (...) x90, oneDNN ... x31`."""
    counts: dict[str, int] = {}
    for packed in packs:
        counts[packed_kind(packed)] = counts.get(packed_kind(packed), 0) + 1
    return ", ".join(f"{kind} x{n}" for kind, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def runnable_kinds(weight: torch.Tensor) -> list[str]:
    """The kinds that can run `weight [out, in]` here, in `KINDS` order (plain always can)."""
    kinds = []
    if weight.dtype in cpu_panel_gemm.PANEL_DTYPES and cpu_panel_gemm.available():
        kinds.append("panel")
    if packing_supported(weight):
        kinds.append("onednn")
    return [*kinds, "plain"]


def pack_as(weight: torch.Tensor, kind: str) -> PackedWeight | None:
    """`weight`'s packed copy for `kind` (None for `plain`, or where oneDNN refuses the shape)."""
    if kind == "panel":
        return cpu_panel_gemm.pack(weight)
    return pack_onednn(weight) if kind == "onednn" else None


def forced_kind() -> str | None:
    """The kind `MOLORA_CPU_GEMM` forces, or None for `auto`; any other value is refused."""
    return CHOOSER.forced()


def shape_key(weight: torch.Tensor, rows: Sequence[int]) -> str:
    dtype = str(weight.dtype).removeprefix("torch.")
    return f"{dtype}:{weight.shape[0]}x{weight.shape[1]}:rows={','.join(map(str, rows))}"


def gemm_candidates(weight: torch.Tensor, kinds: Sequence[str]) -> dict[str, chooser.Candidate]:
    """Each kind as a `kernels.chooser` candidate: a GEMM of `m` random rows on `weight`."""
    packs = {kind: pack_as(weight, kind) for kind in kinds}
    plain = weight.detach()

    def candidate(packed: PackedWeight | None) -> chooser.Candidate:
        def make(m: int) -> chooser.Runner:
            # a generator of its own: timing at load leaves torch's global RNG where it was
            gen = torch.Generator().manual_seed(m)
            x = torch.randn(m, weight.shape[1], generator=gen).to(weight.dtype)
            if packed is None:
                return lambda: F.linear(x, plain)
            return lambda: packed_gemm(x, packed)

        return make

    return {
        kind: candidate(packs[kind]) for kind in kinds if kind == "plain" or packs[kind] is not None
    }


def row_invariant(weight: torch.Tensor, kind: str, rows: Sequence[int]) -> bool:
    """Whether `kind` gives every row the same bits alone as inside a batch of any of `rows`:
    a request's output must not depend on what it is batched with (MKL's fp32 GEMM, for one,
    sums in an order that depends on the row count)."""
    packed = pack_as(weight, kind)
    if kind != "plain" and packed is None:
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(max(rows), weight.shape[1], generator=gen).to(weight.dtype)
    with torch.no_grad():
        full = linear(x, weight.detach(), None, packed)
        return all(
            torch.equal(linear(x[i : i + m], weight.detach(), None, packed), full[i : i + m])
            for m in rows
            for i in {0, max(rows) - m}
        )


def choose_kind(
    weight: torch.Tensor, rows: Sequence[int] = BASE_ROWS, invariant: bool = False
) -> str:
    """The kind `weight`'s shape runs fastest on here (`kernels.chooser`: forced, decided
    earlier in this process, taken from this machine's stored table, or measured now and
    stored; logged once). fp32 weights choose among row-invariant kinds only (`row_invariant`:
    a greedy fp32 request gets the same tokens alone as in any batch); bf16 ones among all,
    since oneDNN's native bf16 kernels, the reason to serve in bf16, sum in an order that
    depends on the row count, unless `invariant` asks for row invariance (speculative decoding:
    a verified row must get the bits a plain decode of it gets)."""
    key = shape_key(weight, rows)
    invariant = invariant or weight.dtype == torch.float32

    def narrow(runnable: list[str]) -> list[str]:
        if not invariant:
            return runnable
        kinds = [kind for kind in runnable if row_invariant(weight, kind, rows)]
        if not kinds:  # no panel kernel and oneDNN varies: keep every kind rather than none
            log.warning("no row-invariant GEMM for %s; choosing among all", key)
            return runnable
        if weight.dtype == torch.bfloat16 and "panel" in kinds:
            # oneDNN's bf16 passes the check above, yet a SmolLM2 row verified inside a
            # draft got other logits than its plain decode (AVX512-BF16): panels only.
            return ["panel"]
        return kinds

    def measure(kinds: Sequence[str]) -> chooser.Table:
        with torch.no_grad():
            return chooser.measure(gemm_candidates(weight, kinds), rows)

    return CHOOSER.choose(
        key, runnable_kinds(weight), measure, narrow=narrow,
        narrowed="not row-invariant here, left out",
        memo_key=f"{key}:invariant" if invariant else key,
    )  # fmt: skip


def pack_chosen(
    weight: torch.Tensor, rows: Sequence[int] = BASE_ROWS, invariant: bool = False
) -> PackedWeight | None:
    """The packed copy of base weight `weight [out, in]` on the kind `choose_kind` picks for its
    shape (None: plain `F.linear`; `invariant`: among row-invariant kinds only). Weights that
    are not 2-D fp32/bf16 CPU tensors keep the oneDNN copy where there is one."""
    if (
        weight.device.type != "cpu"
        or weight.dim() != 2
        or weight.dtype not in cpu_panel_gemm.PANEL_DTYPES
    ):
        return pack_onednn(weight)
    return pack_as(weight, choose_kind(weight, rows, invariant))


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
