"""Compiled Triton routed-LoRA kernels equal their PyTorch twins on a CUDA device.

Plain no-argument checks (see gpu_support): they run under `pytest -m gpu tests/gpu` and, on a
machine without pytest, under `python -m tests.gpu.run_checks` (scripts/gpu_check.sh).
"""

from __future__ import annotations

import torch

from kernels.reference import routed_lora_dense, routed_lora_segmented
from tests.gpu.gpu_support import assert_close_scaled, gpu, require_cuda

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (rtol, atol relative to max |y|): halves multiply x·A in fp16/bf16 (exact products, fp32
# sums) and h·B in tf32, then round once; fp32 uses exact fp32 dots.
TOLERANCES = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (5e-3, 3e-3),
    torch.bfloat16: (2e-2, 1e-2),
}
# (T, k, S slots incl. zero slot, r, d_in, d_out): decode, odd hidden sizes, prefill, rank 128.
SHAPES = [
    (1, 1, 5, 16, 576, 576),
    (7, 2, 5, 8, 1000, 1536),
    (32, 2, 33, 16, 2048, 2048),
    (64, 1, 9, 64, 4096, 1024),
    (200, 3, 9, 128, 576, 1000),
    (1024, 2, 5, 16, 2048, 4096),
]


def _case(T: int, k: int, S: int, r: int, d_in: int, d_out: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a_buf = torch.randn(S, 2, r, d_in, device="cuda", generator=g) / d_in**0.5
    b_buf = torch.randn(S, 2, d_out, r, device="cuda", generator=g) / r**0.5
    x = torch.randn(T, d_in, device="cuda", generator=g)
    ids = torch.randint(-1, S, (T, k), device="cuda", generator=g)
    w = torch.rand(T, k, device="cuda", generator=g)
    return x.to(dtype), a_buf[:, 1].to(dtype), b_buf[:, 1].to(dtype), ids, w


@gpu
def test_triton_kernels_match_twins() -> None:
    require_cuda()
    from kernels.triton_ops import routed_lora_triton

    for i, shape in enumerate(SHAPES):
        for dtype in DTYPES:
            x, A, B, ids, w = _case(*shape, dtype=dtype, seed=i)
            twin = routed_lora_dense if shape[0] <= 8 else routed_lora_segmented
            want = twin(x, A, B, ids, w)
            for mode in ("bgmv", "sgmv", "auto"):
                got = routed_lora_triton(x, A, B, ids, w, mode=mode)
                assert_close_scaled(got, want, f"{mode} {shape} {dtype}", TOLERANCES)


@gpu
def test_fused_multi_output_matches_twins() -> None:
    require_cuda()
    for T in (4, 300):
        for dtype in (torch.bfloat16, torch.float32):
            x, A, B, ids, w = _case(T, 2, 9, 16, 1024, 1024, dtype, seed=T)
            pairs = [(A, B)]
            for n, seed in ((256, 1), (256, 2), (3072, 3)):
                _, a2, b2, _, _ = _case(1, 1, 9, 16, 1024, n, dtype, seed=seed)
                pairs.append((a2, b2))
            from kernels.triton_ops import routed_lora_multi_triton

            outs = routed_lora_multi_triton(x, pairs, ids, w)
            for (a, b), got in zip(pairs, outs, strict=True):
                assert_close_scaled(
                    got, routed_lora_segmented(x, a, b, ids, w), f"multi T={T} {dtype}", TOLERANCES
                )


@gpu
def test_kernels_replay_in_cuda_graph() -> None:
    """Static buffers captured once; new ids/weights/inputs copied in; replay == eager."""
    require_cuda()
    from kernels.triton_ops import routed_lora_triton

    for mode, T in (("bgmv", 16), ("sgmv", 128)):
        x, A, B, ids, w = _case(T, 2, 9, 16, 2048, 2048, torch.bfloat16, seed=7)
        for _ in range(2):  # compile outside the capture
            routed_lora_triton(x, A, B, ids, w, mode=mode)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = routed_lora_triton(x, A, B, ids, w, mode=mode)
        for seed in range(3):
            x2, _, _, ids2, w2 = _case(T, 2, 9, 16, 2048, 2048, torch.bfloat16, seed=100 + seed)
            x.copy_(x2)
            ids.copy_(ids2)
            w.copy_(w2)
            graph.replay()
            eager = routed_lora_triton(x, A, B, ids, w, mode=mode)
            assert torch.equal(y, eager), f"graph replay differs from eager ({mode})"


@gpu
def test_backend_on_cuda_and_gradients() -> None:
    """The CUDA backend runs Triton; calls that need autograd take the differentiable twin."""
    require_cuda()
    from molora_runtime.model.lora_backend import TritonBackend, choose_backend
    from molora_runtime.model.lora_context import LoRAContext
    from molora_runtime.model.slot_buffers import LoRABuffers

    x, A, B, ids, w = _case(64, 2, 9, 16, 512, 512, torch.float32, seed=3)
    assert isinstance(choose_backend(torch.device("cuda")), TritonBackend)
    buf = LoRABuffers(A[:, None], B[:, None])
    ctx = LoRAContext(ids, w, backend=TritonBackend())
    got = ctx.add_lora(torch.zeros(64, 512, device="cuda"), x, buf, 0)
    assert_close_scaled(got, routed_lora_segmented(x, A, B, ids, w), "backend", TOLERANCES)
    wg = w.clone().requires_grad_()
    ctx = LoRAContext(ids, wg, backend=TritonBackend())
    ctx.add_lora(torch.zeros(64, 512, device="cuda"), x, buf, 0).square().sum().backward()
    wt = w.clone().requires_grad_()
    routed_lora_segmented(x, A, B, ids, wt).square().sum().backward()
    torch.testing.assert_close(wg.grad, wt.grad, rtol=1e-4, atol=1e-4)
