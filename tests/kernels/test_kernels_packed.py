"""The packed CPU delta (`packed_linear.routed_lora_packed`) equals its twin, the stacked delta
(`kernels.stacked`), over random shapes; packed copies follow every write to the slot buffers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import TOLERANCES

from kernels.stacked import routed_lora_stacked, slot_weight_matrix
from molora_runtime.model.group_buffers import GroupLoRABuffers
from molora_runtime.model.layers import LoRABuffers, stacked_delta
from molora_runtime.model.packed_linear import (
    pack_weight,
    packed_ready,
    routed_lora_packed,
)

BF16 = torch.bfloat16
pytestmark = pytest.mark.skipif(
    pack_weight(torch.zeros(8, 8, dtype=BF16)) is None,
    reason="no bf16 packing (panels or oneDNN) here",
)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to bf16 rounding (both sides are bf16 GEMMs, accumulated in another order)."""
    rtol, atol = TOLERANCES[BF16]
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol * (1.0 + scale))


def _buffers(S: int, L: int, r: int, d_in: int, d_out: int, seed: int) -> LoRABuffers:
    g = torch.Generator().manual_seed(seed)
    buf = LoRABuffers.allocate(S, L, r, d_in, d_out, BF16, torch.device("cpu"), stacked=True)
    for slot in range(1, S):
        for layer in range(L):
            a = (torch.randn(r, d_in, generator=g) / d_in**0.5).to(BF16)
            b = (torch.randn(d_out, r, generator=g) / r**0.5).to(BF16)
            buf.write(slot, layer, a, b)
    return buf


def _routing(T: int, S: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, S, (T, 2), generator=g)
    return ids, torch.rand(T, 2, generator=g)


@settings(max_examples=40, deadline=None)
@given(
    T=st.integers(1, 40),
    S=st.integers(2, 6),
    r=st.sampled_from([1, 4, 8, 16]),
    d_in=st.integers(8, 160),
    d_out=st.integers(8, 200),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_packed_matches_stacked_over_a_slot_range(
    T: int, S: int, r: int, d_in: int, d_out: int, seed: int, data: st.DataObject
) -> None:
    buf = _buffers(S, 2, r, d_in, d_out, seed)
    first = data.draw(st.integers(1, S - 1))
    count = data.draw(st.integers(1, S - first))
    ids, weights = _routing(T, S, seed)
    expanded = slot_weight_matrix(ids, weights, first, count, r)
    x = torch.randn(T, d_in, generator=torch.Generator().manual_seed(seed + 1)).to(BF16)
    base = torch.randn(T, d_out * 2, generator=torch.Generator().manual_seed(seed + 2)).to(BF16)
    want, got = base.clone(), base.clone()
    a_flat, bt_flat = buf.stacked_pair(1, first, count)
    routed_lora_stacked(x, a_flat, bt_flat, expanded, out=want[:, :d_out])  # a strided view
    packed = buf.packed_pairs.get(buf.A, buf.B, (1, first, count), lambda: (a_flat, bt_flat))
    assert packed is not None
    routed_lora_packed(x, packed[0], packed[1], expanded, out=got[:, :d_out])
    assert torch.equal(got[:, d_out:], base[:, d_out:])  # only the view's columns change
    _close(got, want)


def test_packed_copies_follow_writes_and_clears() -> None:
    S, r, d_in, d_out, T = 4, 8, 64, 96, 6
    buf = _buffers(S, 1, r, d_in, d_out, seed=3)
    ids, weights = _routing(T, S, seed=4)
    ids[:, 0] = 2  # every token uses slot 2
    expanded = slot_weight_matrix(ids, weights, 1, S - 1, r)
    x = torch.randn(T, d_in).to(BF16)

    def delta() -> torch.Tensor:
        out = torch.zeros(T, d_out, dtype=BF16)
        stacked_delta(buf, x, out, 0, (1, S - 1, expanded))
        return out.float()

    def reference() -> torch.Tensor:
        out = torch.zeros(T, d_out, dtype=BF16)
        a_flat, bt_flat = buf.stacked_pair(0, 1, S - 1)
        return routed_lora_stacked(x, a_flat, bt_flat, expanded, out=out).float()

    with torch.no_grad():
        first = delta()
        _close(first, reference())
        buf.write(2, 0, torch.ones(r, d_in, dtype=BF16), torch.ones(d_out, r, dtype=BF16))
        after_write = delta()
        assert not torch.allclose(after_write, first)
        _close(after_write, reference())
        for slot in range(1, S):
            buf.clear_slot(slot)
        assert not delta().any()  # cleared slots: no delta, not a stale packed copy


def test_group_members_writes_reach_the_groups_packed_copies() -> None:
    # A fused group's members write through views of the group's tensors; the group's packed
    # copies must see those writes (views share their base's version counter).
    group = GroupLoRABuffers(3, 1, 4, 32, [16, 8], [True, True], BF16, torch.device("cpu"))
    x = torch.randn(5, 32).to(BF16)
    ids = torch.full((5, 1), 1)
    expanded = slot_weight_matrix(ids, torch.ones(5, 1), 1, 2, group.rank)

    def delta() -> torch.Tensor:
        out = torch.zeros(5, 24, dtype=BF16)
        return stacked_delta(group, x, out, 0, (1, 2, expanded)).float()

    with torch.no_grad():
        assert not delta().any()
        member = group.members[1]
        assert member is not None
        member.write(1, 0, torch.ones(4, 32, dtype=BF16), torch.ones(8, 4, dtype=BF16))
        got = delta()
        assert not got[:, :16].any() and got[:, 16:].abs().min() > 0


def test_packed_path_is_for_bf16_serving_only() -> None:
    x = torch.randn(4, 8)
    assert not packed_ready(x)  # fp32: MKL's plain small GEMMs are as fast
    assert packed_ready(x.to(BF16))
    grad = x.to(BF16).requires_grad_()
    with torch.enable_grad():
        assert not packed_ready(grad)  # training keeps autograd-aware GEMMs
    assert not packed_ready(x.to(BF16)[None])
