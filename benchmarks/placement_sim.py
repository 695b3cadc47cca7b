"""Placement across replicas, simulated: the real placement code on a fake clock.

    python -m benchmarks.placement_sim [--quick] [--seed 0] [--policies ours llm_d ...]

Why a simulator: how placement behaves at 8 replicas x 16 slots x 1,000 adapters, under a flash
crowd and a popularity shift, takes a GPU cluster to measure and minutes per point; the policy is
a pure function (deployments/placement/affinity.py), so it can be driven here exactly as the Ray
request router drives it, against baselines on the same arrivals, in a minute of one core.

Each simulated replica models the engine's admission (molora_runtime/engine/scheduling/scheduler.py):
FIFO, up to `max_num_seqs` running; a request starts only when its adapter is in a slot; a slot
holding an adapter of a running request is held, others are evicted in the hot-set's own order
(the class `HotSet` keeps, molora_runtime/lora/pinned_lfu.py: fewest recent uses, then least
recently used); the host tier is the product's `PinnedLRU`; an adapter in neither slot nor
host tier is fetched in the background (`fetch_workers` at once:
store -> disk cache -> parse into the host tier) while later requests may pass it; the host ->
slot copy runs inside the step. A replica takes at most `max_ongoing_requests`; when every
replica is full the request waits at the router. The router sees hot-sets, host tiers and
queues as last reported (every `stats_period_s`) and its own in-flight counts exactly.

Step time is a + b x batch + c x distinct adapters in the batch (+ prefill tokens x p + the
step's slot copies), fitted to the measured replica's decode steps
(benchmarks/results/runtime_decode.json); load stages come from the measured cold path
(benchmarks/results/store_pull.json), scaled by rank. Both files' figures are recorded in the
result, as are the assumptions where nothing was measured (prefill cost per token, tier sizes).

Reported per policy and phase: slot loads (host -> slot copies) and store fetches per minute,
slot hit rate on arrival, TTFT p50/p99, imbalance (max / mean of tokens served per replica) and,
for every adapter whose demand in a phase exceeds one replica, how many replicas served it.
Next to them: misses per minute of all slots pooled as one cache on the same trace: Belady's
offline optimum, which no policy beats; LRU; and the misses any online cache of that many slots
must expect when each request draws its adapter from the phase's popularity (the independent
reference model: a hit is at most the most requested adapters' share), a bound no placement
and no eviction rule gets under on average. The full run also reruns every policy on two more
traffic seeds, with distinct adapters free in the step model and with the hot-sets evicting
least recently used (the rule before), and ours with replicas reporting their evictable slots
(a what-if of the replica side).
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from benchmarks.placement_policies import (
    POLICIES,
    LeastLoaded,
    LlmD,
    MinCostFlow,
    Ours,
    Policy,
    RandomPolicy,
    Rendezvous,
    Snapshot,
)
from benchmarks.placement_traffic import (
    Phase,
    Traffic,
    TrafficConfig,
    cache_bounds,
    irm_bound,
    make_traffic,
)
from benchmarks.report import RESULTS_DIR, write_json
from molora_runtime.lora.pinned_lfu import slot_order
from molora_runtime.lora.pinned_lru import PinnedLRU

RESULTS = RESULTS_DIR / "placement_sim.json"
DECODE_RESULTS = RESULTS_DIR / "runtime_decode.json"
PULL_RESULTS = RESULTS_DIR / "store_pull.json"
MEASURED_PHASES = ("steady", "flash", "recovery", "shift")
LOAD_TARGET = 0.30  # ours: at least this much fewer slot loads per minute than the best other


class StepModel(BaseModel):
    """Seconds of one engine step: a + b*decodes + c*distinct adapters + p*prefill tokens."""

    model_config = ConfigDict(frozen=True)

    base_ms: float
    per_seq_ms: float
    per_adapter_ms: float
    prefill_ms_per_token: float
    source: dict[str, Any] = Field(default_factory=dict)

    def step_s(self, decodes: int, distinct: int, prefill_tokens: int) -> float:
        ms = (
            self.base_ms
            + self.per_seq_ms * decodes
            + self.per_adapter_ms * distinct
            + self.prefill_ms_per_token * prefill_tokens
        )
        return ms / 1000.0


class TierCosts(BaseModel):
    """Seconds per load stage for a rank-16 adapter; fetch, parse and copy scale with rank."""

    model_config = ConfigDict(frozen=True)

    resolve_s: float
    pull_s_r16: float
    parse_s_r16: float
    copy_s_r16: float
    source: dict[str, Any] = Field(default_factory=dict)

    def fetch_s(self, rank: int) -> float:
        return self.resolve_s + self.pull_s_r16 * rank / 16

    def parse_s(self, rank: int) -> float:
        return self.parse_s_r16 * rank / 16

    def copy_s(self, rank: int) -> float:
        return self.copy_s_r16 * rank / 16


# The fit of runtime_decode.json as shipped, used where the file is missing.
FALLBACK_STEP = (67.44, 3.002, 8.762)
FALLBACK_TIERS = (0.01825, 0.07882, 0.00721, 0.02925)
PREFILL_PER_DECODE = 0.5  # assumed: a prefill token costs half a decode's marginal token


def measured_step_model(path: Path = DECODE_RESULTS) -> StepModel:
    """Least-squares a + b*batch + c*distinct over the measured replica's adapter rows (one
    adapter, and four adapters one per request, at batch 1, 8 and 32). No prefill figure was
    measured: a prefill token is taken as half a decode token's marginal cost (`b`)."""
    try:
        rows = {r["route"]: r for r in json.loads(path.read_text())["decode"]}
        points = [
            (batch, distinct(batch), rows[route][f"batch{batch}_step_ms"])
            for route, distinct in (
                ("one adapter", lambda b: 1),
                ("4 adapters, one per request", lambda b: min(b, 4)),
            )
            for batch in (1, 8, 32)
        ]
        x = np.array([[1.0, b, d] for b, d, _ in points])
        y = np.array([ms for *_, ms in points])
        a, b, c = (float(v) for v in np.linalg.lstsq(x, y, rcond=None)[0])
        source: dict[str, Any] = {
            "file": f"benchmarks/results/{path.name}",
            "rows": ["one adapter", "4 adapters, one per request"],
            "points_batch_distinct_ms": [[b_, d_, round(ms, 2)] for b_, d_, ms in points],
        }
    except (OSError, KeyError, ValueError):
        a, b, c = FALLBACK_STEP
        source = {"file": None, "note": "runtime_decode.json missing: its shipped fit"}
    source["prefill"] = f"assumed {PREFILL_PER_DECODE} x per_seq_ms per prompt token"
    return StepModel(
        base_ms=a,
        per_seq_ms=b,
        per_adapter_ms=max(0.0, c),
        prefill_ms_per_token=PREFILL_PER_DECODE * b,
        source=source,
    )


