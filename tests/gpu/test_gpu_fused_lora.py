"""A fused group's routed LoRA (one multi-output launch, per-step DevicePlan) equals the
per-projection twin on CUDA, compiled, eagerly and replayed in a CUDA graph.

Plain no-argument checks (see gpu_support): `pytest -m gpu tests/gpu` or `python -m
tests.gpu.run_checks` (scripts/gpu_check.sh).
"""

from __future__ import annotations

import torch

from kernels.reference import routed_lora_segmented
from tests.gpu.gpu_support import assert_close_scaled, gpu, require_cuda

TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 1e-2)}


def _group(T: int, dtype: torch.dtype, seed: int, targeted: tuple[bool, ...]):
    """q/k/v-shaped group on CUDA in the kernel layout; members in `targeted` carry LoRA."""
    from molora_runtime.model.layers import FusedLinear, LoRALinear
    from molora_runtime.model.slot_buffers import GroupBuffers, LoRABuffers

    g = torch.Generator(device="cuda").manual_seed(seed)
    d, widths, S, r, L, layer = 1024, (1024, 256, 256), 9, 16, 2, 1
    members = []
    for i, w in enumerate(widths):
        m = LoRALinear(d, w, False, f"m{i}", layer).to("cuda", dtype)
        with torch.no_grad():
            m.weight.copy_(torch.randn(w, d, device="cuda", generator=g) / d**0.5)
        if targeted[i]:
            buf = LoRABuffers.allocate(S, L, r, d, w, dtype, torch.device("cuda"), stacked=False)
            buf.A.copy_(torch.randn(buf.A.shape, device="cuda", generator=g) / d**0.5)
            buf.B.copy_(torch.randn(buf.B.shape, device="cuda", generator=g) / r**0.5)
            m.lora = buf
        members.append(m)
    fused = FusedLinear(members)
    fused.fuse()
    fused.lora = GroupBuffers([m.lora for m in members], list(widths))
    x = torch.randn(T, d, device="cuda", generator=g).to(dtype)
    ids = torch.randint(-1, S, (T, 2), device="cuda", generator=g)
    w = torch.rand(T, 2, device="cuda", generator=g)
    return fused, x, ids, w


def _twin(fused, x, ids, w) -> list[torch.Tensor]:
    outs = []
    for m in fused.members:
        y = (x @ m.weight.t()).float()
        if m.lora is not None:
            A, B = m.lora.kernel_pair(m.layer)
            y = y + routed_lora_segmented(x, A, B, ids, w).float()
        outs.append(y.to(x.dtype))
    return outs


@gpu
def test_fused_group_matches_per_projection_twin() -> None:
    require_cuda()
    from molora_runtime.model.lora_backend import TritonBackend
    from molora_runtime.model.lora_context import LoRAContext

    for T in (32, 300):  # BGMV decode and SGMV prefill
        for dtype in (torch.bfloat16, torch.float32):
            for targeted in ((True, True, True), (True, False, True)):
                fused, x, ids, w = _group(T, dtype, seed=T, targeted=targeted)
                ctx = LoRAContext(slot_ids=ids, weights=w, backend=TritonBackend())
                with torch.inference_mode():
                    got = fused(x, ctx)
                assert ctx.kernel_meta() is not None  # built once, on the device
                for i, (a, b) in enumerate(zip(got, _twin(fused, x, ids, w), strict=True)):
                    assert_close_scaled(a, b, f"T={T} {dtype} {targeted} member {i}", TOLERANCES)


@gpu
def test_fused_group_replays_in_cuda_graph() -> None:
    """The group's forward (plan built inside the capture) replays equal to eager."""
    require_cuda()
    from molora_runtime.model.lora_backend import TritonBackend
    from molora_runtime.model.lora_context import LoRAContext

    for T in (16, 160):
        fused, x, ids, w = _group(T, torch.bfloat16, seed=5, targeted=(True, False, True))
        with torch.inference_mode():
            for _ in range(2):
                fused(x, LoRAContext(slot_ids=ids, weights=w, backend=TritonBackend()))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = fused(x, LoRAContext(slot_ids=ids, weights=w, backend=TritonBackend()))
            for seed in range(3):
                _, x2, ids2, w2 = _group(T, torch.bfloat16, 50 + seed, (True, False, True))
                x.copy_(x2)
                ids.copy_(ids2)
                w.copy_(w2)
                graph.replay()
                eager = fused(x, LoRAContext(slot_ids=ids, weights=w, backend=TritonBackend()))
                for a, b in zip(outs, eager, strict=True):
                    assert torch.equal(a, b), f"graph replay differs from eager (T={T})"
