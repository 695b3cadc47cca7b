"""The stacked CPU delta (`kernels.stacked`) equals the dense definition over random shapes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.reference import routed_lora_dense
from kernels.stacked import routed_lora_stacked, slot_gate
from molora_runtime.model.slot_buffers import LoRABuffers
from tests.kernels.kernel_cases import assert_matches, case_params, make_case


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
    expanded = slot_gate(c.slot_ids, c.weights, first, count, c.A.shape[1], c.x.dtype)
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


def test_a_slot_a_row_does_not_use_never_reaches_it() -> None:
    """A slot whose shrink overflows to Inf (huge A, bounded B) is selected out of every row that
    does not use it: those rows are bit-identical to the batch where the slot holds zeros."""
    c = make_case(11, T=6, k=2, S=5, r=4, d_in=16, d_out=12)
    ids = torch.tensor([[1, 0], [4, 0], [0, 0], [2, 3], [4, 1], [3, 0]])
    gate = slot_gate(ids, c.weights, 1, 4, 4)
    clean = (ids != 4).all(dim=1)
    outs = []
    for huge in (False, True):
        A, B = c.A.clone(), c.B.clone()
        A[4] = 3.0e38 if huge else 0.0
        B[4] = 1.0e4 if huge else 0.0
        a_flat, bt_flat = stacked_views(A, B, 1, 4)
        outs.append(routed_lora_stacked(c.x, a_flat, bt_flat, gate, out=torch.zeros(6, 12)))
    assert torch.equal(outs[1][clean], outs[0][clean])
    assert not torch.isfinite(outs[1][~clean]).all()  # the rows that chose it see it
