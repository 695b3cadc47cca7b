"""The slot buffers of every LoRA target module, allocated for the engine's backend and attached
to the model's layers; the one place adapter weights are written into a slot."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from molora_runtime.config import HotSetConfig
from molora_runtime.errors import AdapterLoadError
from molora_runtime.lora.peft_adapter import AdapterWeights
from molora_runtime.model.arch import ModelArch
from molora_runtime.model.decoder import CausalLM
from molora_runtime.model.rank_pools import PooledBuffers, SlotPool, layout_pools
from molora_runtime.model.slot_buffers import GroupBuffers, LoRABuffers, SlotValueError

log = logging.getLogger(__name__)


class PoolBuffers:
    """One rank pool's buffers: per target module `LoRABuffers` and per fused group (q/k/v,
    gate/up) the `GroupBuffers` its layer calls the backend with.

    `rows` buffer rows from `slot_base` on: the single padded pool keeps row 0 as the all-zero
    "no adapter" slot, a rank pool's stacked buffers keep none (kernel ones do: kernels index
    rows by slot id).
    """

    def __init__(
        self, model: CausalLM, targets: list[str], rank: int, rows: int, slot_base: int,
        stacked: bool, dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        arch: ModelArch = model.arch
        L, wanted = arch.num_layers, set(targets)
        self.rows, self.slot_base = rows, slot_base
        self.buffers: dict[str, LoRABuffers] = {}
        self.groups: dict[tuple[str, ...], GroupBuffers] = {}
        for fused in model.fused_groups():
            names = fused.names
            if names in self.groups or not wanted.intersection(names):
                continue
            shapes = [arch.linear_shape(n) for n in names]
            widths = [d_out for _, d_out in shapes]
            hit = [n in wanted for n in names]
            if stacked:  # one shared A: one shrink for the whole group
                group = GroupBuffers.stacked_group(
                    rows, L, rank, shapes[0][0], widths, hit, dtype, device, slot_base
                )
            else:
                members = [
                    LoRABuffers.allocate(rows, L, rank, d_in, d_out, dtype, device, stacked=False)
                    if t else None
                    for (d_in, d_out), t in zip(shapes, hit, strict=True)
                ]  # fmt: skip
                group = GroupBuffers(members, widths)
            self.groups[names] = group
            for name, member in zip(names, group.members, strict=True):
                if member is not None:
                    self.buffers[name] = member
        for module in targets:
            if module not in self.buffers:
                d_in, d_out = arch.linear_shape(module)
                self.buffers[module] = LoRABuffers.allocate(
                    rows, L, rank, d_in, d_out, dtype, device, stacked, slot_base
                )

    @property
    def nbytes(self) -> int:
        grouped = {n for names in self.groups for n in names}
        return sum(g.nbytes for g in self.groups.values()) + sum(
            b.nbytes for n, b in self.buffers.items() if n not in grouped
        )

    def probe(self) -> GroupBuffers | LoRABuffers:
        """The buffers a start-up timing runs on: the first fused group, else any module."""
        return next(iter(self.groups.values()), None) or next(iter(self.buffers.values()))


class SlotBufferSet:
    """The hot-set's buffers: one pool padded to `max_rank` (slot 0 stays all-zero: "no
    adapter"), or one pool per `rank_pools` entry, each padded only to its own rank."""

    def __init__(
        self,
        model: CausalLM,
        config: HotSetConfig,
        stacked: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        targets = list(config.target_modules)
        if config.rank_pools:
            self.pools = layout_pools([(p.rank, p.slots) for p in config.rank_pools])
        else:
            self.pools = [SlotPool(config.max_rank, 1, config.num_slots)]
        self.pooled = bool(config.rank_pools)
        self.parts: list[PoolBuffers] = []
        for pool in self.pools:
            base = 1 if self.pooled and stacked else 0
            rows = pool.slots + 1 - base
            part = PoolBuffers(model, targets, pool.rank, rows, base, stacked, dtype, device)
            self.parts.append(part)
        # module -> ids of the buffers objects its layers hand the backend (`LoRAContext.add_lora`)
        self._callers: dict[str, set[int]] = {}
        for linear in model.lora_linears():
            linear.lora = self._attach([p.buffers.get(linear.name) for p in self.parts])
            if linear.lora is not None:
                self._callers.setdefault(linear.name, set()).add(id(linear.lora))
        for fused in model.fused_groups():
            fused.lora = self._attach([p.groups.get(fused.names) for p in self.parts])
            for name in fused.names if fused.lora is not None else ():
                self._callers.setdefault(name, set()).add(id(fused.lora))
        self.total_slots = config.num_slots + 1  # incl. the zero slot
        # slot -> (buffers id, layer) cells it holds weights for (an unlisted slot holds none)
        self._cells: dict[int, frozenset[tuple[int, int]]] = {}
        # `cells_of` per set of slots, until a slot changes (decode steps repeat their set)
        self._union: dict[frozenset[int], frozenset[tuple[int, int]]] = {}
        log.info(
            "LoRA slots: %s, %.1f MB",
            ", ".join(f"{p.slots} x rank {p.rank}" for p in self.pools),
            self.capacity_nbytes() / 1e6,
        )

    def _attach(self, per_pool: list) -> object:
        if per_pool[0] is None:
            return None
        if not self.pooled:
            return per_pool[0]
        return PooledBuffers(tuple(zip(self.pools, per_pool, strict=True)))

    @property
    def buffers(self) -> dict[str, LoRABuffers]:
        """The first pool's per-module buffers (the only pool of a padded hot-set)."""
        return self.parts[0].buffers

    @property
    def groups(self) -> dict[tuple[str, ...], GroupBuffers]:
        return self.parts[0].groups

    def probe(self) -> GroupBuffers | LoRABuffers:
        """The start-up timing's buffers: those of the pool with the most slots."""
        k = max(range(len(self.pools)), key=lambda i: self.pools[i].slots)
        return self.parts[k].probe()

    def pool_of(self, slot: int) -> tuple[SlotPool, PoolBuffers]:
        for pool, part in zip(self.pools, self.parts, strict=True):
            if pool.holds(slot):
                return pool, part
        raise IndexError(f"no hot-set slot {slot}")

    def slot_nbytes(self, slot: int | None = None) -> int:
        """Device bytes of one slot (every target module, every layer, at its pool's rank);
        without `slot`, of a slot at the largest rank."""
        if slot is None:
            part = self.parts[max(range(len(self.pools)), key=lambda i: self.pools[i].rank)]
        else:
            part = self.pool_of(slot)[1]
        return part.nbytes // part.rows

    def capacity_nbytes(self) -> int:
        """Device bytes of every adapter slot (the zero slot not counted)."""
        return sum(p.slots * self.slot_nbytes(p.first) for p in self.pools)

    def write(self, slot: int, weights: AdapterWeights) -> None:
        """Replace `slot`'s contents with `weights`; on a value out of bounds the slot is left
        all-zero and the load fails with the reason."""
        pool, part = self.pool_of(slot)
        row = pool.local(slot) - part.slot_base
        self._forget(slot)
        with torch.no_grad():
            try:
                for module, buf in part.buffers.items():
                    buf.clear_slot(row)
                    for layer, (a, b) in weights.modules.get(module, {}).items():
                        if a.shape[0] > pool.rank:
                            raise AdapterLoadError(
                                f"adapter {weights.name!r}: {module} of layer {layer} has rank "
                                f"{a.shape[0]}, above slot {slot}'s rank {pool.rank}"
                            )
                        buf.write(row, layer, a, b)
            except SlotValueError as exc:
                self.clear(slot)
                raise AdapterLoadError(f"adapter {weights.name!r}: {module} {exc}") from None
            except AdapterLoadError:
                self.clear(slot)
                raise
        self._union.clear()
        self._cells[slot] = frozenset(
            (caller, layer)
            for module in part.buffers
            for layer in weights.modules.get(module, {})
            for caller in self._callers.get(module, ())
        )

    def cells_of(self, slots: Iterable[int]) -> frozenset[tuple[int, int]]:
        """(buffers id, layer) cells where at least one of `slots` holds weights: elsewhere
        their delta is exactly 0 (an adapter on q/v leaves the MLP's projections alone)."""
        key = frozenset(slots)
        cells = self._union.get(key)
        if cells is None:
            cells = frozenset().union(*(self._cells.get(s, frozenset()) for s in key))
            self._union[key] = cells
        return cells

    def _forget(self, slot: int) -> None:
        self._cells.pop(slot, None)
        self._union.clear()

    def clear(self, slot: int) -> None:
        pool, part = self.pool_of(slot)
        self._forget(slot)
        with torch.no_grad():
            for buf in part.buffers.values():
                buf.clear_slot(pool.local(slot) - part.slot_base)
