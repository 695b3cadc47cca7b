"""Rank pools: every backend over per-pool buffers (each slot padded only to its pool's rank)
adds what the dense definition adds over one padded buffer of the same adapters.

A fused group of 2-3 members and a lone projection; tokens mixing slots of several pools
(top-k rows spanning pools), ids <= 0, negative weights, learned rows re-gated per layer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.reference import routed_lora_dense
from molora_runtime.lora.routing import stacked_range
from molora_runtime.model.cpu_lora import PackedLoRA, StackedLoRA
from molora_runtime.model.lora_backend import (
    LoRABackend,
    ReferenceBackend,
    TritonBackend,
)
from molora_runtime.model.lora_context import GateTable, LoRAContext
from molora_runtime.model.rank_pools import PooledBackend, PooledBuffers, SlotPool, layout_pools
from molora_runtime.model.slot_buffers import GroupBuffers, LoRABuffers
from tests.kernels.kernel_cases import assert_matches

CPU = torch.device("cpu")
L, LAYER = 2, 1


class Adapters:
    """Random adapters of global slots 1..N, slot s of rank <= its pool's, one per member."""

    def __init__(self, pools: list[SlotPool], d_in: int, widths: list[int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.pools, self.d_in, self.widths = pools, d_in, widths
        self.N = sum(p.slots for p in pools)
        self.R = max(p.rank for p in pools)
        self.slots: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for p in pools:
            for s in range(p.first, p.first + p.slots):
                r = int(torch.randint(1, p.rank + 1, (1,), generator=g))
                self.slots[s] = [
                    (
                        torch.randn(r, d_in, generator=g) / d_in**0.5,
                        torch.randn(w, r, generator=g) / r**0.5,
                    )
                    for w in widths
                ]

    def padded(self, member: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The padded layout of one member: `A [N+1, R, d_in]`, `B [N+1, w, R]`, slot 0 zero."""
        A = torch.zeros(self.N + 1, self.R, self.d_in)
        B = torch.zeros(self.N + 1, self.widths[member], self.R)
        for s, pairs in self.slots.items():
            a, b = pairs[member]
            A[s, : a.shape[0]], B[s, :, : a.shape[0]] = a, b
        return A.to(dtype), B.to(dtype)

    def pooled(self, stacked: bool, dtype: torch.dtype) -> PooledBuffers:
        """Per pool a fused group's buffers in the backend's layout, written slot by slot."""
        parts = []
        for p in self.pools:
            if stacked:  # no zero row: pool id s is row s - 1
                group = GroupBuffers.stacked_group(
                    p.slots, L, p.rank, self.d_in, self.widths, [True] * len(self.widths),
                    dtype, CPU, slot_base=1,
                )  # fmt: skip
                row0 = 1
            else:
                members: list[LoRABuffers | None] = [
                    LoRABuffers.allocate(p.slots + 1, L, p.rank, self.d_in, w, dtype, CPU, False)
                    for w in self.widths
                ]
                group = GroupBuffers(members, self.widths)
                row0 = 0
            for s in range(p.first, p.first + p.slots):
                for (m, _), (a, b) in zip(group.columns, self.slots[s], strict=True):
                    m.write(p.local(s) - row0, LAYER, a, b)
            parts.append((p, group))
        return PooledBuffers(tuple(parts))


def context(ids, weights, backend, learned_seed: int | None, N: int, d: int) -> LoRAContext:
    ctx = LoRAContext(slot_ids=ids, weights=weights, backend=backend)
    if learned_seed is not None:
        g = torch.Generator().manual_seed(learned_seed)
        T, W = ids.shape
        C, K = 2, 3
        ctx.gates = GateTable(
            weight=torch.randn(C, L, K, d, generator=g),
            bias=torch.randn(C, L, K, generator=g),
            expert_slots=torch.randint(1, N + 1, (C, K), generator=g),
            num_experts=torch.randint(1, K + 1, (C,), generator=g),
        )
        ctx.comp_idx = torch.randint(-1, C, (T,), generator=g)
        ctx.top_k = torch.randint(1, W + 1, (T,), generator=g)
        ctx.temperature = torch.rand(T, generator=g) + 0.5
    return ctx


def run(backend: LoRABackend, adapters: Adapters, x, ids, weights, learned_seed, dtype):
    """The pooled backend's output over a zero base, and the routing table it used."""
    pooled = PooledBackend(backend)
    ctx = context(ids, weights, pooled, learned_seed, adapters.N, adapters.d_in)
    ctx.begin_layer(LAYER, x)
    if backend.stacked:
        used = set(ctx.slot_ids[ctx.slot_ids > 0].tolist())
        if ctx.gates is not None:
            used.update(ctx.gates.expert_slots.flatten().tolist())
        ctx.stacked_slots = stacked_range(used)
    buffers = adapters.pooled(backend.stacked, dtype)
    y = torch.zeros(x.shape[0], sum(adapters.widths), dtype=dtype)
    with torch.inference_mode():
        got = ctx.add_lora(y, x, buffers, LAYER)
    return got, ctx.slot_ids, ctx.weights


def want(adapters: Adapters, x, ids, weights, dtype) -> torch.Tensor:
    cols = []
    for i in range(len(adapters.widths)):
        A, B = adapters.padded(i, dtype)
        cols.append(routed_lora_dense(x, A, B, ids, weights))
    return torch.cat(cols, dim=1)


@st.composite
def pool_shapes(draw: st.DrawFn) -> list[SlotPool]:
    ranks = draw(st.lists(st.integers(1, 12), min_size=1, max_size=3, unique=True))
    return layout_pools([(r, draw(st.integers(1, 3))) for r in sorted(ranks)])


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    pools=pool_shapes(),
    T=st.integers(1, 10),
    W=st.integers(1, 3),
    d_in=st.integers(1, 24),
    widths=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    learned=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    backend=st.sampled_from(["reference", "stacked", "stacked-packed"]),
)
def test_pooled_backend_matches_the_padded_definition(
    seed, pools, T, W, d_in, widths, learned, dtype, backend
) -> None:
    adapters = Adapters(pools, d_in, widths, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d_in, generator=g).to(dtype)
    ids = torch.randint(-1, adapters.N + 1, (T, W), generator=g)
    weights = torch.rand(T, W, generator=g) * 2 - 0.5
    inner = {
        "reference": ReferenceBackend(),
        "stacked": StackedLoRA(),
        "stacked-packed": PackedLoRA(),
    }[backend]
    got, table_ids, table_w = run(
        inner, adapters, x, ids, weights, seed if learned else None, dtype
    )
    assert_matches(got, want(adapters, x, table_ids, table_w, dtype))


def test_a_step_that_touches_one_pool_skips_the_others() -> None:
    """The stacked range of a step inside one pool gives the other pools no context at all."""
    pools = layout_pools([(2, 2), (8, 1)])
    ctx = LoRAContext(torch.tensor([[1], [2]]), torch.ones(2, 1), stacked_slots=(1, 2))
    backend = PooledBackend(StackedLoRA())
    small = backend._pool_context(ctx, pools[0])
    assert small is not None and small.stacked_slots == (1, 2)
    assert backend._pool_context(ctx, pools[1]) is None
    ctx = LoRAContext(torch.tensor([[3], [0]]), torch.ones(2, 1), stacked_slots=(3, 1))
    big = backend._pool_context(ctx, pools[1])
    assert big is not None and big.stacked_slots == (1, 1)
    assert big.slot_ids.tolist() == [[1], [0]]  # global 3 is the big pool's first slot


@pytest.mark.parametrize("mode", ["bgmv", "sgmv"])
def test_triton_over_pools_matches_the_padded_definition(mode: str) -> None:
    """The CUDA backend's kernels (interpreter) over per-pool buffers, rows spanning pools."""
    from kernels import triton_ops

    pools = layout_pools([(4, 3), (16, 2)])
    adapters = Adapters(pools, 24, [8, 4, 4], seed=5)
    g = torch.Generator().manual_seed(6)
    T = 20 if mode == "sgmv" else 6
    x = torch.randn(T, 24, generator=g)
    ids = torch.randint(-1, adapters.N + 1, (T, 2), generator=g)
    ids[0] = torch.tensor([1, 5])  # one row over both pools
    weights = torch.rand(T, 2, generator=g)
    old = triton_ops.DECODE_MAX_PAIRS
    triton_ops.DECODE_MAX_PAIRS = 10**6 if mode == "bgmv" else 0
    try:
        got, table_ids, table_w = run(TritonBackend(), adapters, x, ids, weights, None, x.dtype)
    finally:
        triton_ops.DECODE_MAX_PAIRS = old
    assert_matches(got, want(adapters, x, table_ids, table_w, x.dtype))
