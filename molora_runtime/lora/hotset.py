"""The hot-set: a fixed number of adapter slots in static device buffers.

Per LoRA target module there is one pair of buffers `A[S, L, r_max, d_in]`, `B[S, L, d_out, r_max]`
(slot 0 stays all-zero: "no adapter"). Loading an adapter copies its tensors into a slot in place,
so buffer addresses never change and a captured decode graph stays valid. Slots are reused LRU;
an adapter held by a running request (refcount > 0) or pinned is never evicted. Learned
compositions get the same treatment in a small table of gate slots.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from adapter_store import rules
from molora_runtime.config import HotSetConfig
from molora_runtime.errors import AdapterLoadError, HotSetFullError
from molora_runtime.lora.composition import Composition, CompositionError, load_composition
from molora_runtime.lora.context import GateTable
from molora_runtime.lora.host_tier import HostTier
from molora_runtime.lora.peft_adapter import AdapterWeights, arch_identity, read_peft_adapter
from molora_runtime.lora.source import AdapterSource
from molora_runtime.lora.tiers import Residency, StageTimes, TierCounts, TierReport, residency_view
from molora_runtime.model.arch import ModelArch
from molora_runtime.model.decoder import CausalLM
from molora_runtime.model.group_buffers import GroupLoRABuffers
from molora_runtime.model.layers import LoRABuffers


@dataclass
class _Slot:
    name: str | None = None
    refs: int = 0
    pinned: bool = False
    last_used: int = 0
    generation: int = 0  # bumped on every write, so a holder can tell its weights are the same


@dataclass
class _CompSlot:
    name: str | None = None
    experts: list[str] = field(default_factory=list)
    top_k: int = 1
    temperature: float = 1.0
    refs: int = 0
    last_used: int = 0


@dataclass
class HotSetCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    loads: int = 0
    load_seconds: list[float] = field(default_factory=list)  # drained by the metrics exporter


class HotSet:
    """Owns the slot buffers, the name → slot map and the composition gate table."""

    def __init__(
        self,
        model: CausalLM,
        config: HotSetConfig,
        source: AdapterSource,
        device: torch.device,
        dtype: torch.dtype,
        served_names: list[str] | None = None,
    ) -> None:
        self.arch: ModelArch = model.arch
        self.config = config
        self.source = source
        # Names the served base model goes by (alias, folder, HF id): what adapters must declare.
        self.served_names = [n for n in (served_names or []) if n]
        self.device, self.dtype = device, dtype
        S, L, r = config.num_slots + 1, self.arch.num_layers, config.max_rank
        self.buffers: dict[str, LoRABuffers] = {}
        # CPU serving stacks each layer's slots contiguously (`kernels.stacked`); CUDA keeps
        # the layout the Triton kernels read.
        stacked = device.type == "cpu"
        # ... and a fused group's targeted members share one group layout (one shrink + expand)
        self.groups: dict[tuple[str, ...], GroupLoRABuffers] = (
            self._allocate_groups(model, S, L, r) if stacked else {}
        )
        for module in config.target_modules:
            if module in self.buffers:
                continue
            d_in, d_out = self.arch.linear_shape(module)
            self.buffers[module] = LoRABuffers.allocate(
                S, L, r, d_in, d_out, dtype, device, stacked=stacked
            )
        for linear in model.lora_linears():
            linear.lora = self.buffers.get(linear.name)
        for group in model.fused_groups():
            group.lora = self.groups.get(group.names)
        C, K, d = (
            max(1, config.max_compositions),
            config.max_composition_experts,
            self.arch.hidden_size,
        )
        self.gates = GateTable(
            weight=torch.zeros(C, L, K, d, dtype=torch.float32, device=device),
            bias=torch.zeros(C, L, K, dtype=torch.float32, device=device),
            expert_slots=torch.zeros(C, K, dtype=torch.long, device=device),
            num_experts=torch.ones(C, dtype=torch.long, device=device),
        )
        self._slots = [_Slot() for _ in range(S)]  # index 0 unused (the zero slot)
        self._comp_slots = [_CompSlot() for _ in range(config.max_compositions)]
        self._by_name: dict[str, int] = {}
        self._comp_by_name: dict[str, int] = {}
        # store -> disk -> parsed in host memory, off the step (see `host_tier`)
        self.host = HostTier(self._fetch, config.host_bytes, workers=config.fetch_workers)
        self.stages = StageTimes()  # fetch / parse / copy latencies
        self._clock = 0
        self._generation = 0
        self.counters = HotSetCounters()
        for name in config.pinned:
            self.pin(name)

    # ----- queries -------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return len(self._slots) - 1

    def loaded(self) -> list[str]:
        return sorted(self._by_name)

    def pinned(self) -> list[str]:
        return sorted(s.name for s in self._slots[1:] if s.pinned and s.name)

    def compositions(self) -> list[str]:
        return sorted(self._comp_by_name)

    def free_slots(self) -> int:
        return sum(1 for s in self._slots[1:] if s.name is None)

    def slot_of(self, name: str) -> int:
        return self._by_name[name]

    def comp_slot_of(self, name: str) -> int:
        return self._comp_by_name[name]

    def expert_slots(self, composition: str) -> list[int]:
        """Adapter slots of a resident composition's experts."""
        return [self._by_name[e] for e in self.composition_info(composition).experts]

    def composition_info(self, name: str) -> _CompSlot:
        return self._comp_slots[self._comp_by_name[name]]

    def can_hold(self, names: Iterable[str]) -> bool:
        """Whether `names` could all be resident at once without evicting anything in use."""
        names = set(names)
        missing = [n for n in names if n not in self._by_name]
        reusable = sum(
            1
            for s in self._slots[1:]
            if s.name is None or (s.refs == 0 and not s.pinned and s.name not in names)
        )
        return len(missing) <= reusable

    def can_hold_composition(self, ref: str) -> bool:
        """Whether `ref`'s gates are resident or could take a slot no running request holds
        (True with no gate slots at all, so `ensure_composition` reports that error)."""
        if not self._comp_slots or ref in self._comp_by_name:
            return True
        return any(s.name is None or s.refs == 0 for s in self._comp_slots)

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
        for name in names:
            self._clock += 1
            slot = self._by_name.get(name)
            if slot is not None:
                self.counters.hits += 1
            else:
                self.counters.misses += 1
                slot = self._victim(keep)
                self._load(slot, name)
            self._slots[slot].last_used = self._clock
            out[name] = slot
        return out

    def prefetch(self, names: Iterable[str]) -> None:
        """Fetch queued requests' adapters in the background, and copy those already parsed
        into empty slots (never evicts); errors surface at admission."""
        for name in names:
            if name in self._by_name:
                continue
            try:
                if self.host.warm(name) and self.free_slots() > 0:
                    self._load(self._victim(set()), name)
            except Exception:  # the request that needs it reports the error
                continue

    def acquire(self, names: Iterable[str]) -> None:
        for name in names:
            self._slots[self._by_name[name]].refs += 1

    def release(self, names: Iterable[str]) -> None:
        for name in names:
            slot = self._by_name.get(name)
            if slot is not None and self._slots[slot].refs > 0:
                self._slots[slot].refs -= 1

    def pin(self, name: str) -> int:
        """Keep `name` in every tier: its slot, its parsed weights and its disk cache entry."""
        self.host.pin(name)
        pin_on_disk = getattr(self.source, "pin", None)
        if callable(pin_on_disk):
            pin_on_disk(name)
        slot = self.ensure([name])[name]
        self._slots[slot].pinned = True
        return slot

    def unpin(self, name: str) -> None:
        if name in self._by_name:
            self._slots[self._by_name[name]].pinned = False

    def _victim(self, keep: set[str]) -> int:
        free = [i for i, s in enumerate(self._slots) if i and s.name is None]
        if free:
            return free[0]
        candidates = [
            (s.last_used, i)
            for i, s in enumerate(self._slots)
            if i and s.refs == 0 and not s.pinned and s.name not in keep
        ]
        if not candidates:
            raise HotSetFullError(
                f"all {self.num_slots} hot-set slots hold adapters in use or pinned; "
                "the request must wait"
            )
        _, slot = min(candidates)
        evicted = self._slots[slot].name
        assert evicted is not None
        del self._by_name[evicted]
        self._slots[slot] = _Slot()
        self.counters.evictions += 1
        return slot

    def ready(self, names: Iterable[str]) -> bool:
        """Whether every adapter in `names` can be put in a slot now (resident or parsed in
        host memory); missing ones start loading in the background. Raises the load error
        of an adapter that failed, for the request that needs it."""
        waiting = False
        for name in names:
            if name not in self._by_name and not self.host.ready(name):
                waiting = True
        return not waiting

    # ----- tiers ---------------------------------------------------------------------------
    def _disk(self) -> dict:
        report = getattr(self.source, "disk_tier", None)
        if not callable(report):  # a plain directory source has no disk tier of its own
            return {}
        try:
            return dict(report())
        except Exception:  # stats must never fail a replica
            return {}

    def _allocate_groups(
        self, model: CausalLM, S: int, L: int, r: int
    ) -> dict[tuple[str, ...], GroupLoRABuffers]:
        """One stacked group buffer per fused group shape; members' buffers become its views."""
        groups: dict[tuple[str, ...], GroupLoRABuffers] = {}
        targets = set(self.config.target_modules)
        for fused in model.fused_groups():
            names = fused.names
            if names in groups or not targets.intersection(names):
                continue
            shapes = [self.arch.linear_shape(n) for n in names]
            group = GroupLoRABuffers(
                S, L, r, shapes[0][0], [d_out for _, d_out in shapes],
                [n in targets for n in names], self.dtype, self.device,
            )  # fmt: skip
            groups[names] = group
            for name, member in zip(names, group.members, strict=True):
                if member is not None:
                    self.buffers[name] = member
        return groups

    def slot_nbytes(self) -> int:
        """Device bytes of one slot (every target module, every layer, at max rank)."""
        grouped = {n for names in self.groups for n in names}
        total = sum(g.nbytes for g in self.groups.values()) + sum(
            (b.A.numel() + b.B.numel()) * b.A.element_size()
            for n, b in self.buffers.items()
            if n not in grouped
        )
        return total // (self.num_slots + 1)

    def tier_report(self) -> TierReport:
        """Hits, misses, loads, evictions and bytes of the slot, host and disk tiers."""
        c, h = self.counters, self.host.counters
        disk = self._disk()
        used = [s for s in self._slots[1:] if s.name is not None]
        slot_bytes = self.slot_nbytes()
        tiers = {
            "slot": TierCounts(
                hits=c.hits, misses=c.misses, loads=c.loads, evictions=c.evictions,
                bytes=slot_bytes * len(used), capacity_slots=self.num_slots, entries=len(used),
                capacity_bytes=slot_bytes * self.num_slots,
            ),
            "host": TierCounts(
                hits=h.hits, misses=h.misses, loads=h.fetches, evictions=h.evictions,
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
        disk = self._disk().get("adapters", [])
        return residency_view(self.loaded(), self.host.resident(), self.host.loading(), disk)

    def tier_of(self, names: Iterable[str]) -> Residency:
        """The worst tier among `names` right now: where a request needing them starts from."""
        order: list[Residency] = ["slot", "host", "loading", "disk", "store"]
        worst = 0
        host, loading = set(self.host.resident()), set(self.host.loading())
        on_disk = getattr(self.source, "on_disk", None)
        for name in names:
            if name in self._by_name:
                tier = 0
            elif name in host:
                tier = 1
            elif name in loading:
                tier = 2
            elif callable(on_disk) and on_disk(name):
                tier = 3
            else:
                tier = 4
            worst = max(worst, tier)
        return order[worst]

    def check_adapter(self, name: str) -> None:
        """Validate that `name` exists; a store source checks its manifest only (the files
        are fetched by the host tier's workers), a plain source resolves the folder."""
        check = getattr(self.source, "check_adapter", None)
        if callable(check):
            check(name)
        else:
            self.source.adapter_path(name)

    def _read(self, name: str) -> AdapterWeights:
        return self.host.read_now(name)

    def _fetch(self, name: str) -> AdapterWeights:
        """Store -> local folder -> parsed weights (runs in the host tier's workers)."""
        start = time.perf_counter()
        folder = self.source.adapter_path(name)
        fetched = time.perf_counter()
        self.stages.observe("fetch", fetched - start)
        weights = read_peft_adapter(
            name, folder, self.arch, self.config.target_modules, self.config.max_rank
        )
        if not self.config.allow_base_mismatch:
            self._check_base(name, weights.base_model)
        self.stages.observe("parse", time.perf_counter() - fetched)
        return weights

    def _check_base(self, name: str, declared: str | None) -> None:
        """Refuse an adapter published for another base model (the rulebook decides)."""
        lookup = getattr(self.source, "adapter_identity", None)
        identity = None
        if callable(lookup):
            try:
                identity = lookup(name)
            except Exception:  # the manifest is advisory here; the files are already checked
                identity = None
        try:
            rules.check_declared_base(
                declared, identity, self.served_names or [self.arch.name_or_path],
                arch_identity(self.arch),
            )  # fmt: skip
        except rules.RuleError as exc:
            raise AdapterLoadError(
                f"adapter {name!r} {exc} (hot_set.allow_base_mismatch=true serves it anyway)"
            ) from None

    def generation_of(self, name: str) -> int:
        """The write generation of the slot holding `name` (0: not resident)."""
        slot = self._by_name.get(name)
        return self._slots[slot].generation if slot is not None else 0

    def _load(self, slot: int, name: str) -> None:
        if self._slots[slot].refs > 0:  # a running sequence reads these weights
            raise RuntimeError(f"hot-set slot {slot} is held by a running request")
        start = time.perf_counter()
        weights = self._read(name)
        copy_start = time.perf_counter()
        with torch.no_grad():
            for module, buf in self.buffers.items():
                buf.clear_slot(slot)
                for layer, (a, b) in weights.modules.get(module, {}).items():
                    buf.write(slot, layer, a, b)
        self.stages.observe("copy", time.perf_counter() - copy_start)
        self._generation += 1
        self._slots[slot] = _Slot(name=name, last_used=self._clock, generation=self._generation)
        self._by_name[name] = slot
        self.counters.loads += 1
        self.counters.load_seconds.append(time.perf_counter() - start)

    # ----- compositions ----------------------------------------------------------------------
    def ensure_composition(self, ref: str) -> tuple[int, list[str]]:
        """Make a composition's gates resident; returns (gate slot, expert adapter names).

        The caller ensures and acquires the experts; `bind_experts` then records their slots.
        """
        if not self._comp_slots:
            raise HotSetFullError("hot_set.max_compositions is 0: learned routes are disabled")
        self._clock += 1
        slot = self._comp_by_name.get(ref)
        if slot is None:
            comp = self._read_composition(ref)
            slot = self._comp_victim()
            self._write_composition(slot, comp)
        self._comp_slots[slot].last_used = self._clock
        return slot, list(self._comp_slots[slot].experts)

    def bind_experts(self, comp_slot: int) -> None:
        """Point the gate table's expert columns at the experts' current adapter slots."""
        experts = self._comp_slots[comp_slot].experts
        slots = [self._by_name[e] for e in experts]
        self.gates.expert_slots[comp_slot].zero_()
        self.gates.expert_slots[comp_slot, : len(slots)] = torch.tensor(slots, dtype=torch.long)

    def acquire_composition(self, ref: str) -> None:
        self._comp_slots[self._comp_by_name[ref]].refs += 1

    def release_composition(self, ref: str) -> None:
        slot = self._comp_by_name.get(ref)
        if slot is not None and self._comp_slots[slot].refs > 0:
            self._comp_slots[slot].refs -= 1

    def _read_composition(self, ref: str) -> Composition:
        try:
            comp = load_composition(ref, self.source.composition_path(ref))
        except CompositionError as exc:
            raise AdapterLoadError(str(exc)) from exc
        cfg = comp.config
        if cfg.num_layers != self.arch.num_layers or cfg.hidden_size != self.arch.hidden_size:
            raise AdapterLoadError(
                f"composition {ref!r} was trained for {cfg.num_layers} layers × "
                f"{cfg.hidden_size} hidden, the base model has {self.arch.num_layers} × "
                f"{self.arch.hidden_size} (base-model mismatch)"
            )
        if len(cfg.adapters) > self.config.max_composition_experts:
            raise AdapterLoadError(
                f"composition {ref!r} has {len(cfg.adapters)} experts, above "
                f"hot_set.max_composition_experts={self.config.max_composition_experts}"
            )
        if len(cfg.adapters) > self.num_slots:
            raise AdapterLoadError(
                f"composition {ref!r} needs {len(cfg.adapters)} adapters at once but the hot-set "
                f"has {self.num_slots} slots"
            )
        return comp

    def _comp_victim(self) -> int:
        for i, s in enumerate(self._comp_slots):
            if s.name is None:
                return i
        candidates = [(s.last_used, i) for i, s in enumerate(self._comp_slots) if s.refs == 0]
        if not candidates:
            raise HotSetFullError("all composition slots are in use; the request must wait")
        _, slot = min(candidates)
        del self._comp_by_name[self._comp_slots[slot].name]  # type: ignore[arg-type]
        self._comp_slots[slot] = _CompSlot()
        return slot

    def _write_composition(self, slot: int, comp: Composition) -> None:
        K = len(comp.config.adapters)
        with torch.no_grad():
            self.gates.weight[slot].zero_()
            self.gates.bias[slot].zero_()
            self.gates.weight[slot, :, :K].copy_(comp.gate_weight)
            if comp.gate_bias is not None:
                self.gates.bias[slot, :, :K].copy_(comp.gate_bias)
            self.gates.num_experts[slot] = K
        self._comp_slots[slot] = _CompSlot(
            name=comp.name,
            experts=list(comp.config.adapters),
            top_k=comp.config.top_k,
            temperature=comp.config.temperature,
            last_used=self._clock,
        )
        self._comp_by_name[comp.name] = slot
