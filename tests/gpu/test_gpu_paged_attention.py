"""The compiled Triton paged decode-attention kernel equals its PyTorch twin on a CUDA device.

Plain no-argument checks (see gpu_support): they run under `pytest -m gpu tests/gpu` and, on a
machine without pytest, under `python -m tests.gpu.run_checks` (scripts/gpu_check.sh).
"""

from __future__ import annotations

import torch

from kernels.paged_attention import paged_decode_attention_reference
from kernels.paged_inputs import PagedDecodeInputs
from tests.gpu.gpu_support import assert_close_scaled, gpu, require_cuda

# (rtol, atol relative to 1 + max |out|): the kernel computes in fp32 from the same inputs as
# the twin and rounds once; only the summation order differs.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
# (lens, KVH, group, D, block_size): SmolLM2-135M decode (9/3 heads, D 64) at b=1/8/32 with
# up to 1.5k context, a wide-group model shape, MHA with small blocks, and padding rows.
SHAPES = [
    ([1], 3, 3, 64, 16),
    ([17, 300, 1, 64, 1500, 33, 16, 999], 3, 3, 64, 16),
    ([(i * 47) % 1500 + 1 for i in range(32)], 3, 3, 64, 16),
    ([128, 2000, 5, 0], 8, 4, 128, 16),
    ([31, 32, 33, 0, 7], 4, 1, 64, 4),
    ([0, 0], 2, 2, 32, 8),
]


def _case(
    lens: list[int], kvh: int, group: int, d: int, bs: int, dtype: torch.dtype, seed: int
) -> PagedDecodeInputs:
    g = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32)
    width = max(need) + 2
    tables = torch.zeros(len(lens), width, dtype=torch.int32, device="cuda")
    at = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[at : at + n]
        at += n
    shape = (num_blocks, kvh, bs, d)
    k = torch.randn(shape, device="cuda", generator=g).to(dtype)
    v = torch.randn(shape, device="cuda", generator=g).to(dtype)
    q = torch.randn(len(lens), kvh * group, d, device="cuda", generator=g).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return PagedDecodeInputs(q, k, v, tables, ctx, d**-0.5)


def paged_decode_attention(inputs: PagedDecodeInputs) -> torch.Tensor:
    """The Triton kernel, imported on use: collecting this file must not import Triton before
    tests/kernels switch it to its CPU interpreter."""
    from kernels.triton_paged_attention import paged_decode_attention_triton

    return paged_decode_attention_triton(inputs)


@gpu
def test_paged_attention_kernel_matches_twin() -> None:
    require_cuda()
    for i, shape in enumerate(SHAPES):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            inputs = _case(*shape, dtype=dtype, seed=i)
            want = paged_decode_attention_reference(inputs)
            got = paged_decode_attention(inputs)
            assert_close_scaled(
                got, want, f"triton {shape[1:]} b={len(shape[0])} {dtype}", TOLERANCES
            )
            padding = inputs.context_lens == 0
            assert not got[padding].any(), "padding rows must be zero"


@gpu
def test_paged_attention_replays_in_cuda_graph() -> None:
    """Captured once over static (padded) tables; new lengths/tables/queries copied in."""
    require_cuda()
    lens = [5, 700, 64, 1]
    inputs = _case(lens, 3, 3, 64, 16, torch.bfloat16, seed=3)
    q, tables, ctx = inputs.q, inputs.block_tables, inputs.context_lens
    for _ in range(2):  # compile outside the capture
        paged_decode_attention(inputs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(inputs)
    for step, new_lens in enumerate(([6, 701, 65, 2], [0, 16, 700, 3], [40, 1, 0, 704])):
        q.copy_(_case(lens, 3, 3, 64, 16, torch.bfloat16, seed=10 + step).q)
        ctx.copy_(torch.tensor(new_lens, dtype=torch.int32))
        tables.copy_(tables.roll(1, dims=0))
        graph.replay()
        eager = paged_decode_attention(inputs)
        assert torch.equal(out, eager), "graph replay differs from eager"
        assert_close_scaled(out, paged_decode_attention_reference(inputs), "replay", TOLERANCES)
