"""Rank-bucketed slot pools: adapters of different ranks share one hot-set, each padded only to
its pool's rank, not to the largest rank served.

Slot ids stay global (1..N, what routing tables hold); pool `p` owns ids
`[p.first, p.first + p.slots)`. Each pool has its own static buffers (a captured graph stays
valid), and a layer's `PooledBuffers` lists them. `PooledBackend` wraps the engine's backend:
per pool it renumbers the step's table into the pool's local ids (1-based, everything outside
the pool becomes 0, "no adapter") and calls the wrapped backend over that pool's buffers, so
every kernel and twin runs unchanged; a token routed to slots in two pools gets both deltas.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from molora_runtime.model.lora_backend import LoRABackend
from molora_runtime.model.lora_context import LoRAContext
from molora_runtime.model.slot_buffers import GroupBuffers, LoRABuffers


@dataclass(frozen=True)
class SlotPool:
    """Global slot ids `[first, first + slots)`, each padded to `rank`."""

    rank: int
    first: int
    slots: int

    def local(self, slot: int) -> int:
        """The pool's 1-based id of global slot `slot`."""
        return slot - self.first + 1

    def holds(self, slot: int) -> bool:
        return self.first <= slot < self.first + self.slots


def layout_pools(ranks_and_slots: list[tuple[int, int]]) -> list[SlotPool]:
    """Pools in the given order over consecutive global ids from 1 (0 is "no adapter")."""
    pools, first = [], 1
    for rank, slots in ranks_and_slots:
        pools.append(SlotPool(rank, first, slots))
        first += slots
    return pools


@dataclass(frozen=True)
class PooledBuffers:
    """One projection's (or fused group's) buffers, one per pool."""

    pools: tuple[tuple[SlotPool, LoRABuffers | GroupBuffers], ...]


class PooledBackend:
    """The engine's backend over rank pools (plain buffers go straight to it)."""

    def __init__(self, inner: LoRABackend) -> None:
        self.inner = inner
        self.name = f"{inner.name}+rank-pools"
        self.stacked = inner.stacked
        # The last table's per-pool contexts (holding `ctx` keeps its id from being reused).
        self._views: tuple[LoRAContext, torch.Tensor, torch.Tensor, dict] | None = None

    def add(
        self, y: torch.Tensor, x: torch.Tensor, buffers: object, layer: int, ctx: LoRAContext
    ) -> torch.Tensor:
        if not isinstance(buffers, PooledBuffers):
            return self.inner.add(y, x, buffers, layer, ctx)
        for pool, buf in buffers.pools:
            sub = self._pool_context(ctx, pool)
            if sub is not None:
                y = self.inner.add(y, x, buf, layer, sub)
        return y

    def _pool_context(self, ctx: LoRAContext, pool: SlotPool) -> LoRAContext | None:
        """`ctx` renumbered into `pool`'s local ids (None: this step touches none of its
        slots), made once per routing table and shared by every projection reading it."""
        views = self._views
        if (
            views is None
            or views[0] is not ctx
            or views[1] is not ctx.slot_ids
            or (views[2] is not ctx.weights)
        ):
            views = self._views = (ctx, ctx.slot_ids, ctx.weights, {})
        cache = views[3]
        if pool not in cache:
            cache[pool] = pool_context(ctx, pool, self.inner)
        return cache[pool]


def pool_context(ctx: LoRAContext, pool: SlotPool, backend: LoRABackend) -> LoRAContext | None:
    """The routing of `ctx` as `pool`'s buffers see it: local ids, the pool's stacked range."""
    stacked = None
    if ctx.stacked_slots is not None:
        first, count = ctx.stacked_slots
        lo, hi = max(first, pool.first), min(first + count, pool.first + pool.slots)
        if lo >= hi:
            return None
        stacked = (pool.local(lo), hi - lo)
    elif backend.stacked:
        return None  # no token of this step uses an adapter
    ids = ctx.slot_ids
    inside = (ids >= pool.first) & (ids < pool.first + pool.slots)
    local = torch.where(inside, ids - (pool.first - 1), torch.zeros((), dtype=ids.dtype))
    return replace(
        ctx, slot_ids=local, backend=backend, stacked_slots=stacked, gated=ctx.learned_routes,
        comp_idx=None, gates=None,
        record_layers=False, return_gate_logits=False, layer_tables=[], gate_logits=[],
        layer_logits=[], _static=None, _gates=None, _device_plan=None, _router=None, _routes=None,
        _routed_layers=0, _stacked={},
    )  # fmt: skip
