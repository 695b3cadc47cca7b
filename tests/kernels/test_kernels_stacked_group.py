"""The per-member expand of a fused group equals its twin, the one block-structured expand.

`routed_lora_stacked_group` (one shrink, then each member's expand into its own columns) must
add exactly what `routed_lora_stacked` adds with the block-structured `Bt` (member i's rank rows
non-zero only in its own columns), over random token counts, slot counts, ranks, member widths,
and per-token slot tables (ids outside the range and <= 0 contribute nothing).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.stacked import routed_lora_stacked, routed_lora_stacked_group, slot_gate
from tests.kernels.kernel_cases import GROUP_SHAPES, assert_matches


@settings(max_examples=40, deadline=None)
@given(
    **GROUP_SHAPES,
    count=st.integers(1, 5),
    widths=st.lists(st.integers(1, 24), min_size=1, max_size=3),
    gaps=st.lists(st.integers(0, 5), min_size=3, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_group_expand_matches_block_structured_twin(
    seed: int, T: int, count: int, r: int, d_in: int, widths: list[int], gaps: list[int],
    dtype: torch.dtype,
) -> None:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    n = len(widths)
    # Members own disjoint column blocks of the fused output, with untargeted columns between.
    cols, col = [], 0
    for w, gap in zip(widths, gaps, strict=False):
        col += gap
        cols.append(col)
        col += w
    D = col + gaps[-1]
    A_flat = (torch.randn(count * n * r, d_in, generator=g) / d_in**0.5).to(dtype)
    member_Bt = [(torch.randn(count * r, w, generator=g) / r**0.5).to(dtype) for w in widths]
    block = torch.zeros(count, n * r, D, dtype=dtype)
    for i, (bt, c) in enumerate(zip(member_Bt, cols, strict=True)):
        block[:, i * r : (i + 1) * r, c : c + bt.shape[1]] = bt.view(count, r, -1)
    x = torch.randn(T, d_in, generator=g).to(dtype)
    first = 1 + int(torch.randint(0, 3, (1,), generator=g))
    slot_ids = torch.randint(-1, first + count + 2, (T, 2), generator=g)
    weights = torch.rand(T, 2, generator=g) * 2 - 0.5
    expanded = slot_gate(slot_ids, weights, first, count, n * r, dtype)
    base = torch.randn(T, D, generator=g).to(dtype)

    want = routed_lora_stacked(x, A_flat, block.reshape(count * n * r, D), expanded, base.clone())
    pairs = list(zip(member_Bt, cols, strict=True))
    got = routed_lora_stacked_group(x, A_flat, pairs, r, expanded, base.clone())
    assert_matches(got, want)
    untouched = torch.ones(D, dtype=torch.bool)
    for c, w in zip(cols, widths, strict=True):
        untouched[c : c + w] = False
    assert torch.equal(got[:, untouched], base[:, untouched])  # only members' columns move


def test_group_expand_differentiates_like_its_twin() -> None:
    """Under autograd the regrouping cannot write into a buffer (`out=`); the gradients with
    respect to the input and the A rows must still be the twin's."""
    g = torch.Generator().manual_seed(7)
    count, n, r, d_in, widths = 3, 2, 4, 9, [5, 6]
    A_flat = torch.randn(count * n * r, d_in, generator=g)
    member_Bt = [torch.randn(count * r, w, generator=g) for w in widths]
    block = torch.zeros(count, n * r, sum(widths))
    block[:, :r, :5] = member_Bt[0].view(count, r, -1)
    block[:, r:, 5:] = member_Bt[1].view(count, r, -1)
    slot_ids = torch.randint(0, count + 2, (6, 1), generator=g)
    expanded = slot_gate(slot_ids, torch.rand(6, 1, generator=g), 1, count, n * r)
    x = torch.randn(6, d_in, generator=g)
    grads = []
    for group in (True, False):
        xg, ag = x.clone().requires_grad_(), A_flat.clone().requires_grad_()
        if group:
            y = routed_lora_stacked_group(xg, ag, [(member_Bt[0], 0), (member_Bt[1], 5)], r,
                                          expanded, torch.zeros(6, 11))  # fmt: skip
        else:
            y = routed_lora_stacked(xg, ag, block.reshape(count * n * r, -1), expanded)
        y.square().sum().backward()
        grads.append((xg.grad, ag.grad))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want)


@settings(max_examples=40, deadline=None)
@given(
    **GROUP_SHAPES,
    count=st.integers(1, 5),
    width=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_a_lone_projection_through_the_group_path_is_bit_for_bit_its_twin(
    seed: int, T: int, count: int, r: int, d_in: int, width: int, dtype: torch.dtype
) -> None:
    """The group form with one member runs the same shrink, selection and expand as the
    one-projection delta, so it gives exactly its bits."""
    g = torch.Generator().manual_seed(seed)
    A_flat = (torch.randn(count * r, d_in, generator=g) / d_in**0.5).to(dtype)
    Bt_flat = (torch.randn(count * r, width, generator=g) / r**0.5).to(dtype)
    x = torch.randn(T, d_in, generator=g).to(dtype)
    slot_ids = torch.randint(-1, count + 3, (T, 2), generator=g)
    gate = slot_gate(slot_ids, torch.rand(T, 2, generator=g), 1, count, r, dtype)
    base = torch.randn(T, width, generator=g).to(dtype)
    with torch.inference_mode():
        want = routed_lora_stacked(x, A_flat, Bt_flat, gate, base.clone())
        got = routed_lora_stacked_group(x, A_flat, [(Bt_flat, 0)], r, gate, base.clone())
    assert torch.equal(got, want)
