"""The one-composition gate path gives the general path's tables and stacked gates exactly."""

from __future__ import annotations

import pytest
import torch

from molora_runtime.model.learned_gate import LearnedPlan
from molora_runtime.model.lora_context import GateTable, LoRAContext

T, C, L, K, D, W = 12, 2, 4, 5, 16, 3
RANKS = (12, 8, 4)  # a q/k/v group, a gate/up group, a lone projection at rank 4


def gate_table() -> GateTable:
    gen = torch.Generator().manual_seed(3)
    return GateTable(
        weight=torch.randn(C, L, K, D, generator=gen),
        bias=torch.randn(C, L, K, generator=gen),
        # composition 1 has 4 real experts on slots 2, 5, 3, 4; composition 0 is a decoy
        expert_slots=torch.tensor([[1, 2, 0, 0, 0], [2, 5, 3, 4, 0]]),
        num_experts=torch.tensor([2, 4]),
    )


def context(learned_rows: int, top_k: int, temp: float, plan: bool) -> LoRAContext:
    comp = torch.full((T,), -1, dtype=torch.long)
    comp[:learned_rows] = 1
    static_slots = torch.zeros(T, W, dtype=torch.long)
    static_slots[learned_rows:, 0] = 5
    static_w = torch.zeros(T, W)
    static_w[learned_rows:, 0] = 1.0
    ctx = LoRAContext(
        static_slots,
        static_w,
        comp_idx=comp,
        gates=gate_table(),
        top_k=torch.full((T,), top_k),
        temperature=torch.full((T,), temp),
        stacked_slots=(2, 4),
        record_layers=True,
    )
    if plan:
        ctx.learned_plan = LearnedPlan(1, 4, top_k, temp, learned_rows == T)
    return ctx


@pytest.mark.parametrize("learned_rows", [T, 7], ids=["all-learned", "mixed-step"])
@pytest.mark.parametrize(("top_k", "temp"), [(1, 1.0), (2, 1.0), (3, 0.5), (2, 3.0)])
def test_fast_path_equals_general_path(learned_rows: int, top_k: int, temp: float) -> None:
    general = context(learned_rows, top_k, temp, plan=False)
    fast = context(learned_rows, top_k, temp, plan=True)
    gen = torch.Generator().manual_seed(11)
    for layer in range(L):
        normed = torch.randn(T, D, generator=gen)
        general.begin_layer(layer, normed)
        fast.begin_layer(layer, normed)
        assert torch.equal(general.slot_ids, fast.slot_ids)
        torch.testing.assert_close(general.weights, fast.weights, atol=1e-6, rtol=0)
        for rank in RANKS:
            for dtype in (torch.float32, torch.bfloat16):
                a, b = general.slot_gate(rank, dtype), fast.slot_gate(rank, dtype)
                assert torch.equal(a.inactive, b.inactive)
                torch.testing.assert_close(a.weights, b.weights, atol=1e-6, rtol=0)
    # the tempered logits kept for telemetry agree on the real experts
    for a, b in zip(general.layer_logits, fast.layer_logits, strict=True):
        torch.testing.assert_close(a[:learned_rows, :4], b[:learned_rows], atol=1e-5, rtol=0)


def test_top1_weights_are_exactly_one() -> None:
    ctx = context(T, 1, 1.0, plan=True)
    ctx.begin_layer(0, torch.randn(T, D))
    assert torch.equal(ctx.weights[:, 0], torch.ones(T))
    assert torch.equal(ctx.weights[:, 1:], torch.zeros(T, W - 1))
    assert set(ctx.slot_ids[:, 0].tolist()) <= {2, 5, 3, 4}


@pytest.mark.parametrize("record", [True, False])
def test_idle_layers_skip_the_stacked_gates_and_keep_the_records(record: bool) -> None:
    """Layers no slot holds weights for build no stacked gate and add nothing; the tables of
    the others, and the recorded tables of every layer, are those of a context without skips."""
    full = context(T, 2, 1.0, plan=True)
    skip = context(T, 2, 1.0, plan=True)
    full.record_layers = skip.record_layers = record
    skip.lora_layers = frozenset({1, 3})
    gen = torch.Generator().manual_seed(5)
    for layer in range(L):
        normed = torch.randn(T, D, generator=gen)
        full.begin_layer(layer, normed)
        skip.begin_layer(layer, normed)
        y = torch.randn(T, 6)
        if layer in skip.lora_layers:
            assert torch.equal(full.slot_ids, skip.slot_ids)
            assert torch.equal(full.slot_gate(8, torch.float32).weights,
                               skip.slot_gate(8, torch.float32).weights)  # fmt: skip
        else:
            assert skip.add_lora(y, torch.randn(T, D), object(), layer) is y
    assert len(skip.layer_tables) == (L if record else 0)
    for a, b in zip(full.layer_tables, skip.layer_tables, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_plan_cache_is_reused_across_steps_and_renewed_when_experts_move() -> None:
    """A second step on the same gate table reuses the plan's cache and still gives the general
    path's tables; experts bound to other slots key a new cache with the new slots."""
    table = gate_table()
    gen = torch.Generator().manual_seed(7)
    caches = []
    for experts in [(2, 5, 3, 4), (2, 5, 3, 4), (3, 2, 5, 4)]:
        table.expert_slots[1, :4] = torch.tensor(experts)
        general = context(T, 2, 1.0, plan=False)
        fast = context(T, 2, 1.0, plan=True)
        general.gates = fast.gates = table
        assert fast.learned_plan is not None
        fast.learned_plan.expert_slots = experts
        for layer in range(L):
            normed = torch.randn(T, D, generator=gen)
            general.begin_layer(layer, normed)
            fast.begin_layer(layer, normed)
            assert torch.equal(general.slot_ids, fast.slot_ids)
            for rank in RANKS:
                a, b = general.slot_gate(rank, torch.float32), fast.slot_gate(rank, torch.float32)
                assert torch.equal(a.inactive, b.inactive)
                torch.testing.assert_close(a.weights, b.weights, atol=1e-6, rtol=0)
        caches.append(fast.learned_plan.cache)
    assert caches[0] is caches[1] and caches[2] is not caches[0]
    assert len(table.plans) == 2
