"""A fused group's one-shrink routed LoRA equals the per-projection twin, on every layout.

The twin is the definition applied member by member: `base_m(x) + routed_lora_dense(x, A_m, B_m)`
from the raw adapter tensors written into the hot-set. Cases cover random shapes, ranks, slot
tables, adapters that target only some members (zero delta for the rest), members no adapter
targets at all, and learned top-k routes (the table comes from the gates, per layer).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.device_plan import build_device_plan
from kernels.reference import routed_lora_dense
from kernels.stacked import routed_lora_stacked, slot_gate
from molora_runtime.model.cpu_lora import PackedLoRA, StackedLoRA
from molora_runtime.model.layers import FusedLinear, LoRALinear
from molora_runtime.model.lora_backend import LoRABackend, ReferenceBackend
from molora_runtime.model.lora_context import GateTable, LoRAContext
from molora_runtime.model.slot_buffers import GroupBuffers, LoRABuffers
from tests.kernels.kernel_cases import GROUP_SHAPES, assert_matches

CPU = torch.device("cpu")


def _group(widths: list[int], d_in: int, layer: int, dtype: torch.dtype, g: torch.Generator):
    members = []
    for i, w in enumerate(widths):
        m = LoRALinear(d_in, w, False, f"m{i}", layer)
        with torch.no_grad():
            m.weight.copy_(torch.randn(w, d_in, generator=g) / d_in**0.5)
        members.append(m.to(dtype))
    fused = FusedLinear(members)
    fused.fuse()
    return fused


def _learned_ctx(
    slot_ids, weights, S: int, L: int, d: int, g: torch.Generator, backend: LoRABackend
) -> LoRAContext:
    T, W = slot_ids.shape
    C, K = 2, 3
    gates = GateTable(
        weight=torch.randn(C, L, K, d, generator=g),
        bias=torch.randn(C, L, K, generator=g),
        expert_slots=torch.randint(1, S, (C, K), generator=g),
        num_experts=torch.randint(1, K + 1, (C,), generator=g),
    )
    return LoRAContext(
        slot_ids=slot_ids,
        weights=weights,
        backend=backend,
        comp_idx=torch.randint(-1, C, (T,), generator=g),
        gates=gates,
        top_k=torch.randint(1, W + 1, (T,), generator=g),
        temperature=torch.rand(T, generator=g) + 0.5,
    )


@settings(max_examples=25, deadline=None)
@given(
    **GROUP_SHAPES,
    W=st.integers(1, 3),
    S=st.integers(2, 5),
    widths=st.lists(st.integers(1, 24), min_size=2, max_size=3),
    data=st.data(),
)
def test_fused_group_delta_matches_per_projection_twin(
    seed: int, T: int, W: int, S: int, r: int, d_in: int, widths: list[int], data: st.DataObject
) -> None:
    g = torch.Generator().manual_seed(seed)
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    n = len(widths)
    targeted = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    if not any(targeted):
        targeted[data.draw(st.integers(0, n - 1))] = True
    L, layer = 2, 1
    # Raw adapters: slot s targets member i iff hits[s][i] (partial-member adapters).
    A = [torch.randn(S, r, d_in, generator=g) / d_in**0.5 for _ in widths]
    B = [torch.randn(S, w, r, generator=g) / r**0.5 for w in widths]
    hits = [[t and bool(torch.rand(1, generator=g) < 0.7) for t in targeted] for _ in range(S)]
    for i in range(n):
        for s in range(S):
            if not hits[s][i]:
                A[i][s].zero_()
                B[i][s].zero_()
    x = torch.randn(T, d_in, generator=g).to(dtype)
    slot_ids = torch.randint(-1, S, (T, W), generator=g)
    weights = torch.rand(T, W, generator=g) * 2 - 0.5
    learned = data.draw(st.booleans())

    def context(backend: LoRABackend) -> LoRAContext:
        if learned:
            gen = torch.Generator().manual_seed(seed)
            ctx = _learned_ctx(slot_ids, weights, S, L, d_in, gen, backend)
        else:
            ctx = LoRAContext(slot_ids=slot_ids, weights=weights, backend=backend)
        ctx.begin_layer(layer, x)
        return ctx

    table = context(ReferenceBackend())
    want = []
    for i in range(n):
        fused = _group(widths, d_in, layer, dtype, torch.Generator().manual_seed(seed))
        base = (x @ fused.members[i].weight.t()).float()
        Ad, Bd = A[i].to(dtype), B[i].to(dtype)
        if targeted[i]:
            base = base + routed_lora_dense(x, Ad, Bd, table.slot_ids, table.weights).float()
        want.append(base.to(dtype))

    # 1. stacked group layout (CPU): one shrink, then each member's expand into the fused
    # output, with plain GEMMs and on packed copies of the slot range
    fused = _group(widths, d_in, layer, dtype, torch.Generator().manual_seed(seed))
    group = GroupBuffers.stacked_group(S, L, r, d_in, widths, targeted, dtype, CPU)
    for i, member in enumerate(group.members):
        fused.members[i].lora = member
        if member is None:
            continue
        for s in range(S):
            member.clear_slot(s)
            if hits[s][i]:
                member.write(s, layer, A[i][s], B[i][s])
    fused.lora = group
    for backend in (StackedLoRA(), PackedLoRA()):
        ctx = context(backend)
        ctx.stacked_slots = (1, S - 1)
        for got, w in zip(fused(x, ctx), want, strict=True):
            assert_matches(got, w)
    # 2. kernel layout (CUDA / training): the reference twin per targeted member
    members: list[LoRABuffers | None] = []
    for i, m in enumerate(fused.members):
        buf = None
        if targeted[i]:
            buf = LoRABuffers.allocate(S, L, r, d_in, widths[i], dtype, CPU, stacked=False)
            for s in range(S):
                buf.write(s, layer, A[i][s], B[i][s])
        m.lora = buf
        members.append(buf)
    fused.lora = GroupBuffers(members, widths)
    for got, w in zip(fused(x, context(ReferenceBackend())), want, strict=True):
        assert_matches(got, w)


def test_group_slot_clear_leaves_other_members_and_slots() -> None:
    """Clearing one slot through a member view zeroes exactly that member's block of it."""
    group = GroupBuffers.stacked_group(
        3, 2, 2, 4, [5, 3, 3], [True, False, True], torch.float32, CPU
    )
    for m in group.members:
        if m is not None:
            for s in range(3):
                m.write(s, 1, torch.ones(2, 4), torch.ones(m.B.shape[-1], 2))
    assert group.members[1] is None
    assert [c for _, c in group.slot_views(1, 0, 3)[1]] == [0, 8]  # no block for the untargeted
    group.members[0].clear_slot(1)  # type: ignore[union-attr]
    assert not group.A[:, 1, :2].any() and group.A[1, 1, 2:].all()
    assert group.A[1, 2].all()


