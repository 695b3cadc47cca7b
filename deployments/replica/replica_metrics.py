"""A model replica's Prometheus metrics: engine load, hot-set and tier counters, gate usage,
vLLM's scheduler and cache series (running, waiting, KV usage, prefix cache, preemptions, queue
time) labelled with the served model name, vLLM's `lora_requests_info` (what the Gateway API
Inference Extension's endpoint picker reads) and the per-adapter residency of the slot and host
tiers (`deployments/replica/lora_info.py` bounds their labels).

The engine only keeps plain counters and timings (`EngineStats`, `pop_*`); this module is the one
place that turns them into Prometheus series.

Counters are exported as deltas of the engine's running totals once per `METRICS_PERIOD_S`;
labels are tier, state, stage, composition and adapter names only, and the `lora_requests_info`
lists.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from adapter_store.errors import NotFoundError
from deployments.placement.affinity import base_name
from deployments.replica.lora_info import lora_info_tags, namespaced, public_name, residency_rows
from deployments.telemetry import metric_names as names
from deployments.telemetry import metrics
from deployments.telemetry.gate_metrics import export_gate_telemetry
from molora_runtime.lora.composition import read_composition_config
from molora_runtime.lora.tiers import residency_counts

logger = logging.getLogger("ray.serve")

METRICS_PERIOD_S = 1.0


MAX_OWNER_MEMO = 100_000  # names whose owner is remembered (then looked up each time)
MAX_SPEC_NAMES = 64  # adapter labels of the speculative-decoding counters, then "other"


class ReplicaMetrics:
    """Exports one replica's engine statistics."""

    def __init__(self, engine: Any, source: Any, model_name: str) -> None:
        self._engine = engine
        self._source = source
        self._model = {"model_name": model_name}
        self._last_counters: dict[str, int] = {}
        self._experts: dict[str, list[str]] = {}
        self._owned: dict[str, bool] = {}  # adapter or composition name -> a tenant owns it
        self._spec_names: set[str] = set()

    # -- metrics ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Export every `METRICS_PERIOD_S` until cancelled; a failed export is skipped."""
        while True:
            try:
                self.export_once()
            except Exception:
                logger.debug("metric export failed", exc_info=True)
            await asyncio.sleep(METRICS_PERIOD_S)

    def _count(self, name: str, value: int, tags: dict[str, str], key: str = "") -> None:
        """Add to counter `name` what running total `value` (kept under `key`, default the
        name) gained since the last export."""
        if delta := self._delta(key or name, value):
            metrics.vllm_replica_counter(name).inc(delta, tags=tags)

    def _delta(self, key: str, value: int) -> int:
        delta = value - self._last_counters.get(key, 0)
        self._last_counters[key] = value
        return max(0, delta)

    def export_once(self) -> None:
        stats = self._engine.stats()
        metrics.queue_length().set(stats.waiting)
        metrics.running().set(stats.running)
        metrics.hotset_slots_used().set(stats.num_slots - stats.free_slots)
        for name, value in (
            (names.HOTSET_HITS, stats.hot_set_hits),
            (names.HOTSET_MISSES, stats.hot_set_misses),
            (names.HOTSET_EVICTIONS, stats.hot_set_evictions),
            (names.HOTSET_LOADS, stats.hot_set_loads),
        ):
            if delta := self._delta(name, value):
                metrics.hotset_counter(name).inc(delta)
        for seconds in self._engine.pop_load_latencies():
            metrics.hotset_load_latency().observe(seconds)
        self._export_vllm(stats)
        self._export_adapters(stats)
        self._export_tiers()
        self._export_gates(self._engine.pop_gate_stats())
        export_gate_telemetry(self._engine.pop_gate_telemetry(), self._adapter_names, base_name)

    def _export_vllm(self, stats: Any) -> None:
        """vLLM's names for the same quantities, so its dashboards and alerts read a replica."""
        kv = stats.kv
        usage = kv.blocks_used / kv.blocks_total if kv.blocks_total else 0.0
        for name, value in (
            (names.VLLM_RUNNING, stats.running),
            (names.VLLM_WAITING, stats.waiting),
            (names.VLLM_KV_USAGE, usage),
        ):
            metrics.vllm_replica_gauge(name).set(value, tags=self._model)
        for name, value in (
            (names.VLLM_PREFIX_QUERIES, kv.prefix_queried_tokens),
            (names.VLLM_PREFIX_HITS, kv.prefix_hit_tokens),
            (names.VLLM_PREEMPTIONS, kv.preemptions),
        ):
            self._count(name, value, self._model)
        for seconds in self._engine.pop_queue_times():
            metrics.vllm_queue_time().observe(seconds, tags=self._model)
        if stats.speculation is not None:
            self._export_speculation(stats.speculation)

    def _export_speculation(self, spec: Any) -> None:
        """vLLM's speculative-decoding counters, and ours by route kind and adapter."""
        total = spec.total
        for name, value in (
            (names.VLLM_SPEC_DRAFTS, total.drafts),
            (names.VLLM_SPEC_DRAFT_TOKENS, total.draft_tokens),
            (names.VLLM_SPEC_ACCEPTED, total.accepted),
        ):
            self._count(name, value, self._model)
        per_pos = names.VLLM_SPEC_ACCEPTED_PER_POS
        for pos, value in enumerate(spec.accepted_per_pos):
            tags = {**self._model, "position": str(pos)}
            self._count(per_pos, value, tags, key=f"{per_pos}:{pos}")
        for kind, tally in spec.by_route.items():
            self._spec_tokens(kind, "", tally)
        for name, tally in spec.by_name.items():
            self._spec_tokens("", name, tally)

    def _spec_tokens(self, route_kind: str, name: str, tally: Any) -> None:
        """One (route kind | adapter) row's draft and accepted token deltas; adapter labels
        are public names, at most MAX_SPEC_NAMES of them, then `other`."""
        label = public_name(name, self._private) if name else ""
        if label and label not in self._spec_names:
            if len(self._spec_names) >= MAX_SPEC_NAMES:
                label = "other"
            else:
                self._spec_names.add(label)
        for kind, value in (("draft", tally.draft_tokens), ("accepted", tally.accepted)):
            tags = {"route_kind": route_kind, "adapter": label, "kind": kind}
            key = f"{names.SPEC_TOKENS}:{route_kind}:{name}:{kind}"
            self._count(names.SPEC_TOKENS, value, tags, key=key)

    def _export_adapters(self, stats: Any) -> None:
        """vLLM's `lora_requests_info`, set to now under this period's labels, and a row per
        adapter (public name) in a slot or in host memory.

        Ray's gauges cannot drop a label set: one that is not set again leaves the node's
        exporter after two report intervals, and the API port keeps only each replica's newest
        `lora_requests_info` series (`exposition.merge`), so old adapter lists never pile up.
        """
        adapters = self._engine.request_adapters()
        private = self._private
        tags = lora_info_tags(adapters.running, adapters.waiting, stats.num_slots, private)
        metrics.vllm_lora_info().set(time.time(), tags=tags)
        rows = residency_rows(
            stats.hot_set, stats.host_resident, stats.pinned, stats.adapter_ranks, private=private
        )
        for row, count in rows.items():
            metrics.adapter_residency().set(count, tags=row._asdict())

    def _private(self, ref: str) -> bool:
        """Whether `ref` belongs to a tenant, by its store manifest (a name keeps its owner for
        good, so the answer is kept); namespaced names without a look-up, and any name the
        store cannot answer for is treated as private."""
        name = base_name(ref)
        known = self._owned.get(name)
        if known is None:
            known = namespaced(ref) or self._owned_in_store(ref)
            if len(self._owned) < MAX_OWNER_MEMO:
                self._owned[name] = known
        return known

    def _owned_in_store(self, ref: str) -> bool:
        manifest = getattr(self._source, "manifest", None)
        if manifest is None:
            return False  # a source without tenants (a plain directory of adapters)
        for kind in ("adapter", "composition"):
            try:
                return manifest(kind, ref).tenant is not None
            except NotFoundError:
                continue
            except Exception:
                return True
        return True

    def _export_tiers(self) -> None:
        """Per-tier counters and bytes, residency counts and stage latencies: labels are
        tier / state / stage names only, however many adapters there are."""
        hot_set = self._engine.engine.hot_set
        report = hot_set.tier_report()
        for tier, counts in report.tiers.items():
            for field, metric in metrics.TIER_COUNTERS.items():
                if delta := self._delta(f"{metric}:{tier}", getattr(counts, field)):
                    metrics.tier_counter(metric).inc(delta, tags={"tier": tier})
            metrics.tier_bytes().set(counts.bytes, tags={"tier": tier})
        for state, count in residency_counts(hot_set.residency()).items():
            metrics.tier_adapters().set(count, tags={"state": state})
        for stage, seconds in hot_set.stages.drain():
            metrics.load_stage_latency().observe(seconds, tags={"stage": stage})

    def _expert_names(self, composition: str) -> list[str]:
        """Gate order of a composition's experts (read once from its composition.json)."""
        if composition not in self._experts:
            folder = self._source.composition_path(composition)
            self._experts[composition] = list(read_composition_config(composition, folder).adapters)
        return self._experts[composition]

    def _adapter_names(self, composition: str) -> list[str]:
        return [base_name(n) for n in self._expert_names(composition)]

    def _export_gates(self, gate_stats: dict[str, list[list[int]]]) -> None:
        for composition, layers in gate_stats.items():
            names = self._expert_names(composition)
            for layer, counts in enumerate(layers):
                for k, count in enumerate(counts):
                    if count:
                        adapter = base_name(names[k]) if k < len(names) else str(k)
                        metrics.gate_tokens().inc(
                            count,
                            tags={
                                "composition": composition,
                                "layer": str(layer),
                                "adapter": adapter,
                            },
                        )
