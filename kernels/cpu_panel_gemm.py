"""Small-M GEMM for CPU serving: `y = x @ W.T` on fp32 or bf16 weights packed once into 16-column
panels, accumulated in fp32.

A decode step multiplies a few token rows by every weight of the model, so each GEMM streams its
weight once and the kernel's job is to keep up with memory, where oneDNN's small-M kernels spend
time on set-up. bf16 panels stream half the bytes and are widened to fp32 in registers (a shift
and a mask per 16 weights), which is what lets a bf16 model serve on an AVX2 CPU, where oneDNN
packs no bf16. Tiles are AVX2/FMA, or AVX-512F where the CPU has it (twice the rows per tile).
Whether a shape runs here, on oneDNN or on `F.linear` is measured per CPU (`docs/cpu-gemm.md`).

The C++ source (`csrc/panel_gemm.cpp`) is a PyTorch C++ extension built by
`kernels.cpu_extension_build` (at `make models`, at image build, else at first use) into a cache
private to the user, and loaded only after its hash matches the one its build recorded; its GEMM is
a torch op that checks its tensors in C++ and runs without the GIL. Where there is no compiler, no
AVX2/FMA or no x86, `available()` is False (with a warning) and callers keep their oneDNN path;
`MOLORA_CPU_PANEL_GEMM=0` turns the kernel off. `panel_linear_reference` is its twin: `F.linear` on
the plain weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch.nn import functional as F

from kernels import registry
from kernels.cpu_kernel import CpuKernel

SWITCH_ENV = registry.PANEL_GEMM.switch_env
PANEL_WIDTH = 16  # must equal NR in the C++ source; checked against the library at load
PANEL_DTYPES = (torch.float32, torch.bfloat16)
# Column order inside a bf16 panel row: j and 8 + j share a 32-bit lane, which the kernel splits
# into two fp32 registers with a shift and a mask (see load_row in the C++ source).
BF16_ORDER = [c for j in range(PANEL_WIDTH // 2) for c in (j, PANEL_WIDTH // 2 + j)]


@dataclass(frozen=True)
class PanelWeight:
    """A weight `[out_features, in_features]` packed as `[ceil(out/16), in, 16]` fp32 or bf16
    panels (bf16 rows in `BF16_ORDER`)."""

    panels: torch.Tensor
    out_features: int
    in_features: int

    def __post_init__(self) -> None:
        # the layout the kernel reads, refused at packing time (the op checks it again per call)
        blocks = -(-self.out_features // PANEL_WIDTH)
        expected = (blocks, self.in_features, PANEL_WIDTH)
        p = self.panels
        if tuple(p.shape) != expected or p.dtype not in PANEL_DTYPES or not p.is_contiguous():
            raise ValueError(
                f"panels must be contiguous fp32 or bf16 {expected}, got {p.dtype} {tuple(p.shape)}"
            )
        if p.device.type != "cpu":
            raise ValueError("panels must be on the CPU")


def _check_width(lib: ModuleType) -> None:
    if lib.panel_width() != PANEL_WIDTH:
        raise RuntimeError("panel width of the built library differs from PANEL_WIDTH")


KERNEL = CpuKernel.of(registry.PANEL_GEMM, check=_check_width)
SPEC = KERNEL.spec


def has_avx512() -> bool:
    """Whether the loaded kernel runs AVX-512 tiles on this CPU (False where it is not loaded)."""
    lib = KERNEL.library()
    return bool(lib is not None and lib.has_avx512())


def available() -> bool:
    """Whether the kernel is on and runs here (builds the library on the first call)."""
    return KERNEL.available()


def pack(weight: torch.Tensor) -> PanelWeight:
    """Panels of a 2-D fp32 or bf16 CPU weight `[out, in]` in its own dtype, zero-padded to a
    multiple of 16 rows."""
    if weight.dim() != 2 or weight.dtype not in PANEL_DTYPES or weight.device.type != "cpu":
        raise ValueError(
            f"panel packing needs a 2-D fp32 or bf16 CPU weight, got {weight.dtype} "
            f"{tuple(weight.shape)} on {weight.device}"
        )
    n, k = weight.shape
    blocks = -(-n // PANEL_WIDTH)
    padded = weight.detach().new_zeros(blocks * PANEL_WIDTH, k)
    padded[:n] = weight.detach()
    grouped = padded.view(blocks, PANEL_WIDTH, k)
    if weight.dtype == torch.bfloat16:
        grouped = grouped[:, BF16_ORDER]
    panels = grouped.transpose(1, 2).contiguous()
    return PanelWeight(panels=panels, out_features=n, in_features=k)


def panel_linear(
    x: torch.Tensor,
    weight: PanelWeight,
    bias: torch.Tensor | None = None,
    *,
    allow_avx512: bool = True,
) -> torch.Tensor:
    """`F.linear(x, W, bias)` for 2-D fp32 or bf16 CPU `x [M, in]` on `W`'s panels (no
    autograd): products summed in fp32, the result in `x`'s dtype (rounded once, as
    `F.linear` rounds a bf16 GEMM). AVX-512 tiles where the CPU has them, unless not allowed.
    The op checks every tensor (ValueError: rank, dtype, device, features, the panels' layout);
    here bf16 or column-strided input is only widened to the fp32 rows it reads."""
    ops = KERNEL.ops()
    if ops is None:
        raise RuntimeError("the CPU panel GEMM is not available here (see `available()`)")
    fp32 = x.dtype == torch.float32 and x.dim() > 0 and x.stride(-1) == 1
    x32 = x if fp32 or x.dtype not in PANEL_DTYPES else x.float().contiguous()
    y = torch.empty(x.shape[0] if x.dim() else 0, weight.out_features, dtype=torch.float32)
    ops.gemm.default(x32, weight.panels, weight.out_features, y, allow_avx512)
    if bias is not None:
        y.add_(bias)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def panel_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The twin that defines `panel_linear`'s result: PyTorch's own linear in fp32 on the same
    values, rounded to `x`'s dtype."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), b).to(x.dtype)


if __name__ == "__main__":
    raise SystemExit(KERNEL.build_ahead())