def measured_tier_costs(path: Path = PULL_RESULTS) -> TierCosts:
    """The cold path's median stage times of a rank-16 adapter (every target module)."""
    try:
        data = json.loads(path.read_text())
        stages = data["cold_path_median_s"]
        resolve, pull, parse, copy = (
            float(stages[k]) for k in ("resolve", "pull", "parse", "slot")
        )
        source: dict[str, Any] = {
            "file": f"benchmarks/results/{path.name}",
            "rank": data["adapter"]["rank"],
            "bytes": data["adapter"]["bytes"],
            "stages_s": stages,
        }
    except (OSError, KeyError, ValueError, TypeError):
        resolve, pull, parse, copy = FALLBACK_TIERS
        source = {"file": None, "note": "store_pull.json missing: its shipped medians"}
    source["scaling"] = "pull, parse and copy proportional to rank / 16; resolve fixed"
    return TierCosts(
        resolve_s=resolve, pull_s_r16=pull, parse_s_r16=parse, copy_s_r16=copy, source=source
    )


class SimConfig(BaseModel):
    """The cluster, the engine limits and the router's settings (serve_config.yaml's defaults
    for placement; the GPU config's ratio of `max_ongoing_requests` to `max_num_seqs`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    replicas: int = Field(8, ge=1)
    slots: int = Field(16, ge=1)
    max_rank: int = Field(64, ge=1, description="padded layout: every slot holds up to this rank")
    report_padded_pool: bool = Field(
        False,
        description="what-if: replicas report their padded slots as one rank pool row "
        "(free, evictable), as pooled replicas do; today the padded layout reports none",
    )
    slot_eviction: Literal["product", "lru"] = Field(
        "product",
        description="the hot-set's slot eviction: product = the class HotSet keeps "
        "(molora_runtime/lora/pinned_lfu.py); lru = PinnedLRU, the rule before it",
    )
    host_adapters: int = Field(64, ge=1, description="parsed adapters kept in host memory")
    disk_adapters: int = Field(256, ge=1, description="adapters in the disk cache")
    max_num_seqs: int = Field(32, ge=1)
    max_ongoing_requests: int = Field(48, ge=1)
    prompt_tokens: int = Field(128, ge=1)
    new_tokens: int = Field(64, ge=1)
    token_budget: int = Field(1024, ge=1, description="max_num_batched_tokens")
    fetch_workers: int = Field(2, ge=1)
    stats_period_s: float = Field(0.5, gt=0)
    load_bound: int = 4
    load_bound_ratio: float = 0.25
    placement_memory_s: float = 5.0
    target_load: float = Field(0.7, gt=0, description="of the replicas' request capacity")
    calibration_distinct: int = Field(
        8, ge=1, description="distinct adapters per full batch assumed for the capacity"
    )
    traffic: TrafficConfig = Field(default_factory=TrafficConfig)


def replica_capacity(cfg: SimConfig, step: StepModel) -> float:
    """Requests per second one replica serves at a full batch (decodes shared by the batch,
    the prompt's prefill not)."""
    full = step.step_s(cfg.max_num_seqs, cfg.calibration_distinct, 0)
    per_request = (cfg.new_tokens - 1) * full / cfg.max_num_seqs
    per_request += step.prefill_ms_per_token * cfg.prompt_tokens / 1000.0
    return 1.0 / per_request


@dataclass(eq=False)
class Request:
    idx: int
    adapter: str
    rank: int
    arrival: float
    phase: str
    replica: str | None = None
    tier: str = ""
    prefill_left: int = 0
    generated: int = 0
    first_token: float | None = None
    done: float | None = None


def slot_eviction(kind: str, num_slots: int) -> PinnedLRU[str, int]:
    """The hot-set's own eviction order (`product`: what `HotSet` keeps) or plain `lru`
    (name -> slot index, unused here)."""
    return slot_order(num_slots) if kind == "product" else PinnedLRU()


@dataclass(eq=False)
class Replica:
    """One engine: slots (the hot-set's eviction class; held while running), host tier (the
    host tier's class, `PinnedLRU`), disk cache, queue, batch."""

    rid: str
    workers: list[float]
    slots: PinnedLRU[str, int]
    host: PinnedLRU[str, None] = field(default_factory=PinnedLRU)
    disk: OrderedDict[str, None] = field(default_factory=OrderedDict)
    loading: set[str] = field(default_factory=set)
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    stepping: bool = False
    tokens: Counter[str] = field(default_factory=Counter)  # by phase
    version: int = 0  # bumped when slots or host tier change (reports reuse their sets)
    _sets: tuple[int, frozenset[str], frozenset[str]] = (-1, frozenset(), frozenset())

    @property
    def ongoing(self) -> int:
        return len(self.waiting) + len(self.running)

    def tier(self, name: str) -> str:
        if name in self.slots:
            return "slot"
        if name in self.host:
            return "host"
        if name in self.loading:
            return "loading"
        return "disk" if name in self.disk else "store"

    def snapshot(self, num_slots: int, padded_pool_rank: int | None = None) -> Snapshot:
        """Its routing stats; `padded_pool_rank` set: also its slots as one rank pool row
        (rank, slots, free, evictable), which the padded layout does not report today."""
        if self._sets[0] != self.version:
            self._sets = (self.version, frozenset(self.slots.keys()), frozenset(self.host.keys()))
        pools: tuple[tuple[int, int, int, int], ...] = ()
        if padded_pool_rank is not None:
            evictable = sum(1 for name in self.slots if self.slots.evictable(name))
            pools = ((padded_pool_rank, num_slots, num_slots - len(self.slots), evictable),)
        return Snapshot(
            hot_set=self._sets[1],
            host_set=self._sets[2],
            num_slots=num_slots,
            running=len(self.running),
            waiting=len(self.waiting),
            waiting_adapters=frozenset(q.adapter for q in self.waiting),
            rank_pools=pools,
        )


def lru_put(lru: OrderedDict[str, None], name: str, cap: int) -> None:
    lru[name] = None
    lru.move_to_end(name)
    while len(lru) > cap:
        lru.popitem(last=False)


def host_put(host: PinnedLRU[str, None], name: str, cap: int) -> None:
    """Keep a parsed adapter as `HostTier._keep` does, its budget counted in adapters."""
    if name in host:
        return
    host.put(name, None)
    while len(host) > cap:
        victim = next(host.victims(keep=[name]), None)
        if victim is None:
            break
        host.pop(victim)


ARRIVE, STEP, FETCHED, REPORT = range(4)


class Simulator:
    """One policy over one traffic stream; `run` returns its metrics."""

    def __init__(
        self,
        cfg: SimConfig,
        traffic: Traffic,
        policy: Policy,
        step: StepModel,
        costs: TierCosts,
    ) -> None:
        self.cfg, self.traffic, self.policy = cfg, traffic, policy
        self.step, self.costs = step, costs
        self.replicas = {
            rid: Replica(
                rid, [0.0] * cfg.fetch_workers, slot_eviction(cfg.slot_eviction, cfg.slots)
            )
            for rid in policy.ids
        }
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = itertools.count()
        self.router_queue: deque[Request] = deque()
        self.requests: list[Request] = []
        self.unfinished = 0
        self.loads: dict[str, Counter[str]] = {}
        self.slot_samples: list[tuple[int, int]] = []
        self.starts = [p.start_s for p in traffic.phases]
        self.end_s = traffic.phases[-1].end_s

    # -- clock ------------------------------------------------------------------------------

    def push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def phase_at(self, t: float) -> str:
        if t >= self.end_s:
            return "drain"
        return self.traffic.phases[max(0, bisect.bisect_right(self.starts, t) - 1)].name

    def count(self, t: float, what: str) -> None:
        self.loads.setdefault(self.phase_at(t), Counter())[what] += 1

    # -- router -----------------------------------------------------------------------------

    def dispatch(self, q: Request, now: float) -> bool:
        """To the first replica in the policy's order with room (Ray's rejection fallback)."""
        for rid in self.policy.rank(q.adapter, now):
            r = self.replicas[rid]
            if r.ongoing < self.cfg.max_ongoing_requests:
                self.policy.on_send(rid)
                q.replica, q.tier, q.prefill_left = rid, r.tier(q.adapter), self.cfg.prompt_tokens
                r.waiting.append(q)
                if not r.stepping:
                    self.start_step(r, now)
                return True
        return False

    def drain_router(self, now: float) -> None:
        while self.router_queue and self.dispatch(self.router_queue[0], now):
            self.router_queue.popleft()

    # -- replica ----------------------------------------------------------------------------

    def fetch(self, r: Replica, name: str, rank: int, now: float) -> None:
        """Background store -> disk -> host (a parse only, when the disk cache has it)."""
        if name in r.loading:
            return
        r.loading.add(name)
        if name in r.disk:
            r.disk.move_to_end(name)
            took = self.costs.parse_s(rank)
            self.count(now, "parses")
        else:
            took = self.costs.fetch_s(rank) + self.costs.parse_s(rank)
            self.count(now, "store_fetches")
            self.count(now, "parses")
        i = min(range(len(r.workers)), key=r.workers.__getitem__)
        start = max(now, r.workers[i])
        r.workers[i] = start + took
        self.push(start + took, FETCHED, (r, name))

    def admit(self, r: Replica, now: float) -> float:
        """The scheduler's admission; returns the seconds of slot copies this step makes."""
        copy_s, held = 0.0, []
        while r.waiting and len(r.running) < self.cfg.max_num_seqs:
            q = r.waiting.popleft()
            name = q.adapter
            if name in r.slots:
                r.slots.get(name)
            elif name in r.host:
                full = len(r.slots) >= self.cfg.slots
                if full and next(r.slots.victims(keep=[name]), None) is None:
                    held.append(q)  # every slot held by a running request: wait
                    if len(held) >= 8:
                        break
                    continue
                r.slots.get(name)  # the hot-set's lookup (HotSet.ensure): one use, a miss
                if full:
                    r.slots.pop(next(r.slots.victims(keep=[name])))
                r.slots.put(name, 0)
                r.host.get(name)
                r.version += 1
                copy_s += self.costs.copy_s(q.rank)
                self.count(now, "slot_loads")
            else:
                self.fetch(r, name, q.rank, now)
                held.append(q)
                if len(held) >= 8:
                    break
                continue
            r.slots.hold(name)
            r.running.append(q)
        for q in reversed(held):
            r.waiting.appendleft(q)
        return copy_s

    def start_step(self, r: Replica, now: float) -> None:
        copy_s = self.admit(r, now)
        decodes = [q for q in r.running if q.prefill_left == 0]
        adapters = {q.adapter for q in decodes}
        budget = self.cfg.token_budget - len(decodes)
        prefilled, prefill_tokens = [], 0
        for q in r.running:
            if q.prefill_left > 0 and budget > 0:
                n = min(q.prefill_left, budget)
                q.prefill_left -= n
                budget -= n
                prefill_tokens += n
                adapters.add(q.adapter)
                if q.prefill_left == 0:
                    prefilled.append(q)
        if not decodes and not prefill_tokens:
            r.stepping = False
            return
        took = self.step.step_s(len(decodes), len(adapters), prefill_tokens) + copy_s
        r.stepping = True
        self.push(now + took, STEP, (r, decodes, prefilled))

    def end_step(
        self, r: Replica, decodes: list[Request], prefilled: list[Request], t: float
    ) -> None:
        """Tokens out; finished requests unpin their adapter and free room at the router."""
        finished = []
        for q in decodes:
            q.generated += 1
            if q.generated >= self.cfg.new_tokens:
                finished.append(q)
        for q in prefilled:
            q.first_token, q.generated = t, 1
            if q.generated >= self.cfg.new_tokens:
                finished.append(q)
        r.tokens[self.phase_at(t)] += len(decodes) + len(prefilled)
        r.stepping = False
        for q in finished:
            r.running.remove(q)
            r.slots.unhold(q.adapter)
            q.done = t
            self.unfinished -= 1
            self.policy.on_complete(r.rid)
        if finished:
            self.drain_router(t)
        if not r.stepping:
            self.start_step(r, t)

    def fetched(self, r: Replica, name: str, t: float) -> None:
        r.loading.discard(name)
        lru_put(r.disk, name, self.cfg.disk_adapters)
        host_put(r.host, name, self.cfg.host_adapters)
        r.version += 1
        if not r.stepping:
            self.start_step(r, t)

    def report(self, t: float) -> None:
        if self.phase_at(t) in MEASURED_PHASES:
            self.sample_slots()
        pool_rank = self.cfg.max_rank if self.cfg.report_padded_pool else None
        snaps = {rid: r.snapshot(self.cfg.slots, pool_rank) for rid, r in self.replicas.items()}
        self.policy.on_report(snaps, t)

    def sample_slots(self) -> None:
        """Slots held by running requests, and distinct adapters over all replicas' slots."""
        names = [n for r in self.replicas.values() for n in r.slots]
        held = sum(r.slots.held(n) for r in self.replicas.values() for n in r.slots)
        self.slot_samples.append((held, len(set(names))))

    # -- run --------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        ranks = self.traffic.ranks
        for i, a in enumerate(self.traffic.arrivals):
            q = Request(i, a.adapter, ranks[a.adapter], a.t, a.phase)
            self.requests.append(q)
            self.push(a.t, ARRIVE, q)
        self.unfinished = len(self.requests)
        self.push(0.0, REPORT, None)
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            if kind == ARRIVE:
                self.policy.on_arrival(payload.adapter, t)
                if self.router_queue or not self.dispatch(payload, t):
                    self.router_queue.append(payload)
            elif kind == STEP:
                self.end_step(*payload, t)
            elif kind == FETCHED:
                self.fetched(*payload, t)
            elif self.unfinished or t < self.end_s:
                self.report(t)
                self.push(t + self.policy.stats_period_s, REPORT, None)
        return self.metrics()

    # -- metrics ----------------------------------------------------------------------------

    def window(self, phases: list[Phase]) -> dict[str, Any]:
        names = {p.name for p in phases}
        minutes = sum(p.minutes for p in phases)
        reqs = [q for q in self.requests if q.phase in names]
        ttft = np.array([q.first_token - q.arrival for q in reqs if q.first_token is not None])
        loads: Counter[str] = Counter()
        for name in names:
            loads.update(self.loads.get(name, Counter()))
        tokens = [sum(r.tokens[n] for n in names) for r in self.replicas.values()]
        mean = sum(tokens) / len(tokens)
        return {
            "requests": len(reqs),
            "slot_loads_per_min": round(loads["slot_loads"] / minutes, 1),
            "store_fetches_per_min": round(loads["store_fetches"] / minutes, 1),
            "parses_per_min": round(loads["parses"] / minutes, 1),
            "slot_hit": round(sum(q.tier == "slot" for q in reqs) / max(1, len(reqs)), 3),
            "ttft_p50_ms": round(float(np.percentile(ttft, 50)) * 1000, 1) if len(ttft) else None,
            "ttft_p99_ms": round(float(np.percentile(ttft, 99)) * 1000, 1) if len(ttft) else None,
            "imbalance": round(max(tokens) / mean, 3) if mean else None,
        }

    def spread(self, adapter: str, phase: str) -> dict[str, Any]:
        """Which replicas served `adapter`'s requests that arrived in `phase`."""
        where = Counter(
            q.replica for q in self.requests if q.adapter == adapter and q.phase == phase
        )
        total = sum(where.values())
        return {
            "adapter": adapter,
            "phase": phase,
            "requests": total,
            "replicas": len(where),
            "max_replica_share": round(max(where.values()) / total, 3) if total else None,
        }

    def hot_adapters(self, capacity_req_s: float) -> list[dict[str, Any]]:
        """Every adapter whose request rate in a measured phase exceeds one replica's capacity."""
        out = []
        for phase in self.traffic.phases:
            if phase.name not in MEASURED_PHASES:
                continue
            span = phase.end_s - phase.start_s
            counts = Counter(q.adapter for q in self.requests if q.phase == phase.name)
            for adapter, n in counts.most_common():
                if n / span <= capacity_req_s:
                    break
                out.append({**self.spread(adapter, phase.name), "req_per_s": round(n / span, 2)})
        return out

    def metrics(self) -> dict[str, Any]:
        phases = [p for p in self.traffic.phases if p.name in MEASURED_PHASES]
        return {
            "requests": len(self.requests),
            "served": sum(q.done is not None for q in self.requests),
            "measured": self.window(phases),
            "phases": {p.name: self.window([p]) for p in phases},
            "tokens_per_replica": {
                rid: sum(r.tokens[p.name] for p in phases) for rid, r in self.replicas.items()
            },
            "flash": self.spread(self.traffic.flash_adapter, "flash"),
            "slots_held_mean": round(float(np.mean([h for h, _ in self.slot_samples])), 1)
            if self.slot_samples
            else None,
            "distinct_resident_mean": round(float(np.mean([d for _, d in self.slot_samples])), 1)
            if self.slot_samples
            else None,
            "policy_info": self.policy.info(),
        }


def pooled_misses_per_min(traffic: Traffic, order: PinnedLRU[str, int], slots: int) -> float:
    """Misses per minute over the measured phases of all slots as one cache (nothing held,
    no adapter twice) evicting in `order`: the hot-set's own rule without replicas."""
    missed = 0
    for a in traffic.arrivals:
        if order.get(a.adapter) is not None:
            continue
        missed += a.phase in MEASURED_PHASES
        if len(order) >= slots:
            order.pop(next(order.victims(keep=[a.adapter])))
        order.put(a.adapter, 0)
    minutes = sum(p.minutes for p in traffic.phases if p.name in MEASURED_PHASES)
    return round(missed / minutes, 1)


def make_policy(
    name: str, cfg: SimConfig, traffic: Traffic, capacity_req_s: float, seed: int
) -> Policy:
    ids = [f"r{i}" for i in range(cfg.replicas)]
    cap = cfg.max_ongoing_requests
    if name == "ours":
        return Ours(
            ids,
            cap,
            seed,
            load_bound=cfg.load_bound,
            load_bound_ratio=cfg.load_bound_ratio,
            placement_memory_s=cfg.placement_memory_s,
            stats_period_s=cfg.stats_period_s,
            catalog_ranks=traffic.ranks,
        )
    if name == "random":
        return RandomPolicy(ids, cap, seed)
    if name == "least_loaded":
        return LeastLoaded(ids, cap, seed)
    if name == "rendezvous":
        return Rendezvous(ids, cap, seed)
    if name == "min_cost_flow":
        return MinCostFlow(ids, cap, seed, slots=cfg.slots, replica_req_per_s=capacity_req_s)
    if name == "llm_d":
        return LlmD(ids, cap, seed)
    raise ValueError(f"unknown policy {name!r} (one of {', '.join(POLICIES)})")


def run_policy(
    name: str, cfg: SimConfig, traffic: Traffic, step: StepModel, costs: TierCosts
) -> dict[str, Any]:
    capacity = replica_capacity(cfg, step)
    policy = make_policy(name, cfg, traffic, capacity, cfg.traffic.seed)
    sim = Simulator(cfg, traffic, policy, step, costs)
    started = time.process_time()
    out = sim.run()
    out["hot_adapters"] = sim.hot_adapters(capacity)
    out["cpu_s"] = round(time.process_time() - started, 2)
    return out


def evaluate(results: dict[str, dict[str, Any]], bounds: dict[str, float]) -> dict[str, Any]:
    """The issue's targets: ours >= 30% fewer slot loads per minute than the best other
    policy at equal or lower P99 TTFT; no adapter hotter than one replica served by one.

    Read two ways, both reported: against the other policy with the fewest loads whatever its
    P99 (met only if ours also has an equal or lower P99), and against the best of the others
    whose P99 is at most ours. `below_pooled_lru` says whether the load target lies under what
    all slots pooled into one LRU cache would miss on this trace."""
    out: dict[str, Any] = {
        "all_served": all(r["served"] == r["requests"] for r in results.values())
    }
    if "ours" not in results:
        return out
    ours = results["ours"]["measured"]
    versus = {}
    for name, res in results.items():
        if name == "ours":
            continue
        m = res["measured"]
        fewer = 1 - ours["slot_loads_per_min"] / m["slot_loads_per_min"]
        versus[name] = {
            "fewer_slot_loads": round(fewer, 3),
            "fewer_store_fetches": round(
                1 - ours["store_fetches_per_min"] / max(m["store_fetches_per_min"], 1e-9), 3
            ),
            "p99_ratio": round(ours["ttft_p99_ms"] / m["ttft_p99_ms"], 3),
            "met": fewer >= LOAD_TARGET and ours["ttft_p99_ms"] <= m["ttft_p99_ms"],
        }
    out["versus"] = versus
    if versus:
        loads = {n: results[n]["measured"]["slot_loads_per_min"] for n in versus}
        best = min(loads, key=loads.__getitem__)
        out["best_other_by_slot_loads"] = best
        out["loads_target_met"] = versus[best]["met"]
        out["target_slot_loads_per_min"] = round((1 - LOAD_TARGET) * loads[best], 1)
        out["below_pooled_lru"] = out["target_slot_loads_per_min"] < bounds["pooled_lru_per_min"]
        if "irm_online_per_min" in bounds:
            out["below_irm_online_bound"] = (
                out["target_slot_loads_per_min"] < bounds["irm_online_per_min"]
            )
        as_fast = [
            n for n in versus if results[n]["measured"]["ttft_p99_ms"] <= ours["ttft_p99_ms"]
        ]
        out["others_at_equal_or_lower_p99"] = as_fast
        if as_fast:
            best_fast = min(as_fast, key=loads.__getitem__)
            out["best_at_equal_or_lower_p99"] = best_fast
            out["loads_target_met_at_equal_p99"] = (
                versus[best_fast]["fewer_slot_loads"] >= LOAD_TARGET
            )
    out["no_hot_adapter_confined"] = (
        all(h["replicas"] > 1 for h in results["ours"]["hot_adapters"])
        and results["ours"]["flash"]["replicas"] > 1
    )
    return out


def tables(
    results: dict[str, dict[str, Any]], targets: dict[str, Any], bounds: dict[str, float]
) -> str:
    head = (
        "| policy | slot loads/min | store fetches/min | slot hit | TTFT p50 ms | TTFT p99 ms "
        "| imbalance | flash adapter: replicas (max share) | hot adapters confined "
        "| slots held by running requests | distinct adapters in slots |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for name, res in results.items():
        m, f = res["measured"], res["flash"]
        confined = sum(h["replicas"] <= 1 for h in res["hot_adapters"])
        rows.append(
            f"| {name} | {m['slot_loads_per_min']} | {m['store_fetches_per_min']} "
            f"| {m['slot_hit']} | {m['ttft_p50_ms']} | {m['ttft_p99_ms']} | {m['imbalance']} "
            f"| {f['replicas']} ({f['max_replica_share']}) "
            f"| {confined} of {len(res['hot_adapters'])} "
            f"| {res['slots_held_mean']} | {res['distinct_resident_mean']} |"
        )
    phase_head = (
        "\n| policy | phase | slot loads/min | store fetches/min | slot hit | TTFT p50 ms "
        "| TTFT p99 ms | imbalance |\n|---|---|---|---|---|---|---|---|\n"
    )
    phase_rows = [
        f"| {name} | {ph} | {m['slot_loads_per_min']} | {m['store_fetches_per_min']} "
        f"| {m['slot_hit']} | {m['ttft_p50_ms']} | {m['ttft_p99_ms']} | {m['imbalance']} |"
        for name, res in results.items()
        for ph, m in res["phases"].items()
    ]
    lines = [head + "\n".join(rows), phase_head + "\n".join(phase_rows), ""]
    lines.append(
        f"misses/min of all {bounds['slots']} slots as one cache on this trace: "
        f"pooled LRU {bounds['pooled_lru_per_min']}, pooled under the hot-set's own eviction "
        f"{bounds.get('pooled_hot_set_order_per_min')}, Belady (offline optimum) "
        f"{bounds['belady_per_min']}, each phase's top adapters with hindsight "
        f"{bounds['static_hindsight_per_min']}"
        + (
            f", any online cache's expected misses under the trace's own popularity "
            f"{bounds['irm_online_per_min']}"
            if "irm_online_per_min" in bounds
            else ""
        )
    )
    if "best_other_by_slot_loads" in targets:
        best = targets["best_other_by_slot_loads"]
        v = targets["versus"][best]
        lines.append(
            f"ours vs the other policy with the fewest slot loads ({best}): "
            f"{v['fewer_slot_loads']:.0%} fewer slot loads/min (target >= {LOAD_TARGET:.0%}, "
            f"i.e. <= {targets['target_slot_loads_per_min']}"
            + (", below the pooled LRU" if targets["below_pooled_lru"] else "")
            + (
                ", below any online cache's expected misses"
                if targets.get("below_irm_online_bound")
                else ""
            )
            + f"), P99 TTFT x{v['p99_ratio']} -> {'met' if v['met'] else 'NOT met'}"
        )
        fast = targets.get("best_at_equal_or_lower_p99")
        if fast is None:
            lines.append("no other policy has a P99 TTFT at or below ours")
        else:
            w = targets["versus"][fast]
            lines.append(
                f"ours vs the best other at equal or lower P99 TTFT ({fast}): "
                f"{w['fewer_slot_loads']:.0%} fewer slot loads/min -> "
                + ("met" if targets["loads_target_met_at_equal_p99"] else "NOT met")
            )
    if "no_hot_adapter_confined" in targets:
        lines.append(
            "no hot adapter confined to one replica (ours): "
            + ("yes" if targets["no_hot_adapter_confined"] else "NO")
        )
    lines.append("every request served: " + ("yes" if targets["all_served"] else "NO"))
    return "\n".join(lines)


def sensitivity_table(
    rows: dict[str, dict[str, Any]],
    title: str = "free distinct adapters (c = 0, rate recalibrated to the same load):",
) -> str:
    out = [
        f"\n{title}\n",
        "| policy | slot loads/min | store fetches/min | slot hit | TTFT p50 ms | TTFT p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in rows.items():
        out.append(
            f"| {name} | {m['slot_loads_per_min']} | {m['store_fetches_per_min']} "
            f"| {m['slot_hit']} | {m['ttft_p50_ms']} | {m['ttft_p99_ms']} |"
        )
    return "\n".join(out)


def what_if_line(results: dict[str, dict[str, Any]], what_if: dict[str, Any]) -> str:
    m = what_if["measured"]
    line = (
        "\nwhat-if, replicas report evictable slots (padded layout as one pool row): ours "
        f"{m['slot_loads_per_min']} slot loads/min, {m['store_fetches_per_min']} store "
        f"fetches/min, TTFT p50 {m['ttft_p50_ms']} ms, p99 {m['ttft_p99_ms']} ms"
    )
    if "ours" in results:
        line += f" (as reported today: p99 {results['ours']['measured']['ttft_p99_ms']} ms)"
    return line


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    m = res["measured"]
    keep = ("slot_loads_per_min", "store_fetches_per_min", "slot_hit", "ttft_p50_ms", "ttft_p99_ms")
    return {**{k: m[k] for k in keep}, "flash_replicas": res["flash"]["replicas"]}


def seeds_table(seeds: dict[str, dict[str, Any]]) -> str:
    out = [
        "\nother traffic seeds:\n",
        "| policy | seed | slot loads/min | store fetches/min | TTFT p99 ms | flash replicas |",
        "|---|---|---|---|---|---|",
    ]
    names = list(next(iter(seeds.values())))
    for name in names:
        for seed, summary in seeds.items():
            m = summary[name]
            out.append(
                f"| {name} | {seed} | {m['slot_loads_per_min']} | {m['store_fetches_per_min']} "
                f"| {m['ttft_p99_ms']} | {m['flash_replicas']} |"
            )
    return "\n".join(out)


def run_all(
    cfg: SimConfig, step: StepModel, costs: TierCosts, policies: list[str]
) -> tuple[Traffic, float, float, dict[str, dict[str, Any]]]:
    capacity = replica_capacity(cfg, step)
    rate = cfg.target_load * cfg.replicas * capacity
    traffic = make_traffic(cfg.traffic, rate)
    results = {name: run_policy(name, cfg, traffic, step, costs) for name in policies}
    return traffic, capacity, rate, results


def extra_runs(
    cfg: SimConfig,
    traffic: Traffic,
    step: StepModel,
    costs: TierCosts,
    policies: list[str],
    other_seeds: list[int],
) -> dict[str, Any]:
    """What the full run adds to the main table: ours with replicas reporting evictable slots
    for the padded layout (a what-if of the replica side), every policy on other traffic
    seeds, and every policy with distinct adapters free in the step model (the least certain
    of its constants: the fit's per-adapter term rests on the batch-8 points)."""
    what_if = None
    if "ours" in policies:
        padded = cfg.model_copy(update={"report_padded_pool": True})
        res = run_policy("ours", padded, traffic, step, costs)
        what_if = {
            "what": "replicas report their padded slots as one rank pool row [max_rank, slots, "
            "free, evictable] (today only pooled replicas report rows); policy code unchanged",
            **{k: res[k] for k in ("measured", "phases", "flash", "policy_info")},
        }
    seeds: dict[str, dict[str, Any]] = {}
    for seed in other_seeds:
        other = cfg.model_copy(update={"traffic": cfg.traffic.model_copy(update={"seed": seed})})
        other_traffic, _, _, res_s = run_all(other, step, costs, policies)
        seeds[str(seed)] = {name: summarize(r) for name, r in res_s.items()}
        if "ours" in policies:
            padded = other.model_copy(update={"report_padded_pool": True})
            res = run_policy("ours", padded, other_traffic, step, costs)
            seeds[str(seed)]["ours_what_if"] = summarize(res)
    free = step.model_copy(update={"per_adapter_ms": 0.0})
    _, cap0, rate0, res0 = run_all(cfg, free, costs, policies)
    lru = cfg.model_copy(update={"slot_eviction": "lru"})
    res_lru = {name: run_policy(name, lru, traffic, step, costs) for name in policies}
    return {
        "hot_sets_evicting_lru": {
            "what": "every policy on the same trace with the hot-sets' slots evicting least "
            "recently used (PinnedLRU, the rule before PinnedLFU)",
            "measured": {name: r["measured"] for name, r in res_lru.items()},
            "flash_replicas": {name: r["flash"]["replicas"] for name, r in res_lru.items()},
        },
        "what_if_padded_pool_report": what_if,
        "other_seeds": seeds or None,
        "sensitivity_free_adapters": {
            "what": "per_adapter_ms = 0, arrival rate recalibrated to the same target load",
            "replica_capacity_req_per_s": round(cap0, 3),
            "arrival_rate_per_s": round(rate0, 3),
            "measured": {name: r["measured"] for name, r in res0.items()},
            "flash_replicas": {name: r["flash"]["replicas"] for name, r in res0.items()},
        },
    }


def quick_config(seed: int) -> SimConfig:
    """A short timeline (same cluster and catalog) for the test: seconds, not minutes."""
    return SimConfig(
        traffic=TrafficConfig(
            seed=seed, warmup_s=30, steady_s=60, flash_s=30, recovery_s=30, shift_s=60
        )
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short phases (the test's smoke run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument(
        "--main-only",
        action="store_true",
        help="skip the what-if, other seeds and c = 0 reruns (the quick run skips them too)",
    )
    ap.add_argument(
        "--other-seeds",
        type=int,
        nargs="*",
        default=[1, 2],
        help="traffic seeds rerun for a summary (full run only)",
    )
    ap.add_argument("--out", type=Path, default=None, help=f"default {RESULTS}")
    args = ap.parse_args(argv)
    cfg = (
        quick_config(args.seed) if args.quick else SimConfig(traffic=TrafficConfig(seed=args.seed))
    )
    step, costs = measured_step_model(), measured_tier_costs()
    traffic, capacity, rate, results = run_all(cfg, step, costs, args.policies)
    bounds = cache_bounds(traffic, cfg.replicas * cfg.slots, MEASURED_PHASES)
    bounds["pooled_hot_set_order_per_min"] = pooled_misses_per_min(
        traffic, slot_order(cfg.replicas * cfg.slots), cfg.replicas * cfg.slots
    )
    bounds["irm_online_per_min"] = irm_bound(
        cfg.traffic, traffic, cfg.replicas * cfg.slots, MEASURED_PHASES
    )
    targets = evaluate(results, bounds)
    print(tables(results, targets, bounds))
    extras: dict[str, Any] = {}
    if not (args.quick or args.main_only):
        extras = extra_runs(cfg, traffic, step, costs, args.policies, args.other_seeds)
        if extras["what_if_padded_pool_report"] is not None:
            print(what_if_line(results, extras["what_if_padded_pool_report"]))
        if extras["other_seeds"]:
            print(seeds_table(extras["other_seeds"]))
        print(sensitivity_table(extras["sensitivity_free_adapters"]["measured"]))
        print(
            sensitivity_table(
                extras["hot_sets_evicting_lru"]["measured"],
                "hot-sets evicting least recently used (PinnedLRU), same trace:",
            )
        )
    out = args.out or (RESULTS.with_name("placement_sim_quick.json") if args.quick else RESULTS)
    write_json(
        out,
        {
            "benchmark": "placement_sim",
            "quick": args.quick,
            "config": cfg.model_dump(),
            "step_model": step.model_dump(),
            "tier_costs": costs.model_dump(),
            "replica_capacity_req_per_s": round(capacity, 3),
            "arrival_rate_per_s": round(rate, 3),
            "traffic": {
                "requests": len(traffic.arrivals),
                "phases": [p.model_dump() for p in traffic.phases],
                "flash_adapter": traffic.flash_adapter,
                "top_before_shift": traffic.top_before,
                "top_after_shift": traffic.top_after,
                "zipf_top_share": round(traffic.zipf_top_share, 4),
            },
            "cache_bounds": bounds,
            "results": results,
            "targets": targets,
            **extras,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