def test_triton_with_device_plan_matches_without() -> None:
    """The Triton path reading a per-step DevicePlan equals rebuilding it per call (interpreter)."""
    from kernels.triton_ops import routed_lora_multi_triton

    g = torch.Generator().manual_seed(0)
    S, r, d_in, T, W = 3, 4, 16, 5, 2
    pairs = [
        (torch.randn(S, r, d_in, generator=g), torch.randn(S, d, r, generator=g)) for d in (8, 4)
    ]
    x = torch.randn(T, d_in, generator=g)
    ids = torch.randint(-1, S, (T, W), generator=g)
    w = torch.rand(T, W, generator=g)
    plan = build_device_plan(ids, w)
    for mode in ("bgmv", "sgmv"):
        a = routed_lora_multi_triton(x, pairs, ids, w, mode=mode)
        b = routed_lora_multi_triton(x, pairs, ids, w, mode=mode, plan=plan)
        for got, ref, (A, B) in zip(b, a, pairs, strict=True):
            assert_matches(got, routed_lora_dense(x, A, B, ids, w))
            torch.testing.assert_close(got, ref)


def test_group_block_pair_adds_what_the_per_member_expand_adds() -> None:
    """The block-structured pair a group hands the packed backend is the same delta as its own
    per-member expand."""
    g = torch.Generator().manual_seed(3)
    group = GroupBuffers.stacked_group(
        4, 2, 3, 10, [6, 2, 5], [True, False, True], torch.float32, CPU
    )
    for m in group.members:
        if m is not None:
            for s in range(1, 4):
                a, b = torch.randn(3, 10, generator=g), torch.randn(m.width, 3, generator=g)
                m.write(s, 1, a, b)
    x = torch.randn(7, 10, generator=g)
    ids = torch.randint(0, 4, (7, 1), generator=g)
    w = torch.rand(7, 1, generator=g)
    A_flat, block = group.block_pair(1, 1, 3)
    want = routed_lora_stacked(
        x, A_flat, block, slot_gate(ids, w, 1, 3, group.rank), torch.zeros(7, 13)
    )
    ctx = LoRAContext(ids, w, backend=StackedLoRA(), stacked_slots=(1, 3))
    got = ctx.add_lora(torch.zeros(7, 13), x, group, 1)
    assert_matches(got, want)
    assert got[:, 6:8].abs().sum() == 0 and got[:, :6].abs().sum() > 0


@pytest.mark.parametrize("packed", [False, True])
def test_stacked_deltas_see_slots_written_after_their_views_were_cached(packed: bool) -> None:
    """A member's and a group's stacked delta keep their slot-range views (and packed copies)
    between steps; an adapter loaded into a slot afterwards must be what the next step uses."""
    g = torch.Generator().manual_seed(5)
    group = GroupBuffers.stacked_group(
        4, 2, 3, 10, [6, 2, 5], [True, False, True], torch.float32, CPU
    )
    single = LoRABuffers.allocate(4, 2, 3, 10, 7, torch.float32, CPU, stacked=True)
    x = torch.randn(5, 10, generator=g)
    ids = torch.tensor([[1], [2], [3], [2], [1]])
    w = torch.ones(5, 1)
    backend = PackedLoRA() if packed else StackedLoRA()

    def deltas() -> tuple[torch.Tensor, torch.Tensor]:
        ctx = LoRAContext(ids, w, backend=backend, stacked_slots=(1, 3))
        got_group = ctx.add_lora(torch.zeros(5, 13), x, group, 1)
        return got_group, ctx.add_lora(torch.zeros(5, 7), x, single, 1)

    assert all(d.abs().sum() == 0 for d in deltas())  # empty slots: views cached here
    for s in (1, 2, 3):
        for m in [*(m for m in group.members if m is not None), single]:
            m.write(s, 1, torch.randn(3, 10, generator=g), torch.randn(m.width, 3, generator=g))
    got_group, got_single = deltas()
    A, B = single.kernel_pair(1)
    assert_matches(got_single, routed_lora_dense(x, A, B, ids, w))
    for m, col in zip(group.members, (0, 6, 8), strict=True):
        if m is None:
            continue
        A, B = m.kernel_pair(1)
        assert_matches(got_group[:, col : col + B.shape[1]], routed_lora_dense(x, A, B, ids, w))
