"""Placement policies for the simulator (benchmarks/placement_sim.py): ours and five baselines.

Every policy ranks replicas for one request (first = preferred); the simulator sends the request
to the first replica with room under `max_ongoing_requests`, as Ray does when a replica rejects,
and holds it at the router when every replica is full. A policy sees replicas only through what
they report every `stats_period_s` (`Snapshot`: hot-set, host tier, queue) plus what the router
itself knows without a lag: how many requests it has in flight on each.

- `ours` is the real code: it builds `ReplicaView`s the way
  deployments/placement/request_router.py's `AdapterAffinityRouter.views` does (reported hot-set
  plus its own placements of the last `placement_memory_s`, its in-flight count as the load,
  `max_ongoing_requests` as the capacity, the reported slots and host tier, the reported rank
  pools less its recent placements: none, as the padded layout reports none, unless the
  simulator's what-if has replicas report their one padded pool), the router's
  `DemandTracker` share of the request's adapter (counted once per request) and calls
  `deployments.placement.affinity.place`.
- `random` and `least_loaded` know nothing of adapters.
- `rendezvous`: the adapter's rendezvous home always, the next home only when it is full.
- `min_cost_flow` (Dynamo's semantics): every `solve_period_s` it estimates each adapter's
  request rate, gives adapters whose demand exceeds one replica several copies, and solves a
  min-cost flow of copies to replicas (a copy placed where the adapter is not resident costs a
  load; slots per replica are capacity, filled evenly); requests go to the least loaded replica
  the adapter is assigned to, adapters outside the plan to their rendezvous home.
- `llm_d` (the Gateway API Inference Extension's scorers, llm-d's defaults): LoRA affinity
  (1.0 resident, 0.8 room for one more adapter, 0.6 already queued there, else 0) plus the
  queue scorer (waiting requests, min-max normalised over replicas), weights 1 and 1, highest
  score wins, ties at random; metrics are refreshed every 50 ms, its default.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import networkx as nx

from deployments.placement.affinity import ReplicaView, adapter_key, place, rendezvous_order
from deployments.placement.demand import DemandTracker
from deployments.placement.rank_fit import PoolView, occupy, parse_pools


@dataclass(frozen=True)
class Snapshot:
    """A replica's routing stats as last reported (what `record_routing_stats` returns)."""

    hot_set: frozenset[str] = frozenset()
    host_set: frozenset[str] = frozenset()
    num_slots: int = 0
    running: int = 0
    waiting: int = 0
    waiting_adapters: frozenset[str] = frozenset()
    rank_pools: tuple[tuple[int, int, int, int], ...] = ()  # [rank, slots, free, evictable] rows


class Policy:
    """Common router state: replica ids, last reports, own in-flight counts, a seeded RNG."""

    name = "base"
    stats_period_s = 0.5

    def __init__(self, replica_ids: Sequence[str], capacity: int, seed: int = 0) -> None:
        self.ids = list(replica_ids)
        self.capacity = capacity
        self.rng = random.Random(seed)
        self.inflight: dict[str, int] = dict.fromkeys(self.ids, 0)
        self.snaps: dict[str, Snapshot] = {rid: Snapshot() for rid in self.ids}

    def rank(self, adapter: str, now: float) -> list[str]:
        raise NotImplementedError

    def on_arrival(self, adapter: str, now: float) -> None:
        """A request reached the router (before it is placed)."""

    def on_report(self, snaps: Mapping[str, Snapshot], now: float) -> None:
        self.snaps = dict(snaps)

    def on_send(self, rid: str) -> None:
        self.inflight[rid] += 1

    def on_complete(self, rid: str) -> None:
        self.inflight[rid] = max(0, self.inflight[rid] - 1)

    def info(self) -> dict[str, object]:
        return {}


