"""The hot-set: a fixed number of adapter slots in static device buffers.

Loading an adapter copies its tensors into a slot in place (`SlotBufferSet`), so buffer
addresses never change and a captured decode graph stays valid. Slots are reused least
frequently used first, with aging, least recently used among equals (`PinnedLFU`); an adapter
held by a running request or pinned is never evicted.
Weights come from the `AdapterLoader` (store -> disk -> host memory, off the step), learned
compositions' gates from `GateSlots`, and the layers add their deltas through the LoRA backend
chosen here, once per engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from adapter_store.counters import TierCounters
from molora_runtime.config import HotSetConfig
from molora_runtime.errors import HotSetFullError
from molora_runtime.lora.gate_table import CompositionInfo, GateSlots
from molora_runtime.lora.host_tier import HostTier
from molora_runtime.lora.loader import AdapterLoader
from molora_runtime.lora.peft_adapter import AdapterWeights
from molora_runtime.lora.pinned_lfu import PinnedLFU, slot_order
from molora_runtime.lora.rank_placement import adapter_rank, fits_at_once, fitting, pool_occupancy
from molora_runtime.lora.slot_set import SlotBufferSet
from molora_runtime.lora.slot_sizing import sized
from molora_runtime.lora.source import AdapterSource
from molora_runtime.lora.tiers import Residency, StageTimes, TierCounts, TierReport, residency_view
from molora_runtime.model.arch import ModelArch
from molora_runtime.model.decoder import CausalLM
from molora_runtime.model.lora_backend import LoRABackend, choose_backend
from molora_runtime.model.lora_context import GateTable
from molora_runtime.model.rank_pools import PooledBackend

TIER_ORDER: list[Residency] = ["slot", "host", "loading", "disk", "store"]


@dataclass
class HotSetCounters(TierCounters):
    load_seconds: list[float] = field(default_factory=list)  # drained by the metrics exporter


class HotSet:
    """Owns the name -> slot map; the buffers, loader and gate slots are its parts."""

    def __init__(
        self,
        model: CausalLM,
        config: HotSetConfig,
        source: AdapterSource,
        device: torch.device,
        dtype: torch.dtype,
        served_names: list[str] | None = None,
        *,
        max_num_seqs: int,
    ) -> None:
        """`max_num_seqs`: the sequences one step runs, what `num_slots: auto` sizes for."""
        self.arch: ModelArch = model.arch
        config = sized(config, self.arch, dtype, device.type, max_num_seqs)
        self.config = config
        self.device, self.dtype = device, dtype
        self.slots = SlotBufferSet(model, config, device.type == "cpu", dtype, device)
        backend = choose_backend(device, self.slots.probe())
        self.backend: LoRABackend | PooledBackend = (
            PooledBackend(backend) if self.slots.pooled else backend
        )
        self.loader = AdapterLoader(
            self.arch, config, source, [n for n in (served_names or []) if n]
        )
        self.gate_slots = GateSlots(
            self.arch, config.max_compositions, config.max_composition_experts,
            config.num_slots, device,
        )  # fmt: skip
        self._names: list[str | None] = [None] * (config.num_slots + 1)  # 0: the zero slot
        self._lru: PinnedLFU[str, int] = slot_order(config.num_slots)  # resident name -> slot
        # Bumped on every slot write, so a holder can tell its weights are still the same.
        self._generations = [0] * (config.num_slots + 1)
        self._generation = 0
        self._ranks: dict[str, int] = {}  # adapter -> rank, once its weights were read
        self.counters = HotSetCounters()
        for name in config.pinned:
            self.pin(name)

    # ----- parts, as callers name them -----------------------------------------------------
    @property
    def source(self) -> AdapterSource:
        return self.loader.source

    @source.setter
    def source(self, source: AdapterSource) -> None:
        self.loader.source = source

    @property
    def host(self) -> HostTier:
        return self.loader.host

    @property
    def stages(self) -> StageTimes:
        return self.loader.stages

    @property
    def gates(self) -> GateTable:
        return self.gate_slots.table

    # ----- queries -------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return len(self._names) - 1

    def loaded(self) -> list[str]:
        return sorted(self._lru.keys())

    def pinned(self) -> list[str]:
        return sorted(n for n in self._lru if self._lru.pinned(n))

    def in_use(self) -> list[str]:
        """Adapters and compositions a running request holds."""
        held = [n for n in self._lru if self._lru.held(n)]
        return sorted(held + self.gate_slots.held())

    def compositions(self) -> list[str]:
        return self.gate_slots.names()

    def free_slots(self) -> int:
        return sum(1 for n in self._names[1:] if n is None)

    def slot_of(self, name: str) -> int:
        return self._lru[name]

    def comp_slot_of(self, name: str) -> int:
        return self.gate_slots.slot_of(name)

    def expert_slots(self, composition: str) -> list[int]:
        """Adapter slots of a resident composition's experts."""
        return [self.slot_of(e) for e in self.composition_info(composition).experts]

    def composition_info(self, name: str) -> CompositionInfo:
        return self.gate_slots.info(name)

    def resident(self, names: Iterable[str]) -> bool:
        """Whether every adapter in `names` sits in a slot now."""
        return all(name in self._lru for name in names)

    def can_hold(self, names: Iterable[str]) -> bool:
        """Whether `names` could all be resident at once without evicting anything in use."""
        names = set(names)
        missing = [n for n in names if n not in self._lru]
        if not self.slots.pooled:
            reusable = self.free_slots() + sum(1 for _ in self._lru.victims(keep=names))
            return len(missing) <= reusable
        self._check_fits_ever(names)
        room = {p: 0 for p in self.slots.pools}
        slots = [s for s, n in enumerate(self._names) if s and n is None]
        slots += [self._lru.peek(n) for n in self._lru.victims(keep=names)]
        for slot in slots:
            room[self.slots.pool_of(slot)[0]] += 1
        return fits_at_once(self.slots.pools, [self._rank_hint(n) for n in missing], room)

    def _check_fits_ever(self, names: Iterable[str]) -> None:
        """Refuse adapters that could not sit in the pools together even in an empty hot-set
        (judged once every rank is known)."""
        ranks = [self._ranks.get(n) for n in names]
        if not self.slots.pooled or None in ranks:
            return
        known = [r for r in ranks if r is not None]
        if not fits_at_once(self.slots.pools, known, {p: p.slots for p in self.slots.pools}):
            pools = ", ".join(f"{p.slots} of rank {p.rank}" for p in self.slots.pools)
            raise HotSetFullError(
                f"the route needs adapters of ranks {sorted(known)} at once but the hot-set's "
                f"rank pools hold {pools} slots (hot_set.rank_pools)"
            )

    def _rank_hint(self, name: str) -> int:
        """The adapter's rank if its weights were seen (here or parsed in host memory), else
        the smallest pool's: admission is optimistic until the adapter is parsed."""
        if name not in self._ranks and name in self.host.resident():
            weights = self.host.get(name)
            if weights is not None:
                self._ranks[name] = adapter_rank(weights)
        return self._ranks.get(name, self.slots.pools[0].rank)

    def can_hold_composition(self, ref: str) -> bool:
        return self.gate_slots.can_hold(ref)

    # ----- adapters --------------------------------------------------------------------------
    def ensure(self, names: Iterable[str]) -> dict[str, int]:
        """Make every adapter in `names` resident (loading/evicting as needed); return slots."""
        names = list(dict.fromkeys(names))
        if len(names) > self.num_slots:
            raise HotSetFullError(
                f"{len(names)} adapters are needed at once but the hot-set has {self.num_slots} "
                "slots (raise hot_set.num_slots)"
            )
        keep = set(names)
        out: dict[str, int] = {}
        missing: list[tuple[str, AdapterWeights, float]] = []
        for name in names:
            slot = self._lru.get(name)
            if slot is not None:
                self.counters.hits += 1
                out[name] = slot
            else:
                self.counters.misses += 1
                start = time.perf_counter()
                missing.append((name, self.loader.read(name), start))
        # Largest ranks first, so a small adapter never takes the one big slot a big one needs.
        missing.sort(key=lambda m: -self._note_rank(m[0], m[1]))
        self._check_fits_ever(names)
        for name, weights, start in missing:
            slot = self._victim(keep, self._ranks[name])
            self._load(slot, name, weights, start)
            out[name] = slot
        return {name: out[name] for name in names}

    def _note_rank(self, name: str, weights: AdapterWeights) -> int:
        rank = self._ranks[name] = adapter_rank(weights)
        return rank

    def pool_report(self) -> list[tuple[int, int, int, int]]:
        """Per rank pool (rank, slots, free, evictable); none for the padded layout."""
        if not self.slots.pooled:
            return []
        return pool_occupancy(self.slots.pools, list(self._names), self._lru.evictable)

    def known_ranks(self, names: Iterable[str]) -> dict[str, int]:
        """Ranks of those of `names` whose weights were read here."""
        ranks = self._ranks.copy()
        return {n: ranks[n] for n in names if n in ranks}

    def prefetch(self, names: Iterable[str]) -> None:
        """Fetch queued requests' adapters in the background, and copy those already parsed
        into empty slots (never evicts); errors surface at admission."""
        for name in names:
            if name in self._lru:
                continue
            try:
                if self.host.warm(name) and self.free_slots() > 0:
                    start = time.perf_counter()
                    weights = self.loader.read(name)
                    slot = self._free_slot(self._note_rank(name, weights))
                    if slot is not None:
                        self._load(slot, name, weights, start)
            except Exception:  # the request that needs it reports the error
                continue

    def acquire(self, names: Iterable[str]) -> None:
        for name in names:
            self.slot_of(name)
            self._lru.hold(name)

    def release(self, names: Iterable[str]) -> None:
        for name in names:
            if name in self._lru:
                self._lru.unhold(name)

    def pin(self, name: str) -> int:
        """Keep `name` in every tier: its slot, its parsed weights and its disk cache entry."""
        self.loader.pin(name)
        slot = self.ensure([name])[name]
        self._lru.pin(name)
        return slot

    def unpin(self, name: str) -> None:
        self._lru.unpin(name)

    def _free_slot(self, rank: int) -> int | None:
        """An empty slot of the smallest pool that fits `rank`."""
        for pool in fitting(self.slots.pools, rank):
            for slot in range(pool.first, pool.first + pool.slots):
                if self._names[slot] is None:
                    return slot
        return None

    def _victim(self, keep: set[str], rank: int) -> int:
        """A slot for an adapter of `rank`: an empty one, else the first victim in eviction
        order (fewest recent uses, then least recently used) of the smallest pool that fits
        `rank` and has one."""
        free = self._free_slot(rank)
        if free is not None:
            return free
        evicted = None
        for pool in fitting(self.slots.pools, rank):
            held = (n for n in self._lru.victims(keep) if pool.holds(self._lru.peek(n)))
            evicted = next(held, None)
            if evicted is not None:
                break
        if evicted is None:
            where = "" if not self.slots.pooled else f" of rank >= {rank}"
            raise HotSetFullError(
                f"all hot-set slots{where} hold adapters in use or pinned; the request must wait"
            )
        slot = self._lru.pop(evicted)
        self._names[slot] = None
        self.counters.evictions += 1
        return slot

    def ready(self, names: Iterable[str]) -> bool:
        """Whether every adapter in `names` can be put in a slot now (resident or parsed in
        host memory); missing ones start loading in the background. Raises the load error
        of an adapter that failed, for the request that needs it."""
        waiting = False
        for name in names:
            if name not in self._lru and not self.host.ready(name):
                waiting = True
        return not waiting

    def check_adapter(self, name: str) -> None:
        self.loader.check_adapter(name)

    def generation_of(self, name: str) -> int:
        """The write generation of the slot holding `name` (0: not resident)."""
        slot = self._lru.peek(name)
        return self._generations[slot] if slot is not None else 0

    def _load(
        self, slot: int, name: str, weights: AdapterWeights | None = None, start: float = 0.0
    ) -> None:
        """Write `name` (its `weights` once read, from `start`) into `slot`."""
        held = self._names[slot]
        if held is not None and self._lru.held(held):  # a running sequence reads these weights
            raise RuntimeError(f"hot-set slot {slot} is held by a running request")
        if weights is None:
            start = time.perf_counter()
            weights = self.loader.read(name)
        copy_start = time.perf_counter()
        self.slots.write(slot, weights)
        self.stages.observe("copy", time.perf_counter() - copy_start)
        self._generation += 1
        self._generations[slot] = self._generation
        self._names[slot] = name
        self._lru.put(name, slot)
        self.counters.loads += 1
        self.counters.load_seconds.append(time.perf_counter() - start)

    # ----- compositions ----------------------------------------------------------------------
    def ensure_composition(self, ref: str) -> tuple[int, list[str]]:
        """Make a composition's gates resident; returns (gate slot, expert adapter names).

        The caller ensures and acquires the experts; `bind_experts` then records their slots.
        """
        return self.gate_slots.ensure(ref, self.source)

    def bind_experts(self, comp_slot: int) -> None:
        """Point the gate table's expert columns at the experts' current adapter slots."""
        experts = self.gate_slots.experts_at(comp_slot)
        self.gate_slots.bind_experts(comp_slot, [self.slot_of(e) for e in experts])

    def acquire_composition(self, ref: str) -> None:
        self.gate_slots.acquire(ref)

    def release_composition(self, ref: str) -> None:
        self.gate_slots.release(ref)

    # ----- tiers ---------------------------------------------------------------------------
    def slot_nbytes(self) -> int:
        """Bytes of one slot at the largest rank (every slot, without rank pools)."""
        return self.slots.slot_nbytes()

    def tier_report(self) -> TierReport:
        """Hits, misses, loads, evictions and bytes of the slot, host and disk tiers."""
        c, h = self.counters, self.host.counters
        disk = self.loader.disk()
        used = len(self._lru)
        used_bytes = sum(self.slots.slot_nbytes(slot) for _, slot in self._lru.items())
        tiers = {
            "slot": TierCounts(
                hits=c.hits, misses=c.misses, loads=c.loads, evictions=c.evictions,
                bytes=used_bytes, capacity_slots=self.num_slots, entries=used,
                capacity_bytes=self.slots.capacity_nbytes(),
            ),
            "host": TierCounts(
                hits=h.hits, misses=h.misses, loads=h.loads, evictions=h.evictions,
                bytes=self.host.nbytes, capacity_bytes=self.host.budget_bytes,
                entries=len(self.host.resident()),
            ),
            "disk": TierCounts(
                hits=int(disk.get("hits", 0)), misses=int(disk.get("misses", 0)),
                loads=int(disk.get("loads", 0)), evictions=int(disk.get("evictions", 0)),
                bytes=int(disk.get("bytes", 0)), capacity_bytes=disk.get("capacity_bytes"),
                entries=len(disk.get("adapters", [])),
            ),
        }  # fmt: skip
        return TierReport(tiers=tiers, stages=self.stages.report())

    def residency(self) -> dict[str, Residency]:
        """Which tier each adapter this replica knows of is in (slot > host > loading > disk)."""
        disk = self.loader.disk().get("adapters", [])
        return residency_view(self.loaded(), self.host.resident(), self.host.loading(), disk)

    def tier_of(self, names: Iterable[str]) -> Residency:
        """The worst tier among `names` right now: where a request needing them starts from."""
        worst = 0
        host, loading = set(self.host.resident()), set(self.host.loading())
        for name in names:
            if name in self._lru:
                tier = 0
            elif name in host:
                tier = 1
            elif name in loading:
                tier = 2
            elif self.loader.on_disk(name):
                tier = 3
            else:
                tier = 4
            worst = max(worst, tier)
        return TIER_ORDER[worst]
