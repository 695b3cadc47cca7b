"""Gate statistics queued on the device equal the old per-step host read-back, step for step."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from molora_runtime.engine.route_stats.attribution import attributions
from molora_runtime.engine.route_stats.gate_stats import GateStats
from molora_runtime.engine.types import TokenAttribution
from molora_runtime.model.lora_context import GateTable, LoRAContext


class FakeHotSet:
    def __init__(self, experts: dict[str, list[int]]) -> None:
        self.experts = experts  # composition -> expert slots; its gate slot is its index

    def compositions(self) -> list[str]:
        return sorted(self.experts)

    def comp_slot_of(self, name: str) -> int:
        return sorted(self.experts).index(name)

    def composition_info(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(experts=self.experts[name])


def old_record(hot_set: FakeHotSet, ctx: LoRAContext, into: dict[str, torch.Tensor]) -> None:
    """The previous `GateStats.record` (host sync per composition per step), as the twin."""
    slots = torch.stack([t[0] for t in ctx.layer_tables])
    weights = torch.stack([t[1] for t in ctx.layer_tables])
    for comp in hot_set.compositions():
        c = hot_set.comp_slot_of(comp)
        mask = ctx.comp_idx == c
        if not bool(mask.any()):
            continue
        k = int(ctx.gates.num_experts[c])
        experts = ctx.gates.expert_slots[c, :k]
        hit = (slots[:, mask, :, None] == experts) & (weights[:, mask, :, None] > 0)
        counts = hit.sum(dim=(1, 2)).cpu()
        prev = into.get(comp)
        into[comp] = counts if prev is None or prev.shape != counts.shape else prev + counts


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), fold_every=st.sampled_from([1, 2, 5, 64]), data=st.data())
def test_gate_stats_equal_the_host_twin(seed: int, fold_every: int, data: st.DataObject) -> None:
    g = torch.Generator().manual_seed(seed)
    L, W, S, K = 3, 2, 6, 4
    hot_set = FakeHotSet({"a": [1, 2, 3], "b": [4, 5]})
    stats, twin = GateStats(hot_set, fold_every=fold_every), {}  # type: ignore[arg-type]
    for _ in range(data.draw(st.integers(1, 12))):
        if data.draw(st.booleans()):  # a composition re-registered with other experts
            hot_set.experts["b"] = data.draw(st.sampled_from([[4, 5], [4, 5, 1], [2]]))
        C = len(hot_set.experts)
        slots_c = torch.zeros(C, K, dtype=torch.long)
        num = torch.zeros(C, dtype=torch.long)
        for name, ex in hot_set.experts.items():
            c = hot_set.comp_slot_of(name)
            slots_c[c, : len(ex)] = torch.tensor(ex)
            num[c] = len(ex)
        T = data.draw(st.integers(1, 6))
        gates = GateTable(torch.zeros(C, L, K, 1), torch.zeros(C, L, K), slots_c, num)
        ctx = LoRAContext(
            slot_ids=torch.zeros(T, W, dtype=torch.long),
            weights=torch.zeros(T, W),
            comp_idx=torch.randint(-1, C, (T,), generator=g),
            gates=gates,
        )
        ctx.layer_tables = [
            (torch.randint(0, S, (T, W), generator=g), torch.rand(T, W, generator=g) - 0.2)
            for _ in range(L)
        ]
        stats.record(ctx)
        old_record(hot_set, ctx, twin)
        if data.draw(st.booleans()):
            assert stats.pop() == {k: v.long().tolist() for k, v in twin.items()}
            twin.clear()
    assert stats.pop() == {k: v.long().tolist() for k, v in twin.items()}


def old_attribution(ctx: LoRAContext, index: int, token: int, names: dict[int, str]):
    """The previous per-row read-back (two syncs a token), as the twin."""
    slots = torch.stack([t[0][index] for t in ctx.layer_tables]).cpu()
    weights = torch.stack([t[1][index] for t in ctx.layer_tables]).float().cpu()
    totals: dict[str, float] = {}
    for s, w in zip(slots.flatten().tolist(), weights.flatten().tolist(), strict=True):
        if s > 0 and w != 0.0:
            name = names.get(s, f"slot{s}")
            totals[name] = totals.get(name, 0.0) + w
    n = len(ctx.layer_tables)
    return TokenAttribution(
        token_id=token, adapters={k: round(v / n, 4) for k, v in totals.items()}
    )


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), T=st.integers(1, 7), W=st.integers(1, 3))
def test_batched_attribution_equals_per_row(seed: int, T: int, W: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ctx = LoRAContext(slot_ids=torch.zeros(T, W, dtype=torch.long), weights=torch.zeros(T, W))
    ctx.layer_tables = [
        (torch.randint(-1, 5, (T, W), generator=g), torch.rand(T, W, generator=g) - 0.3)
        for _ in range(3)
    ]
    names = {1: "a", 2: "b", 3: "c"}  # slot 4 has no name: reported as "slot4"
    rows = torch.randint(0, T, (T,), generator=g).tolist()
    tokens = list(range(100, 100 + T))
    want = [old_attribution(ctx, r, t, names) for r, t in zip(rows, tokens, strict=True)]
    assert attributions(ctx, rows, tokens, names) == want