class Ours(Policy):
    """`AdapterAffinityRouter` without Ray: the same views, the same `place` call."""

    name = "ours"

    def __init__(
        self,
        replica_ids: Sequence[str],
        capacity: int,
        seed: int = 0,
        load_bound: int = 4,
        load_bound_ratio: float = 0.25,
        placement_memory_s: float = 5.0,
        stats_period_s: float = 0.5,
        catalog_ranks: Mapping[str, int] | None = None,
        demand_half_life_s: float | None = 60.0,
    ) -> None:
        super().__init__(replica_ids, capacity, seed)
        self.load_bound = load_bound
        self.load_bound_ratio = load_bound_ratio
        self.memory_s = placement_memory_s
        self.stats_period_s = stats_period_s
        self.catalog_ranks = dict(catalog_ranks or {})
        self.recent: dict[str, dict[str, float]] = {rid: {} for rid in self.ids}
        self.outcomes: Counter[str] = Counter()
        self.demand = DemandTracker(demand_half_life_s) if demand_half_life_s else None

    def _hot_set(self, rid: str, now: float) -> frozenset[str]:
        recent = self.recent[rid]
        for name, at in list(recent.items()):
            if now - at > self.memory_s:
                del recent[name]
        return self.snaps[rid].hot_set | frozenset(recent)

    def _pools(self, rid: str, hot_set: frozenset[str]) -> tuple[PoolView, ...]:
        """Its reported rank pools less the slots its recent placements took since (none for
        the padded layout, which reports no pools)."""
        snap = self.snaps[rid]
        pools = parse_pools([list(row) for row in snap.rank_pools])
        for name in sorted(hot_set - snap.hot_set):
            if pools and name in self.catalog_ranks:
                pools = occupy(pools, self.catalog_ranks[name])
        return pools

    def on_arrival(self, adapter: str, now: float) -> None:
        """Counted once per request, as the router counts a request id once."""
        if self.demand is not None:
            self.demand.observe([adapter_key([adapter])], now)

    def views(self, now: float) -> list[ReplicaView]:
        out = []
        for rid in self.ids:
            hot_set = self._hot_set(rid, now)
            out.append(
                ReplicaView(
                    replica_id=rid,
                    hot_set=hot_set,
                    load=self.inflight[rid],
                    capacity=self.capacity,
                    slots=self.snaps[rid].num_slots or None,
                    host_set=self.snaps[rid].host_set,
                    pools=self._pools(rid, hot_set),
                )
            )
        return out

    def rank(self, adapter: str, now: float) -> list[str]:
        ranks = {adapter: self.catalog_ranks[adapter]} if adapter in self.catalog_ranks else {}
        share = self.demand.share(adapter_key([adapter])) if self.demand is not None else None
        decision = place(
            [adapter],
            self.views(now),
            self.load_bound,
            self.load_bound_ratio,
            ranks,
            share=share,
        )
        self.recent[decision.ranked[0]][adapter] = now
        self.outcomes[decision.outcome] += 1
        return decision.ranked

    def info(self) -> dict[str, object]:
        return {"outcomes": dict(self.outcomes)}


class RandomPolicy(Policy):
    name = "random"

    def rank(self, adapter: str, now: float) -> list[str]:
        order = list(self.ids)
        self.rng.shuffle(order)
        return order


class LeastLoaded(Policy):
    """Fewest requests in flight (the router's own count), ties at random."""

    name = "least_loaded"

    def rank(self, adapter: str, now: float) -> list[str]:
        return sorted(self.ids, key=lambda rid: (self.inflight[rid], self.rng.random()))


class Rendezvous(Policy):
    """The adapter's rendezvous home; the next one in its order only when the home is full."""

    name = "rendezvous"

    def __init__(self, replica_ids: Sequence[str], capacity: int, seed: int = 0) -> None:
        super().__init__(replica_ids, capacity, seed)
        self._orders: dict[str, list[str]] = {}

    def rank(self, adapter: str, now: float) -> list[str]:
        order = self._orders.get(adapter)
        if order is None:
            order = self._orders[adapter] = rendezvous_order(adapter, self.ids)
        return order


