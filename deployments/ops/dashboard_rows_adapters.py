"""Dashboard rows for adapters: the hot-set, the memory and disk tiers, the learned router."""

from __future__ import annotations

from deployments.ops.dashboard_panels import Panel, Row
from deployments.ops.dashboard_promql import (
    Query,
    grouped,
    hit_rate,
    percentiles,
    rate,
    sel,
    split_by,
)
from deployments.telemetry import metric_names as m


def _loads_and_evictions(by: str, loads: str, evictions: str) -> list[Query]:
    """An LRU cache's traffic: what it brought in and pushed out per second (per `by`)."""
    return grouped(by, {"loads": rate(loads), "evictions": rate(evictions)})


def rows() -> list[Row]:
    """The rows of this concern, top to bottom."""
    return [
        (
            "Adapter hot-set",
            [
                Panel(
                    "Hit rate",
                    "hits / (hits + misses) over all replicas.",
                    "percentunit",
                    [Query(hit_rate(), "hit rate")],
                    width=8,
                ),
                Panel(
                    "Loads and evictions",
                    "Adapters brought into a slot and pushed out of one (LRU).",
                    "ops",
                    _loads_and_evictions("", m.HOTSET_LOADS, m.HOTSET_EVICTIONS),
                    width=8,
                ),
                Panel(
                    "Slots in use",
                    "Occupied adapter slots per replica.",
                    "short",
                    split_by("replica", sel(m.HOTSET_SLOTS_USED)),
                    width=8,
                ),
                Panel(
                    "Adapter load latency",
                    "p50 / p90 / p99 time to bring an adapter from the store cache into a slot.",
                    "s",
                    percentiles(m.HOTSET_LOAD_LATENCY, ""),
                    width=24,
                ),
            ],
        ),
        (
            "Adapter tiers",
            [
                Panel(
                    "Hit rate by tier",
                    "hits / (hits + misses) of the slot, host-memory and disk tiers.",
                    "percentunit",
                    [Query(hit_rate(m.TIER_HITS, m.TIER_MISSES, by="tier"), "{{tier}}")],
                    width=8,
                ),
                Panel(
                    "Tier loads and evictions",
                    "Adapters brought into and pushed out of each tier (LRU; pinned stay).",
                    "ops",
                    _loads_and_evictions("tier", m.TIER_LOADS, m.TIER_EVICTIONS),
                    width=8,
                ),
                Panel(
                    "Tier bytes",
                    "Bytes each tier holds, summed over replicas.",
                    "bytes",
                    split_by("tier", sel(m.TIER_BYTES)),
                    width=8,
                ),
                Panel(
                    "Adapters by residency",
                    "How many adapters are in a slot, parsed in host memory, loading, or only "
                    "on disk, summed over replicas.",
                    "short",
                    split_by("state", sel(m.TIER_ADAPTERS)),
                    width=12,
                ),
                Panel(
                    "Load latency by stage",
                    "p50 / p90 / p99 of each load stage: fetch (store to disk), parse, copy.",
                    "s",
                    percentiles(m.LOAD_STAGE_LATENCY, "stage"),
                    width=12,
                ),
                Panel(
                    "Adapters in slots and host memory",
                    "Replicas holding each adapter (public name; a tenant's read private) in a "
                    "slot or parsed in host memory, by rank and pin.",
                    "short",
                    split_by("adapter, tier, rank, pinned", sel(m.ADAPTER_RESIDENCY)),
                    width=24,
                ),
            ],
        ),
        (
            "Learned router",
            [
                Panel(
                    "Gate share per adapter",
                    "Share of routed tokens each expert adapter receives, per composition "
                    "(summed over layers).",
                    "percentunit",
                    [
                        Query(
                            f"sum by (composition, adapter) ({rate(m.GATE_TOKENS)})"
                            " / ignoring(adapter) group_left "
                            f"sum by (composition) ({rate(m.GATE_TOKENS)})",
                            "{{composition}} / {{adapter}}",
                        )
                    ],
                    stack=True,
                ),
                Panel(
                    "Gate tokens per layer",
                    "Routed tokens per second by layer, to spot layers whose gate collapsed.",
                    "short",
                    [
                        Query(
                            f"sum by (composition, layer) ({rate(m.GATE_TOKENS)})",
                            "{{composition}} / layer {{layer}}",
                        )
                    ],
                ),
            ],
        ),
    ]
