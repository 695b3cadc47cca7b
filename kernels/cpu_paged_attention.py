"""Decode attention over a paged fp32 or bf16 KV cache on CPU, read in place (no gathered copy).

The PyTorch CPU path gathers each sequence's blocks into one contiguous operand (and widens a
bf16 cache to fp32) before two batched GEMMs; at decode sizes that copy dominates the layer's
attention. The C++ kernel (`csrc/paged_decode.cpp`) walks each sequence's block table instead,
one (sequence, KV head) task per OpenMP iteration, fp32 scores, softmax and sums. It is built and
verified like the panel GEMM (`kernels.cpu_extension_build`); where it cannot be built or the
CPU lacks AVX2/FMA, `available()` is False (with a warning) and callers keep the PyTorch path.
Which of the two runs a shape is measured per CPU by the runtime, not decided here.
`kernels.paged_attention.paged_decode_attention_reference` is its twin.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

from kernels import cpu_extension_build, cpu_panel_gemm
from kernels.cpu_extension_build import ExtensionSpec
from kernels.paged_inputs import check_paged_inputs

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
SPEC = ExtensionSpec(
    name="molora_paged_decode",
    source=SOURCE,
    cflags=("-O3", "-mavx2", "-mfma", "-fopenmp"),
    ldflags=("-fopenmp",),
)
SWITCH_ENV = "MOLORA_CPU_PAGED_ATTENTION"
CACHE_DTYPES = (torch.float32, torch.bfloat16)


def build() -> ModuleType:
    """The kernel's extension module: the verified cached build, else a fresh one. Raises
    RuntimeError with the reason (no compiler, no ninja, the compiler's output)."""
    if cpu_panel_gemm.compiler() is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    return cpu_extension_build.load(SPEC)


_extension = cpu_extension_build.LazyExtension(
    lambda: build(), "CPU paged attention kernel unavailable, decode gathers blocks", log
)


def _load() -> ModuleType | None:
    return _extension.get()


def available() -> bool:
    """Whether the kernel is on and runs here (builds the library on the first call)."""
    if os.environ.get(SWITCH_ENV, "1") == "0" or not cpu_panel_gemm.cpu_supported():
        return False
    return _load() is not None


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention: q [B, H, D], caches [num_blocks, KVH, block_size, D] (fp32 or bf16,
    contiguous), block_tables [B, max_blocks] int32 (entries past a length are never read),
    context_lens [B] int32 (0: padding, output 0) -> [B, H, D] in q's dtype."""
    lib = _load()
    if lib is None:
        raise RuntimeError("the CPU paged attention kernel is not available here")
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens)
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"caches must both be fp32 or bf16, got {k_cache.dtype}/{v_cache.dtype}")
    if any(t.device.type != "cpu" for t in (q, k_cache, v_cache, block_tables, context_lens)):
        raise ValueError("every input must be on the CPU")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the caches must be contiguous")
    num_blocks, kv_heads, block_size, hd = k_cache.shape
    B, H, _ = q.shape
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty(B, H, hd, dtype=torch.float32)
    if B == 0:
        return out.to(q.dtype)
    q32 = q.to(torch.float32).contiguous()
    kernel = lib.decode_bf16 if k_cache.dtype == torch.bfloat16 else lib.decode_fp32
    bad = kernel(
        q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
        lens.data_ptr(), out.data_ptr(), B, H, kv_heads, block_size, hd, num_blocks, float(scale),
        torch.get_num_threads(),
    )  # fmt: skip
    if bad == 1:
        raise ValueError(f"a context length exceeds its block table ({tables.shape[1]} blocks)")
    if bad:
        raise ValueError(f"a block table names a block outside the cache (0..{num_blocks - 1})")
    return out.to(q.dtype)


def main() -> int:
    """`python -m kernels.cpu_paged_attention`: build ahead (`make models`, the image). Exits 0
    where the kernel cannot be built here (decode then gathers blocks) after saying why, loudly."""
    logging.basicConfig(level=logging.INFO)
    if not cpu_panel_gemm.cpu_supported():
        print(
            "CPU paged attention: this CPU has no AVX2/FMA; decode gathers blocks", file=sys.stderr
        )
        return 0
    try:
        lib = build()
    except RuntimeError as exc:
        print(
            f"WARNING: CPU paged attention not built ({exc}); decode gathers blocks",
            file=sys.stderr,
        )
        return 0
    print(f"CPU paged attention kernel built and verified: {lib.__file__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