class MinCostFlow(Policy):
    """A periodic plan of adapters over replicas (Dynamo's semantics), solved as a min-cost
    flow of request rate; requests follow the plan, least loaded among an adapter's replicas.

    Each replica offers `units` of throughput (`target_util` of its request capacity, less its
    share of the traffic left out of the plan). An adapter supplies its measured rate in units;
    an edge to a replica costs nothing where the adapter is resident (as last reported) and one
    load spread over its units elsewhere. Network simplex returns a basic solution, so only the
    adapters whose demand does not fit on one replica are split, and a split adapter is planned
    on every replica that carries part of it.
    """

    name = "min_cost_flow"
    LOAD_COST = 10_000  # placing an adapter where it is not resident: one load

    def __init__(
        self,
        replica_ids: Sequence[str],
        capacity: int,
        seed: int = 0,
        slots: int = 16,
        replica_req_per_s: float = 1.0,
        solve_period_s: float = 10.0,
        window_s: float = 30.0,
        target_util: float = 0.85,
        units: int = 20,
        spare_slots: int = 4,
    ) -> None:
        super().__init__(replica_ids, capacity, seed)
        self.plan_slots = max(1, slots - spare_slots)
        self.replica_req_per_s = replica_req_per_s
        self.solve_period_s = solve_period_s
        self.window_s = window_s
        self.target_util = target_util
        self.units = units
        self.seen: deque[tuple[float, str]] = deque()
        self.assigned: dict[str, list[str]] = {}
        self.next_solve = 0.0
        self.solves = 0
        self._homes: dict[str, list[str]] = {}

    def on_arrival(self, adapter: str, now: float) -> None:
        self.seen.append((now, adapter))

    def on_report(self, snaps: Mapping[str, Snapshot], now: float) -> None:
        super().on_report(snaps, now)
        if now >= self.next_solve:
            self.solve(now)
            self.next_solve = now + self.solve_period_s

    def demand(self, rates: Mapping[str, float]) -> tuple[dict[str, int], int]:
        """Units each planned adapter needs and units each replica offers: the busiest
        adapters with at least half a unit, while the replicas' units and planned slots last."""
        unit = self.target_util * self.replica_req_per_s / self.units
        ordered = sorted(rates.items(), key=lambda kv: (-kv[1], kv[0]))
        planned: dict[str, int] = {}
        for adapter, rate in ordered:
            if rate < unit / 2 or len(planned) >= len(self.ids) * self.plan_slots // 2:
                break
            planned[adapter] = max(1, round(rate / unit))
        left_out = sum(rate for a, rate in ordered if a not in planned) / unit
        offer = max(1, self.units - math.ceil(left_out / len(self.ids)))
        budget = offer * len(self.ids)
        while planned and sum(planned.values()) > budget:  # the plan must be feasible
            planned.pop(next(reversed(planned)))
        return planned, offer

    def solve(self, now: float) -> None:
        while self.seen and self.seen[0][0] < now - self.window_s:
            self.seen.popleft()
        span = min(self.window_s, max(now, 1e-9))
        rates = {a: c / span for a, c in Counter(a for _, a in self.seen).items()}
        planned, offer = self.demand(rates)
        if not planned:
            self.assigned = {}
            return
        g = nx.DiGraph()
        g.add_node("sink", demand=sum(planned.values()))
        for rid in self.ids:
            g.add_edge(("r", rid), "sink", capacity=offer, weight=0)
        for adapter, need in planned.items():
            g.add_node(("a", adapter), demand=-need)
            for rid in self.ids:
                resident = adapter in self.snaps[rid].hot_set
                cost = 0 if resident else math.ceil(self.LOAD_COST / need)
                g.add_edge(("a", adapter), ("r", rid), capacity=need, weight=cost)
        flow = nx.min_cost_flow(g)
        self.assigned = {
            adapter: [rid for rid in self.ids if flow[("a", adapter)][("r", rid)] > 0]
            for adapter in planned
        }
        self.solves += 1

    def rank(self, adapter: str, now: float) -> list[str]:
        planned = self.assigned.get(adapter)
        if not planned:
            home = self._homes.get(adapter)
            if home is None:
                home = self._homes[adapter] = rendezvous_order(adapter, self.ids)
            return home
        first = sorted(planned, key=lambda rid: (self.inflight[rid], self.rng.random()))
        rest = sorted(
            (rid for rid in self.ids if rid not in planned),
            key=lambda rid: (self.inflight[rid], self.rng.random()),
        )
        return first + rest

    def info(self) -> dict[str, object]:
        return {"solves": self.solves, "planned_adapters": len(self.assigned)}


class LlmD(Policy):
    """LoRA-affinity scorer + queue scorer, weights 1:1, max score (ties random)."""

    name = "llm_d"
    stats_period_s = 0.05  # the extension's default metrics refresh interval

    def __init__(
        self,
        replica_ids: Sequence[str],
        capacity: int,
        seed: int = 0,
        lora_weight: float = 1.0,
        queue_weight: float = 1.0,
    ) -> None:
        super().__init__(replica_ids, capacity, seed)
        self.lora_weight = lora_weight
        self.queue_weight = queue_weight

    def lora_score(self, snap: Snapshot, adapter: str) -> float:
        if adapter in snap.hot_set:
            return 1.0
        if len(snap.hot_set | snap.waiting_adapters) < snap.num_slots:
            return 0.8
        if adapter in snap.waiting_adapters:
            return 0.6
        return 0.0

    def rank(self, adapter: str, now: float) -> list[str]:
        waits = [self.snaps[rid].waiting for rid in self.ids]
        lo, hi = min(waits), max(waits)
        scored = []
        for rid, w in zip(self.ids, waits, strict=True):
            queue = 1.0 if hi == lo else (hi - w) / (hi - lo)
            score = self.lora_weight * self.lora_score(self.snaps[rid], adapter)
            scored.append((-(score + self.queue_weight * queue), self.rng.random(), rid))
        return [rid for *_, rid in sorted(scored)]


POLICIES = ("ours", "random", "least_loaded", "rendezvous", "min_cost_flow", "llm_d")
