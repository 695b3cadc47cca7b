"""Placement at scale on the real multi-node cluster, beside the placement simulator's prediction
for the same trace (a phase of benchmarks/cluster.py).

Three worker nodes x 2 model replicas x 16 slots, the tiny model, 1,000 PEFT adapters of ranks
8/16/32 in SeaweedFS, every node its own disk cache. The trace is the simulator's own
(`placement_traffic.make_traffic`): Poisson arrivals, Zipf(1.1) popularity, then a flash crowd on
a cold adapter and a popularity shift, sent open-loop at the arrival times. It runs twice on the
same deployment: cold (emptied disk caches, fresh replicas) and warm (the same trace again, every
adapter of it now on its node's disk).

The simulator then runs the same arrivals with the cluster's shape (replicas, slots, limits) and
its step and load times calibrated to this run: the step from the warm run's median inter-token
gap, a store fetch from the cold run's extra time to first token of the requests that fetched.
Counts (slot hit, slot loads and store fetches per minute, replicas that served the flash
adapter) are the comparison; times are the cluster's own, the simulator's only as calibrated.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.load_client import Sample, one_request, pct
from benchmarks.many_adapters import write_adapter
from benchmarks.placement_sim import (
    MEASURED_PHASES,
    SimConfig,
    StepModel,
    TierCosts,
    run_policy,
)
from benchmarks.placement_traffic import Arrival, Traffic, TrafficConfig, make_traffic
from tests.support.multinode import MultiNodeCluster, app_config

NODES = ("node_a", "node_b", "node_c")
REPLICAS_PER_NODE = 2
SLOTS = 16
MAX_NUM_SEQS = 8
MAX_TOKENS = 16
PROMPT = "Write a short story about a robot learning to paint."
PROMPT_TOKENS = 40  # the prompt under the chat template, as the simulator counts prefill
RANKS = (8, 16, 32)  # the tiny model's v_proj is 32 wide
RATE_PER_S = 4.0
WARM_P99_GOAL = 1.5  # cold P99 TTFT within this many times the warm run's


def traffic_config(quick: bool) -> TrafficConfig:
    """The simulator's timeline, shortened to minutes of a 2-core box."""
    spans = (10, 30, 15, 15, 30) if quick else (20, 60, 20, 20, 40)
    warmup, steady, flash, recovery, shift = spans
    return TrafficConfig(
        adapters=1000,
        zipf_s=1.1,
        ranks=RANKS,
        seed=0,
        warmup_s=warmup,
        steady_s=steady,
        flash_s=flash,
        recovery_s=recovery,
        shift_s=shift,
    )


def make_ranked_adapters(work: Path, model: Path, ranks: dict[str, int]) -> Path:
    """One PEFT folder per name at its rank (q_proj and v_proj, seeded random weights), written
    as `many_adapters` writes its stores."""
    out = work / "adapters"
    for i, (name, rank) in enumerate(sorted(ranks.items())):
        write_adapter(out / name, model, rank, seed=i + 1)
    return out


async def replay(url: str, traffic: Traffic) -> list[tuple[Arrival, Sample]]:
    """Every arrival sent at its time (open loop: a slow answer delays no later request)."""
    out: list[tuple[Arrival, Sample]] = []
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        t0 = time.monotonic()

        async def one(arrival: Arrival) -> None:
            await asyncio.sleep(max(0.0, arrival.t - (time.monotonic() - t0)))
            out.append((arrival, await one_request(http, arrival.adapter, PROMPT, MAX_TOKENS)))

        await asyncio.gather(*(one(a) for a in traffic.arrivals))
    return out


def windows(traffic: Traffic, samples: list[tuple[Arrival, Sample]]) -> dict[str, Any]:
    """Per measured phase, as the simulator reports it: slot hit on arrival, slot loads (a
    request whose adapter was not in a slot) and store fetches per minute, TTFT."""

    def one(phases: set[str], minutes: float) -> dict[str, Any]:
        got = [s for a, s in samples if a.phase in phases]
        ok = [s for s in got if s.ok]
        tiers = Counter(s.tier for s in ok)
        return {
            "requests": len(got),
            "failed": len(got) - len(ok),
            "slot_hit": round(tiers["slot"] / max(1, len(ok)), 3),
            "slot_loads_per_min": round((len(ok) - tiers["slot"]) / minutes, 1),
            "store_fetches_per_min": round(tiers["store"] / minutes, 1),
            "tiers": dict(tiers),
            "ttft_p50_ms": round(1000 * pct([s.ttft for s in ok], 0.5), 1),
            "ttft_p99_ms": round(1000 * pct([s.ttft for s in ok], 0.99), 1),
        }

    measured = [p for p in traffic.phases if p.name in MEASURED_PHASES]
    flash = Counter(
        s.replica for a, s in samples if a.phase == "flash" and a.adapter == traffic.flash_adapter
    )
    return {
        "measured": one({p.name for p in measured}, sum(p.minutes for p in measured)),
        "phases": {p.name: one({p.name}, p.minutes) for p in measured},
        "flash": {
            "adapter": traffic.flash_adapter,
            "requests": sum(flash.values()),
            "replicas": len(flash),
        },
        "errors": [s.error for _, s in samples if not s.ok][:5],
    }


