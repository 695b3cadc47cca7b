"""Decode attention over a paged fp32 or bf16 KV cache on CPU, read in place (no gathered copy).

The PyTorch CPU path gathers each sequence's blocks into one contiguous operand (and widens a
bf16 cache to fp32) before two batched GEMMs; at decode sizes that copy dominates the layer's
attention. The C++ kernel (`csrc/paged_decode.cpp`) walks each sequence's block table instead,
one (sequence, KV head) task per OpenMP iteration, fp32 scores, softmax and sums. It is built and
verified like the panel GEMM (`kernels.cpu_kernel`) and called as a torch op that checks its
tensors in C++; where it cannot be built or the CPU lacks AVX2/FMA, `available()` is False (with
a warning) and callers keep the PyTorch path.
Which of the two runs a shape is measured per CPU by the runtime, not decided here.
`kernels.paged_attention.paged_decode_attention_reference` is its twin.
"""

from __future__ import annotations

import torch

from kernels import registry
from kernels.cpu_kernel import CpuKernel
from kernels.paged_inputs import PagedDecodeInputs

SWITCH_ENV = registry.PAGED_DECODE.switch_env
CACHE_DTYPES = (torch.float32, torch.bfloat16)
KERNEL = CpuKernel.of(registry.PAGED_DECODE)


def available() -> bool:
    """Whether the kernel is on and runs here (builds the library on the first call)."""
    return KERNEL.available()


def paged_decode(inputs: PagedDecodeInputs) -> torch.Tensor:
    """Decode attention -> [B, H, D] in q's dtype; the caches must be fp32 or bf16 and
    contiguous, and block-table entries past a sequence's length are never read. The op checks
    every input (ValueError: shapes, dtypes, layout, a table reaching outside the cache)."""
    ops = KERNEL.ops()
    if ops is None:
        raise RuntimeError("the CPU paged attention kernel is not available here")
    q = inputs.q
    out = torch.empty(q.shape, dtype=torch.float32)
    ops.decode.default(
        q.to(torch.float32).contiguous(), inputs.k_cache, inputs.v_cache,
        inputs.block_tables.to(torch.int32).contiguous(),
        inputs.context_lens.to(torch.int32).contiguous(), out, float(inputs.scale),
    )  # fmt: skip
    return out.to(q.dtype)


if __name__ == "__main__":
    raise SystemExit(KERNEL.build_ahead())
