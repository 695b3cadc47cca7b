"""The stacked CPU delta (`kernels.stacked`) equals the dense definition over random shapes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import assert_matches, case_params, make_case

from kernels.reference import routed_lora_dense
from kernels.stacked import routed_lora_stacked, slot_weight_matrix
from molora_runtime.model.layers import LoRABuffers


def stacked_views(A: torch.Tensor, B: torch.Tensor, first: int, count: int):
    """The slot-major [count·r, d] blocks the hot-set's stacked layout holds."""
    r, d_in = A.shape[1:]
    a_flat = A[first : first + count].reshape(count * r, d_in)
    bt_flat = B[first : first + count].transpose(1, 2).reshape(count * r, B.shape[1])
    return a_flat, bt_flat


@settings(max_examples=60, deadline=None)
@given(params=case_params(max_t=24, max_d=96, max_r=16), data=st.data())
def test_stacked_matches_dense_over_a_slot_range(params: dict, data: st.DataObject) -> None:
    c = make_case(**params)
    S = c.A.shape[0]
    first = data.draw(st.integers(1, S - 1))
    count = data.draw(st.integers(1, S - first))
    # Ids outside the range contribute nothing: the definition sees them as "no adapter".
    inside = (c.slot_ids >= first) & (c.slot_ids < first + count)
    want = routed_lora_dense(c.x, c.A, c.B, torch.where(inside, c.slot_ids, -1), c.weights)
    a_flat, bt_flat = stacked_views(c.A, c.B, first, count)
    expanded = slot_weight_matrix(c.slot_ids, c.weights, first, count, c.A.shape[1])
    got = routed_lora_stacked(c.x, a_flat, bt_flat, expanded)
    assert_matches(got, want)
    base = torch.randn(c.x.shape[0], c.B.shape[1]).to(c.x.dtype)
    into = base.clone()
    routed_lora_stacked(c.x, a_flat, bt_flat, expanded, out=into)
    assert_matches(into, (base.float() + want.float()).to(c.x.dtype))


@settings(max_examples=30, deadline=None)
@given(params=case_params(max_t=8, max_d=48, max_r=8))
def test_stacked_buffer_layout_round_trips(params: dict) -> None:
    """Writing into the stacked layout and reading the kernel views gives the same A and B."""
    c = make_case(**params)
    S, r, d_in = c.A.shape
    d_out = c.B.shape[1]
    for stacked in (False, True):
        buf = LoRABuffers.allocate(S, 2, r, d_in, d_out, c.A.dtype, torch.device("cpu"), stacked)
        for s in range(S):
            buf.write(s, 1, c.A[s], c.B[s])
        A, B = buf.kernel_pair(1)
        assert torch.equal(A, c.A) and torch.equal(B, c.B)
        buf.clear_slot(S - 1)
        assert not buf.kernel_pair(1)[0][S - 1].any()
