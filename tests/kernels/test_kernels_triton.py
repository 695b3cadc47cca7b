"""The Triton kernels, run by the CPU interpreter, equal the dense definition.

Shapes are kept small: every program of the grid is executed in Python.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.reference import routed_lora_dense
from molora_runtime.model.lora_backend import ReferenceBackend, TritonBackend
from molora_runtime.model.lora_context import LoRAContext
from molora_runtime.model.slot_buffers import GroupBuffers, LoRABuffers
from tests.kernels.kernel_cases import assert_matches, case_params, make_case


@pytest.fixture(scope="module")
def triton_ops():
    """Imported here, after conftest set TRITON_INTERPRET=1."""
    from kernels import triton_ops

    return triton_ops


@settings(max_examples=80, deadline=None)
@given(params=case_params(), mode=st.sampled_from(["bgmv", "sgmv"]))
def test_kernels_match_dense(triton_ops, params: dict, mode: str) -> None:
    c = make_case(**params)
    got = triton_ops.routed_lora_triton(c.x, c.A, c.B, c.slot_ids, c.weights, mode=mode)
    assert_matches(got, routed_lora_dense(c.x, c.A, c.B, c.slot_ids, c.weights))


@settings(max_examples=25, deadline=None)
@given(
    params=case_params(max_t=8, max_d=40, max_r=20),
    mode=st.sampled_from(["bgmv", "sgmv"]),
    d_outs=st.lists(st.integers(1, 40), min_size=2, max_size=4),
)
def test_fused_multi_output_matches_dense(
    triton_ops, params: dict, mode: str, d_outs: list[int]
) -> None:
    """q/k/v-style groups (including more than the three fused per launch) with mixed d_out."""
    base = make_case(**params)
    pairs = []
    for i, d_out in enumerate(d_outs):
        c = make_case(**{**params, "seed": params["seed"] + i + 1, "d_out": d_out, "layer": i % 3})
        pairs.append((c.A, c.B))
    outs = triton_ops.routed_lora_multi_triton(
        base.x, pairs, base.slot_ids, base.weights, mode=mode
    )
    for (A, B), got in zip(pairs, outs, strict=True):
        assert_matches(got, routed_lora_dense(base.x, A, B, base.slot_ids, base.weights))


@pytest.mark.parametrize("split", [1, 2, 4])
def test_bgmv_split_k(split: int) -> None:
    """Split-K partial sums (added by the expand) give the same result."""
    from kernels.triton_bgmv import bgmv
    from kernels.triton_common import GroupLaunch

    c = make_case(5, T=3, k=2, S=4, r=12, d_in=150, d_out=33)
    out = torch.empty(3, 33)
    ids = c.slot_ids.to(torch.int32).contiguous()
    bgmv(GroupLaunch(c.x, [c.A], [c.B], ids, c.weights.contiguous(), [out]), split=split)
    assert_matches(out, routed_lora_dense(c.x, c.A, c.B, c.slot_ids, c.weights))


@pytest.mark.parametrize("mode", ["bgmv", "sgmv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max_rank_and_tiles(triton_ops, mode: str, dtype: torch.dtype) -> None:
    """Rank 128 (the padded maximum) and more tokens than one SGMV tile."""
    c = make_case(11, T=40, k=2, S=3, r=128, d_in=24, d_out=20, dtype=dtype)
    got = triton_ops.routed_lora_triton(c.x, c.A, c.B, c.slot_ids, c.weights, mode=mode)
    assert_matches(got, routed_lora_dense(c.x, c.A, c.B, c.slot_ids, c.weights))


@pytest.mark.parametrize("mode", ["auto", "bgmv", "sgmv"])
def test_empty_batch_and_bad_input(triton_ops, mode: str) -> None:
    c = make_case(0, T=0, k=2, S=3, r=4, d_in=8, d_out=6)
    got = triton_ops.routed_lora_triton(c.x, c.A, c.B, c.slot_ids, c.weights, mode=mode)
    assert got.shape == (0, 6)
    c = make_case(0, T=2, k=1, S=3, r=4, d_in=8, d_out=6)
    with pytest.raises(ValueError, match="dtype mismatch"):
        triton_ops.routed_lora_triton(c.x.half(), c.A, c.B, c.slot_ids, c.weights, mode=mode)
    big = make_case(0, T=2, k=1, S=2, r=129, d_in=8, d_out=6)
    with pytest.raises(ValueError, match="rank"):
        triton_ops.routed_lora_triton(big.x, big.A, big.B, big.slot_ids, big.weights, mode=mode)


def test_triton_backend_equals_the_reference_backend_under_interpreter() -> None:
    """The engine's CUDA backend reaches the kernels on CPU tensors when the interpreter is on,
    adding a fused group's deltas into its members' columns as the reference backend does."""
    c = make_case(2, T=6, k=2, S=4, r=8, d_in=20, d_out=10)
    members: list[LoRABuffers | None] = []
    for i in range(3):
        buf = LoRABuffers.allocate(4, 1, 8, 20, 10, torch.float32, torch.device("cpu"), False)
        for s in range(1, 4):
            buf.write(s, 0, c.A[s] * (i + 1), c.B[s])
        members.append(None if i == 1 else buf)
    group = GroupBuffers(members, [10, 10, 10])
    y = torch.randn(6, 30)
    want = ReferenceBackend().add(
        y.clone(), c.x, group, 0, LoRAContext(c.slot_ids, c.weights, None)
    )
    ctx = LoRAContext(c.slot_ids, c.weights, TritonBackend())
    got = ctx.add_lora(y.clone(), c.x, group, 0)
    assert_matches(got, want)
    assert torch.equal(got[:, 10:20], y[:, 10:20])  # the untargeted member's columns