def calibration(
    cold: list[tuple[Arrival, Sample]], warm: list[tuple[Arrival, Sample]]
) -> dict[str, Any]:
    """The step and load times the simulator is given, read off this run."""
    gaps = [g for _, s in warm if s.ok for g in s.gaps]
    step_ms = 1000 * float(np.median(gaps)) if gaps else 20.0
    warm_ttft = float(np.median([s.ttft for _, s in warm if s.ok] or [0.0]))
    fetched = [s.ttft for _, s in cold if s.ok and s.tier == "store"]
    fetch_s = max(0.0, float(np.median(fetched)) - warm_ttft) if fetched else 0.05
    return {
        "step_ms": round(step_ms, 2),
        "store_fetch_s": round(fetch_s, 3),
        "from": "step: warm run's median inter-token gap; fetch: cold run's median TTFT of "
        "requests that fetched from the store minus the warm run's median TTFT",
    }


def predicted(traffic_cfg: TrafficConfig, cal: dict[str, Any]) -> dict[str, Any]:
    """The simulator (policy `ours`, as deployed) on the same arrivals, the cluster's shape."""
    step = StepModel(
        base_ms=cal["step_ms"],
        per_seq_ms=0.0,
        per_adapter_ms=0.0,
        prefill_ms_per_token=0.0,
        source={"calibrated": cal["from"]},
    )
    costs = TierCosts(
        resolve_s=0.0,
        pull_s_r16=cal["store_fetch_s"],
        parse_s_r16=0.0,
        copy_s_r16=0.0,
        source={"calibrated": cal["from"]},
    )
    cfg = SimConfig(
        replicas=len(NODES) * REPLICAS_PER_NODE,
        slots=SLOTS,
        max_rank=max(RANKS),
        max_num_seqs=MAX_NUM_SEQS,
        max_ongoing_requests=MAX_NUM_SEQS + 1,
        prompt_tokens=PROMPT_TOKENS,
        new_tokens=MAX_TOKENS,
        disk_adapters=1000,
        traffic=traffic_cfg,
    )
    traffic = make_traffic(traffic_cfg, RATE_PER_S)
    out = run_policy("ours", cfg, traffic, step, costs)
    return {k: out[k] for k in ("measured", "phases", "flash")}


def scale(mn: MultiNodeCluster, model: Path, work: Path, quick: bool) -> dict[str, Any]:
    """Publish, deploy 6 replicas over 3 nodes, replay the trace cold then warm, simulate (no app
    deployed and the nodes' disk caches empty when called)."""
    for name in NODES:
        if name not in mn.nodes:
            mn.add_worker(name)
    traffic_cfg = traffic_config(quick)
    traffic = make_traffic(traffic_cfg, RATE_PER_S)
    started = time.monotonic()
    store = mn.publish(make_ranked_adapters(work, model, traffic.ranks), workers=16)
    publish_s = time.monotonic() - started
    app = app_config(
        model,
        store,
        model_replicas=len(NODES) * REPLICAS_PER_NODE,
        slots=SLOTS,
        max_num_seqs=MAX_NUM_SEQS,
        max_per_node=REPLICAS_PER_NODE,
    )
    app["args"]["engine"]["hot_set"]["max_rank"] = max(RANKS)
    mn.deploy(app)
    runs = {}
    for name in ("cold", "warm"):
        runs[name] = asyncio.run(replay(mn.url, traffic))
        print(f"scale {name}", json.dumps(windows(traffic, runs[name])["measured"]), flush=True)
    cal = calibration(runs["cold"], runs["warm"])
    cold, warm = windows(traffic, runs["cold"]), windows(traffic, runs["warm"])
    ratio = cold["measured"]["ttft_p99_ms"] / max(warm["measured"]["ttft_p99_ms"], 1e-9)
    return {
        "shape": f"{len(NODES)} nodes x {REPLICAS_PER_NODE} replicas x {SLOTS} slots, "
        f"max_num_seqs {MAX_NUM_SEQS}, tiny model, {MAX_TOKENS} tokens per request",
        "adapters": traffic_cfg.adapters,
        "ranks": list(RANKS),
        "traffic": {
            **traffic_cfg.model_dump(),
            "rate_per_s": RATE_PER_S,
            "requests": len(traffic.arrivals),
        },
        "publish_s": round(publish_s, 1),
        "cold": cold,
        "warm": warm,
        "calibration": cal,
        "simulated": predicted(traffic_cfg, cal),
        "cold_over_warm_ttft_p99": round(ratio, 2),
        "goal_cold_p99_within_1_5x_warm": ratio <= WARM_P99_GOAL,
    }


def scale_table(s: dict[str, Any]) -> list[tuple[str, str]]:
    """Rows for cluster.py's table: measured cold run beside the simulator's prediction."""
    c, p = s["cold"]["measured"], s["simulated"]["measured"]
    return [
        ("scale: slot hit (cluster / simulator)", f"{c['slot_hit']} / {p['slot_hit']}"),
        (
            "scale: store fetches per min (cluster / sim)",
            f"{c['store_fetches_per_min']} / {p['store_fetches_per_min']}",
        ),
        (
            "scale: slot loads per min (cluster / sim)",
            f"{c['slot_loads_per_min']} / {p['slot_loads_per_min']}",
        ),
        (
            "scale: TTFT p99 cold / warm (s)",
            f"{c['ttft_p99_ms'] / 1000:.2f} / {s['warm']['measured']['ttft_p99_ms'] / 1000:.2f} "
            f"({s['cold_over_warm_ttft_p99']}x)",
        ),
        (
            "scale: flash adapter replicas (cluster / sim)",
            f"{s['cold']['flash']['replicas']} / {s['simulated']['flash']['replicas']}",
        ),
    ]
