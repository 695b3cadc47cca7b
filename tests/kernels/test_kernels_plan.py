"""The per-step segment plan path equals the dense definition (values and gradients)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import routed_lora
from kernels.plan import build_segment_plan, routed_lora_planned
from kernels.reference import routed_lora_dense


@st.composite
def cases(draw):
    T = draw(st.integers(1, 12))
    k = draw(st.integers(1, 3))
    S = draw(st.integers(2, 6))
    r = draw(st.sampled_from([1, 4, 8]))
    d_in, d_out = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    pattern = draw(st.sampled_from(["random", "one-slot", "empty", "unit"]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(S, 2, r, d_in, generator=g)[:, 1]  # a strided per-layer view
    B = torch.randn(S, 2, d_out, r, generator=g)[:, 1]
    x = torch.randn(T, d_in, generator=g)
    if pattern == "empty":
        slots = torch.zeros(T, k, dtype=torch.long)
    elif pattern in ("one-slot", "unit"):
        slots = torch.zeros(T, k, dtype=torch.long)
        slots[:, 0] = 1 + seed % (S - 1)
    else:
        slots = torch.randint(-1, S, (T, k), generator=g)
    weights = torch.ones(T, k) if pattern == "unit" else torch.randn(T, k, generator=g)
    return x, A, B, slots, weights


@settings(max_examples=60, deadline=None)
@given(cases())
def test_planned_equals_dense(case) -> None:
    x, A, B, slots, weights = case
    expected = routed_lora_dense(x, A, B, slots, weights)
    plan = build_segment_plan(slots, weights)
    torch.testing.assert_close(routed_lora_planned(x, A, B, plan), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        routed_lora(x, A, B, slots, weights, plan=plan), expected, rtol=1e-5, atol=1e-5
    )


def test_planned_gradients_match_dense() -> None:
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(4, 8, 16, generator=g), torch.randn(4, 12, 8, generator=g)
    x = torch.randn(6, 16, generator=g)
    slots = torch.tensor([[1, 2], [3, 0], [1, 1], [2, 3], [0, 0], [3, 1]])
    w_ref = torch.rand(6, 2, generator=g).requires_grad_()
    w_plan = w_ref.detach().clone().requires_grad_()
    routed_lora_dense(x, A, B, slots, w_ref).square().sum().backward()
    plan = build_segment_plan(slots, w_plan)
    routed_lora_planned(x, A, B, plan).square().sum().backward()
    torch.testing.assert_close(w_plan.grad, w_ref.grad, rtol=1e-5, atol=1e-5)


def test_unit_weights_and_full_groups_are_shortcut() -> None:
    slots = torch.tensor([[2], [2], [2]])
    plan = build_segment_plan(slots, torch.ones(3, 1))
    assert len(plan.groups) == 1
    assert plan.groups[0].tokens is None and plan.groups[0].weights is None
