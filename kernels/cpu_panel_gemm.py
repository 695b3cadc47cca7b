"""Small-M GEMM for CPU serving: `y = x @ W.T` on fp32 or bf16 weights packed once into 16-column
panels, accumulated in fp32.

A decode step multiplies a few token rows by every weight of the model, so each GEMM streams its
weight from memory once and the kernel's job is to keep up with memory, which oneDNN's fp32 kernel
does not at small M. bf16 panels stream half the bytes and are widened to fp32 in registers, which
lets a bf16 model run at fp32 speed on CPUs without bf16 arithmetic (timings: `benchmarks.cpu_gemm`).

The C++ source (`csrc/panel_gemm.cpp`) is built with the system C++ compiler at first use (about
a second) into a cache keyed by the source's hash, and called through ctypes, which releases
the GIL. Where there is no compiler, no AVX2/FMA or no x86, `available()` is False and callers
keep their oneDNN path; `MOLORA_CPU_PANEL_GEMM=0` turns the kernel off (side-by-side runs).
`panel_linear_reference` is its twin: `F.linear` on the plain weight.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "panel_gemm.cpp"
COMPILE_FLAGS = ("-O3", "-std=c++17", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
CACHE_ENV = "MOLORA_KERNEL_CACHE"
SWITCH_ENV = "MOLORA_CPU_PANEL_GEMM"
PANEL_WIDTH = 16  # must equal NR in the C++ source; checked against the library at load
PANEL_DTYPES = (torch.float32, torch.bfloat16)
# Column order inside a bf16 panel row: j and 8 + j share a 32-bit lane, which the kernel splits
# into two fp32 registers with a shift and a mask (see load_row in the C++ source).
BF16_ORDER = [c for j in range(PANEL_WIDTH // 2) for c in (j, PANEL_WIDTH // 2 + j)]

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_load_attempted = False


@dataclass(frozen=True)
class PanelWeight:
    """A weight `[out_features, in_features]` packed as `[ceil(out/16), in, 16]` fp32 or bf16
    panels (bf16 rows in `BF16_ORDER`)."""

    panels: torch.Tensor
    out_features: int
    in_features: int

    def __post_init__(self) -> None:
        # the kernel reads these bytes through raw pointers: the layout must be exactly this
        blocks = -(-self.out_features // PANEL_WIDTH)
        expected = (blocks, self.in_features, PANEL_WIDTH)
        p = self.panels
        if tuple(p.shape) != expected or p.dtype not in PANEL_DTYPES or not p.is_contiguous():
            raise ValueError(
                f"panels must be contiguous fp32 or bf16 {expected}, got {p.dtype} {tuple(p.shape)}"
            )
        if p.device.type != "cpu":
            raise ValueError("panels must be on the CPU")


def cpu_supported() -> bool:
    """Whether this CPU runs the AVX2/FMA kernel."""
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        return False
    return torch.backends.cpu.get_cpu_capability() in {"AVX2", "AVX512"}


def cache_dir() -> Path:
    """Where built libraries live: `$MOLORA_KERNEL_CACHE`, else `~/.cache/molora/kernels`."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "molora" / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def library_path(compiler: str) -> Path:
    """The cached library for this source, flags and compiler (a change in any rebuilds)."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join((compiler, *COMPILE_FLAGS)).encode())
    return cache_dir() / f"panel_gemm-{digest.hexdigest()[:16]}.so"


def build() -> Path:
    """Compile the library unless it is cached; raise RuntimeError with the compiler's output.
    Concurrent builders each write a private file and rename it into place (atomic)."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    target = library_path(compiler)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    cmd = [compiler, *COMPILE_FLAGS, str(SOURCE), "-o", str(partial)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"building {SOURCE.name} failed: {done.stderr.strip()[-2000:]}")
    os.replace(partial, target)
    return target


def _open(path: Path) -> ctypes.CDLL:
    # torch is imported first, so the library's libgomp.so.1 resolves to the OpenMP runtime torch
    # already loaded: one thread team, not two competing for the same cores.
    lib = ctypes.CDLL(str(path))
    lib.molora_panel_width.restype = ctypes.c_int64
    if lib.molora_panel_width() != PANEL_WIDTH:
        raise RuntimeError("panel width of the built library differs from PANEL_WIDTH")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.molora_panel_gemm.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
    lib.molora_panel_gemm.restype = None
    lib.molora_panel_gemm_bf16.argtypes = lib.molora_panel_gemm.argtypes
    lib.molora_panel_gemm_bf16.restype = None
    return lib


def _load() -> ctypes.CDLL | None:
    global _library, _load_attempted
    if _load_attempted:
        return _library
    with _lock:
        if not _load_attempted:
            try:
                _library = _open(build())
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                log.warning("CPU panel GEMM unavailable, using oneDNN: %s", exc)
            _load_attempted = True
    return _library


def available() -> bool:
    """Whether the kernel is on and runs here (builds the library on the first call)."""
    if os.environ.get(SWITCH_ENV, "1") == "0" or not cpu_supported():
        return False
    return _load() is not None


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
    x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, W, bias)` for 2-D fp32 or bf16 CPU `x [M, in]` on `W`'s panels (no
    autograd): products summed in fp32, the result in `x`'s dtype (rounded once, as
    `F.linear` rounds a bf16 GEMM)."""
    lib = _load()
    if lib is None:
        raise RuntimeError("the CPU panel GEMM is not available here (see `available()`)")
    if x.dim() != 2 or x.dtype not in PANEL_DTYPES or x.device.type != "cpu":
        raise ValueError(
            f"panel_linear needs 2-D fp32 or bf16 CPU input, got {x.dtype} {tuple(x.shape)} "
            f"on {x.device}"
        )
    if x.shape[1] != weight.in_features:
        raise ValueError(f"input has {x.shape[1]} features, the weight takes {weight.in_features}")
    x32 = x if x.dtype == torch.float32 and x.stride(1) == 1 else x.float().contiguous()
    m, n = x32.shape[0], weight.out_features
    y = torch.empty(m, n, dtype=torch.float32)
    if m and n:
        kernel = (
            lib.molora_panel_gemm
            if weight.panels.dtype == torch.float32
            else lib.molora_panel_gemm_bf16
        )
        kernel(
            x32.data_ptr(), x32.stride(0), weight.panels.data_ptr(), y.data_ptr(), n,
            m, n, weight.in_features, torch.get_num_threads(),
        )  # fmt: skip
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


if __name__ == "__main__":  # `python -m kernels.cpu_panel_gemm`: build ahead (make install)
    logging.basicConfig(level=logging.INFO)
    if not cpu_supported():
        print("CPU panel GEMM: this CPU has no AVX2/FMA; serving uses oneDNN")
        sys.exit(0)
    try:
        print(f"CPU panel GEMM built: {build()}")
    except RuntimeError as exc:  # serving still works on oneDNN; say so, do not fail the install
        print(f"CPU panel GEMM not built ({exc}); serving uses oneDNN")
