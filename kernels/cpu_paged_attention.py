"""Decode attention over a paged fp32 or bf16 KV cache on CPU, read in place (no gathered copy).

The PyTorch CPU path gathers each sequence's blocks into one contiguous operand (and widens a
bf16 cache to fp32) before two batched GEMMs; at decode sizes that copy dominates the layer's
attention. The C++ kernel (`csrc/paged_decode.cpp`) walks each sequence's block table instead,
one (sequence, KV head) task per OpenMP iteration, fp32 scores, softmax and sums. It is built and
verified like the panel GEMM (`kernels.cpu_kernel`); where it cannot be built or the
CPU lacks AVX2/FMA, `available()` is False (with a warning) and callers keep the PyTorch path.
Which of the two runs a shape is measured per CPU by the runtime, not decided here.
`kernels.paged_attention.paged_decode_attention_reference` is its twin.
"""

from __future__ import annotations

import torch

from kernels.cpu_kernel import CpuKernel
from kernels.paged_inputs import PagedDecodeInputs

SWITCH_ENV = "MOLORA_CPU_PAGED_ATTENTION"
CACHE_DTYPES = (torch.float32, torch.bfloat16)
KERNEL = CpuKernel.from_csrc(
    "molora_paged_decode", "paged_decode.cpp", SWITCH_ENV, "CPU paged attention",
    "decode gathers blocks",
)  # fmt: skip


def available() -> bool:
    """Whether the kernel is on and runs here (builds the library on the first call)."""
    return KERNEL.available()


def paged_decode(inputs: PagedDecodeInputs) -> torch.Tensor:
    """Decode attention -> [B, H, D] in q's dtype; the caches must be fp32 or bf16 and
    contiguous, and block-table entries past a sequence's length are never read."""
    lib = KERNEL.library()
    if lib is None:
        raise RuntimeError("the CPU paged attention kernel is not available here")
    inputs.check()
    q, k_cache, v_cache = inputs.q, inputs.k_cache, inputs.v_cache
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"caches must both be fp32 or bf16, got {k_cache.dtype}/{v_cache.dtype}")
    if any(t.device.type != "cpu" for t in inputs.tensors()):
        raise ValueError("every input must be on the CPU")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the caches must be contiguous")
    num_blocks, kv_heads, block_size, hd = k_cache.shape
    B, H, _ = q.shape
    tables = inputs.block_tables.to(torch.int32).contiguous()
    lens = inputs.context_lens.to(torch.int32).contiguous()
    out = torch.empty(B, H, hd, dtype=torch.float32)
    if B == 0:
        return out.to(q.dtype)
    q32 = q.to(torch.float32).contiguous()
    kernel = lib.decode_bf16 if k_cache.dtype == torch.bfloat16 else lib.decode_fp32
    bad = kernel(
        q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
        lens.data_ptr(), out.data_ptr(), B, H, kv_heads, block_size, hd, num_blocks, float(inputs.scale),
        torch.get_num_threads(),
    )  # fmt: skip
    if bad == 1:
        raise ValueError(f"a context length exceeds its block table ({tables.shape[1]} blocks)")
    if bad:
        raise ValueError(f"a block table names a block outside the cache (0..{num_blocks - 1})")
    return out.to(q.dtype)


if __name__ == "__main__":
    raise SystemExit(KERNEL.build_ahead())
