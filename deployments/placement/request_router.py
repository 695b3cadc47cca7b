"""Ray Serve `RequestRouter` that places requests by adapter affinity (see `placement`).

Replicas report their hot-set (and host tier) through `record_routing_stats`; the router adds what it placed
itself in the last few seconds (the reports lag) and its own in-flight counts, then ranks
replicas with `placement.place`. Replicas with rank pools also report each pool's free and
evictable slots and the ranks of the adapters they hold; with the catalog's ranks
(`rank_hints`) the router knows a request's ranks and counts its own recent placements
against the pools too. Ray probes the ranks in order and falls back to the next
rank when a replica rejects (full), so overload spills instead of queueing at the home.
The router also counts each adapter set's share of its recent requests (`DemandTracker`, one
count per request id), which tells placement a cold set from a hot one.

A call that names `target_replica` (a router's stream channel, deployments/replica/stream_channel.py)
goes to that replica only, under either policy.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, defaultdict
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.catalog import rank_hints
from deployments.placement.affinity import ReplicaView, adapter_key, base_name, place
from deployments.placement.demand import DemandTracker
from deployments.placement.rank_fit import PoolView, occupy, parse_pools
from deployments.telemetry import metrics

logger = logging.getLogger("ray.serve")

PLACEMENT_KWARG = "placement"
TARGET_KWARG = "target_replica"  # a call for one named replica: the router's stream channel


def request_target(pending_request: PendingRequest | None) -> str | None:
    """The replica a call must reach (its stream channel), or None for placed calls."""
    if pending_request is None:
        return None
    target = pending_request.kwargs.get(TARGET_KWARG)
    return target if isinstance(target, str) else None


def targeted(candidates: list[RunningReplica], target: str) -> list[list[RunningReplica]]:
    """Only the named replica (none if it is gone: the caller's timeout ends the call)."""
    return [[r] for r in candidates if r.replica_id.unique_id == target]


def request_adapters(pending_request: PendingRequest | None) -> list[str]:
    """The adapter set the ingress attached to a generate call (empty for other calls)."""
    if pending_request is None:
        return []
    info = pending_request.kwargs.get(PLACEMENT_KWARG)
    if isinstance(info, dict):
        return [str(a) for a in info.get("adapters", [])]
    return []


class AdapterAffinityRouter(RequestRouter):
    """Hot-set-affinity placement within a load bound; rendezvous hashing for new sets."""

    def initialize_state(
        self,
        load_bound: int = 4,
        load_bound_ratio: float = 0.25,
        placement_memory_s: float = 5.0,
        demand_half_life_s: float = 60.0,
        **_: Any,
    ) -> None:
        self._load_bound = load_bound
        self._load_bound_ratio = load_bound_ratio
        self._memory_s = placement_memory_s
        self._inflight: dict[ReplicaID, int] = defaultdict(int)
        self._recent: dict[ReplicaID, dict[str, float]] = defaultdict(dict)
        self._counted: OrderedDict[str, None] = OrderedDict()
        self._demand = DemandTracker(demand_half_life_s)

    # -- views ------------------------------------------------------------------------------

    def _hot_set(self, replica: RunningReplica, now: float) -> frozenset[str]:
        stats = replica.routing_stats or {}
        reported = set(stats.get("hot_set", ()))
        recent = self._recent.get(replica.replica_id, {})
        for name, at in list(recent.items()):
            if now - at > self._memory_s:
                del recent[name]
        return frozenset(reported | set(recent))

    def _load(self, replica: RunningReplica) -> int:
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        return max(self._inflight.get(replica.replica_id, 0), cached or 0)

    def _pools(
        self, replica: RunningReplica, hot_set: frozenset[str], ranks: dict[str, int]
    ) -> tuple[PoolView, ...]:
        """Its reported rank pools, less the slots its recent placements took since."""
        stats = replica.routing_stats or {}
        pools = parse_pools(stats.get("rank_pools"))
        reported = {base_name(a) for a in stats.get("hot_set", ())}
        for name in sorted(hot_set - reported):
            if pools and name in ranks:
                pools = occupy(pools, ranks[name])
        return pools

    def views(
        self, replicas: list[RunningReplica], ranks: dict[str, int] | None = None
    ) -> list[ReplicaView]:
        now = time.monotonic()
        out = []
        for r in replicas:
            hot_set = self._hot_set(r, now)
            out.append(
                ReplicaView(
                    replica_id=r.replica_id.unique_id,
                    hot_set=hot_set,
                    load=self._load(r),
                    capacity=r.max_ongoing_requests,
                    slots=(r.routing_stats or {}).get("num_slots"),
                    host_set=frozenset((r.routing_stats or {}).get("host_set", ())),
                    pools=self._pools(r, hot_set, ranks or {}),
                )
            )
        return out

    @staticmethod
    def ranks(replicas: list[RunningReplica], names: set[str]) -> dict[str, int]:
        """Ranks of `names`: the largest any replica reported having read, else the catalog's."""
        found: dict[str, int] = {}
        for r in replicas:
            reported = (r.routing_stats or {}).get("ranks")
            if not isinstance(reported, dict):
                continue
            for name in names:
                rank = reported.get(name)
                if isinstance(rank, int) and not isinstance(rank, bool) and rank > 0:
                    found[name] = max(found.get(name, 0), rank)
        for name in names - found.keys():
            if (rank := rank_hints.catalog_rank(name)) is not None:
                found[name] = rank
        return found

    # -- RequestRouter API ------------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if (target := request_target(pending_request)) is not None:
            return targeted(candidate_replicas, target)
        if pending_request is not None:
            # Every rank is offered in one pass, so a further pass must back off, not spin.
            pending_request.routing_context.should_backoff = True
        adapters = request_adapters(pending_request)
        key = adapter_key(adapters)
        if self._first_pass(pending_request):  # base requests count in the total
            self._demand.observe([key] if adapters else [], time.monotonic())
        recent = {n for r in candidate_replicas for n in self._recent.get(r.replica_id, {})}
        ranks = self.ranks(candidate_replicas, {base_name(a) for a in adapters} | recent)
        decision = place(
            adapters,
            self.views(candidate_replicas, ranks),
            self._load_bound,
            self._load_bound_ratio,
            ranks,
            share=self._demand.share(key) if adapters else None,
        )
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranked = [by_id[rid] for rid in decision.ranked]
        if adapters and ranked:
            now = time.monotonic()
            for name in adapters:
                self._recent[ranked[0].replica_id][name] = now
        self._count(pending_request, decision.outcome)
        return [[r] for r in ranked]

    def _first_pass(self, pending_request: PendingRequest | None) -> bool:
        """Whether this is the request's first placement (a retry is not counted again)."""
        return (
            pending_request is not None
            and pending_request.metadata.internal_request_id not in self._counted
        )

    def _count(self, pending_request: PendingRequest | None, outcome: str) -> None:
        if pending_request is None:
            return
        rid = pending_request.metadata.internal_request_id
        if rid in self._counted:
            return
        self._counted[rid] = None
        while len(self._counted) > 4096:
            self._counted.popitem(last=False)
        try:
            metrics.placements().inc(tags={"outcome": outcome})
        except Exception:  # metrics must never break routing
            logger.debug("placement metric failed", exc_info=True)

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self._inflight[replica_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self._inflight[replica_id] = max(0, self._inflight.get(replica_id, 0) - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._inflight.pop(replica_id, None)
        self._recent.pop(replica_id, None)


class TargetingPowerOfTwoRouter(PowerOfTwoChoicesRequestRouter):
    """Ray's default placement (power of two choices), plus calls for one named replica."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if (target := request_target(pending_request)) is not None:
            return targeted(candidate_replicas, target)
        return await super().choose_replicas(candidate_replicas, pending_request)
