"""The model replica: one engine per replica, streamed through the deployment handle.

`generate` yields the typed items of `deployments.protocol.wire` (wire dicts): `info` before
the first output (which replica, were its adapters hot), `delta`s (text, token ids, optional
attribution), `usage` last; or an `error` — also when the engine ended the request with
finish_reason "error" (an adapter that cannot load, a sequence that failed its step), so no
failure ever reaches the client as a 200. The items are formed by `deployments.replica.fanout`
from the engine's per-step batches. A cancelled call (client disconnect) aborts the request's
engine requests, which frees their KV blocks and slot pins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

import ray
from ray import serve

from deployments.catalog.store import open_source
from deployments.config import ServeConfig
from deployments.placement.affinity import base_name
from deployments.protocol.errors import error_item, stopped_item
from deployments.protocol.wire import InfoItem, encode
from deployments.replica import tokenize_ops
from deployments.replica.choices import choice_requests
from deployments.replica.fanout import Fanout, Job
from deployments.replica.heap import GcPauseMeter
from deployments.replica.replica_metrics import ReplicaMetrics
from deployments.replica.scheduling import compute_at_normal_policy
from deployments.replica.stream_channel import Outboxes
from deployments.telemetry import metrics
from molora_runtime.engine.types import EngineStats, GenerationRequest
from molora_runtime.lora.tiers import ResidencyReport, residency_counts

logger = logging.getLogger("ray.serve")


def use_assigned_cores() -> int:
    """Compute on as many threads as this replica was given CPUs (at least one).

    Ray sets OMP_NUM_THREADS from `num_cpus`, but a fractional or zero share leaves torch on
    one thread; the CPU count of the replica's resources is the intent, so take that. Fewer
    threads than assigned cores is set with `num_cpus`, never guessed here: on a real model
    the step's GEMMs need every core they were given.
    """
    import torch

    try:
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)
    except Exception:  # outside a Ray worker (unit use)
        cpus = 0.0
    threads = max(1, round(cpus)) if cpus else torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    logger.info(
        "replica computes on %d torch threads (%.2f CPUs assigned, %d cores)", threads, cpus, cores
    )
    return threads


def share_the_gil_quickly() -> None:
    """Hand the GIL over within ~0.5 ms instead of Python's default 5 ms.

    The step thread runs thousands of short torch ops per step, each releasing the GIL and
    taking it back, so a take-back that waits behind the streaming event loop should wait
    little. (A py-spy `--gil` profile at c=32 showed the GIL held 15% of the time, mostly by
    the step thread: a cheap safeguard, not the endpoint's bottleneck.)
    """
    sys.setswitchinterval(0.0005)


def warn_if_slow_serve_path() -> None:
    """Say so when Serve runs user code on its own thread (the shipped env vars are missing)."""
    from deployments.replica.serve_env import SERVE_ENV_VARS, serve_fast_path_active

    if not serve_fast_path_active():
        logger.warning(
            "Ray Serve hands every streamed token across threads: set the application's "
            "runtime_env.env_vars to %s (as serve_config.yaml does) for the fast path",
            SERVE_ENV_VARS,
        )


def stats_dict(stats: EngineStats) -> dict[str, Any]:
    return asdict(stats)


def by_name(ranks: dict[str, int]) -> dict[str, int]:
    """Adapter ranks by name without version (the largest over versions), as placement names them."""
    out: dict[str, int] = {}
    for ref, rank in ranks.items():
        out[base_name(ref)] = max(out.get(base_name(ref), 0), rank)
    return out


def tier_snapshot(hot_set: Any) -> ResidencyReport:
    """The hot-set's tier report plus which tier each adapter is in."""
    report = hot_set.tier_report()
    view = hot_set.residency()
    return ResidencyReport(
        tiers=report.tiers, stages=report.stages, residency=view, counts=residency_counts(view)
    )


def pin_versions(config: ServeConfig, source: Any) -> None:
    """Hot-set pins given by bare name become the version live now: requests arrive pinned to
    exact versions by the router, and only an exact ref shares their slot."""
    hot_set = config.engine.hot_set
    refs = []
    for ref in hot_set.pinned:
        try:
            refs.append(ref if "@" in ref else source.manifest("adapter", ref).ref)
        except Exception:  # the hot-set reports an adapter that cannot load
            refs.append(ref)
    hot_set.pinned = refs


@serve.deployment(
    name="ModelReplica",
    max_ongoing_requests=32,
    health_check_period_s=10,
    health_check_timeout_s=30,
    graceful_shutdown_wait_loop_s=2,
    graceful_shutdown_timeout_s=30,
)
class ModelReplica:
    """Owns one `AsyncEngine`; reports its hot-set and load for placement."""

    async def __init__(self, config: dict[str, Any]) -> None:
        from molora_runtime.engine.async_engine import AsyncEngine

        compute_at_normal_policy()  # before any engine thread exists: they inherit it
        use_assigned_cores()
        share_the_gil_quickly()
        warn_if_slow_serve_path()
        self._config = ServeConfig.model_validate(config)
        self._source = open_source(self._config.store)
        pin_versions(self._config, self._source)
        self._engine = AsyncEngine(self._config.engine, self._source)
        await self._engine.start()
        try:
            self._replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (unit use)
            self._replica_id = "local"
        self._outboxes = Outboxes()
        self._fanout = Fanout(self._engine.tokenizer)
        self._engine.add_sink(self._fanout)
        self._metrics = ReplicaMetrics(self._engine, self._source, self._config.base_model_name())
        self._metrics_task = asyncio.get_running_loop().create_task(self._metrics.run())
        self._gc_meter = GcPauseMeter(metrics.record_gc_pause).start()

    # -- serving ----------------------------------------------------------------------------

    async def generate(
        self,
        request: dict[str, Any],
        placement: dict[str, Any] | None = None,
        n: int = 1,
        channel: str | None = None,
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """Stream one request of `n` choices, each message a list of wire items (all the call
        holds when it resumes: `info` and the first output travel together); `placement` (the adapter set) is read by the
        router, not here. With `channel` (the calling router's channel id) attached here, the
        items after the first output go through that channel; `info.channel` says so. The
        engine's step batches reach the request through `Fanout`, not through this call's
        task: it only carries the head and waits for the end (or its cancellation)."""
        try:
            req = GenerationRequest.model_validate(request)
            if not isinstance(n, int) or not 1 <= n <= 64:
                raise ValueError(f"n={n!r} is not a choice count")
            reqs = choice_requests(req, n)
        except Exception as exc:
            yield [encode(error_item(exc))]
            return
        box = self._outboxes.open(channel) if isinstance(channel, str) else None
        info = InfoItem(
            replica=self._replica_id,
            hot_set_hit=self._hot_hit(req),
            tier=self._tier_of(req),
            channel=box is not None,
        )
        job = Job(req.request_id, len(reqs), encode(info), box)
        ids = [r.request_id for r in reqs]
        self._fanout.add(job, ids)
        try:
            try:
                await self._engine.submit(reqs)  # validates (tokenizes) off the event loop
            except Exception as exc:
                job.fail(error_item(exc))
            ended = False
            while not ended and (item := await job.head.get()) is not None:
                batch = [item]  # and whatever else is queued by now: one message
                while not job.head.empty():
                    more = job.head.get_nowait()
                    if more is None:
                        ended = True
                        break
                    batch.append(more)
                yield batch
        except asyncio.CancelledError:
            if job.routed and not job.ended:  # the router hears it on the channel, not this call
                box.put(job.key, encode(stopped_item()))  # type: ignore[union-attr]
            raise
        finally:
            self._fanout.remove(ids)
            if box is not None:
                box.active -= 1
            for rid in ids:
                with contextlib.suppress(Exception):
                    await self._engine.abort(rid)

    async def channel(
        self, channel_id: str, target_replica: str | None = None
    ) -> AsyncIterator[list[list[Any]]]:
        """A router's stream channel (deployments/replica/stream_channel.py): an empty hello, then one
        batch of `[request id, item]` pairs per send, until idle; `target_replica` was read by
        the request router."""
        if not isinstance(channel_id, str) or not 0 < len(channel_id) <= 128:
            raise ValueError("channel_id must be a short string")
        async for batch in self._outboxes.serve(channel_id):
            yield batch

    def _hot_names(self) -> set[str]:
        """Hot adapters and gate slots, named as placement names them."""
        stats = self._engine.stats()
        return {base_name(a) for a in stats.hot_set} | {
            f"composition:{base_name(c)}" for c in stats.compositions
        }

    def _hot_hit(self, req: GenerationRequest) -> bool:
        """Whether the exact versions the router pinned are resident (another version of the
        same name is a miss: it is never used for this request)."""
        route = req.route
        if route is None:
            return True
        stats = self._engine.stats()
        composition = getattr(route, "composition", None)
        return set(route.adapters()) <= set(stats.hot_set) and (
            composition is None or composition in stats.compositions
        )

    def _tier_of(self, req: GenerationRequest) -> str | None:
        """The worst tier of the request's adapters on arrival (None for the base model)."""
        try:
            names = req.route.adapters() if req.route is not None else []
            return self._engine.engine.hot_set.tier_of(names) if names else None
        except Exception:  # informational: never fail a request over it
            return None

    async def stats(self) -> dict[str, Any]:
        return {
            "replica": self._replica_id,
            "stream_channels": len(self._outboxes),
            **stats_dict(self._engine.stats()),
        }

    async def tier_stats(self) -> dict[str, Any]:
        """Per-tier counters, stage latencies and the per-adapter residency view (the admin
        stats endpoint); off the event loop, since the disk tier walks the cache folder."""
        report = await asyncio.to_thread(tier_snapshot, self._engine.engine.hot_set)
        return {"replica": self._replica_id, **report.model_dump()}

    async def health(self) -> dict[str, Any]:
        await self.check_health()
        return {"replica": self._replica_id, "model": self._engine.model_id}

    async def tokenize(self, payload: dict[str, Any]) -> dict[str, Any]:
        """`/tokenize` (validated by the router), off the event loop."""
        return await asyncio.to_thread(tokenize_ops.tokenize, self._engine.engine.checker, payload)

    async def detokenize(self, tokens: list[int]) -> dict[str, Any]:
        return await asyncio.to_thread(tokenize_ops.detokenize, self._engine.engine.checker, tokens)

    async def model_info(self) -> dict[str, Any]:
        return {"model_id": self._engine.model_id, "max_model_len": self._engine.max_model_len}

    # -- Serve hooks ------------------------------------------------------------------------

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by the controller and handed to the router as `routing_stats`."""
        stats = self._engine.stats()
        return {
            "hot_set": sorted(self._hot_names()),
            "load": stats.running + stats.waiting,
            "free_slots": stats.free_slots,
            "num_slots": stats.num_slots,
            "host_set": sorted({base_name(a) for a in stats.host_resident}),
            "rank_pools": [list(p) for p in stats.rank_pools],
            "ranks": by_name(stats.adapter_ranks),
        }

    async def check_health(self) -> None:
        if not self._engine.healthy:
            raise RuntimeError("engine stopped: step loop died")

    async def __del__(self) -> None:
        """Graceful shutdown: Serve drains requests first, then stops the step loop."""
        self._metrics_task.cancel()
        self._gc_meter.stop()
        with contextlib.suppress(Exception):
            await self._engine.shutdown()
