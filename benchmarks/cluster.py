"""The app on a multi-node Ray cluster on loopback (head + node_a + node_b, SeaweedFS store, each
node its own disk cache; tests/support/multinode.py): placement, node loss, rolling update and
autoscaling across nodes, with the tiny model.

- placement: 24 adapters, 4 model replicas (2 per worker node) x 4 slots, Zipf traffic; slot hit
  rate and store fetches under adapter-affinity placement and under Ray's default router (each
  on fresh replicas with emptied disk caches), and every replica's residency afterwards.
- node_loss: 32 streams running, node_b killed (raylet + workers, SIGKILL); new requests keep
  coming; counts of affected streams (error event), silent losses (no error, no finish), 5xx;
  time for errors to reach clients, and for the replica count to return once node_b is re-added.
- rolling_update: a changed config deployed (`serve deploy`) under steady load; failed requests.
- autoscale: 1..4 replicas under a load burst, then idle: replicas and nodes over time, with the
  clients' latency per sample.
- scale: a third worker node, 6 replicas x 16 slots, 1,000 adapters of ranks 8/16/32, the placement
  simulator's trace replayed open-loop cold then warm, beside the simulator's prediction
  (benchmarks/cluster_scale.py).

    python -m benchmarks.cluster [--quick] [--phases scale]

Writes benchmarks/results/cluster.json (with `lscpu`'s model name and flags; a run of some phases
keeps the others' results) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from ray import serve

from benchmarks.cluster_scale import scale, scale_table
from benchmarks.load_client import Sample, one_request, pct, zipf_sequence
from benchmarks.machine import machine_info
from benchmarks.report import RESULTS_DIR, write_json
from tests.support.multinode import (
    MultiNodeCluster,
    app_config,
    ensure_token_auth,
    make_assets,
    start_multinode,
)

RESULTS = RESULTS_DIR / "cluster.json"
PHASES = ("placement", "node_loss", "rolling_update", "autoscale", "scale")
PROMPT = "Write a short story about a robot learning to paint."


async def load(url: str, models: list[str], concurrency: int, max_tokens: int) -> list[Sample]:
    queue = list(enumerate(models))
    out: list[Sample] = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:

        async def worker() -> None:
            while queue:
                _, model = queue.pop(0)
                out.append(await one_request(http, model, PROMPT, max_tokens))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def replica_report(mn: MultiNodeCluster) -> list[dict[str, Any]]:
    """Each model replica's node and residency (what `/v1/admin/stats` answers per replica)."""
    nodes = {nid: name for name, nid in mn.node_ids().items()}
    where = {r["replica_id"]: nodes.get(r["node_id"], "?") for r in mn.replicas()}
    handle = serve.get_deployment_handle("ModelReplica", app_name="molora")
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(40):
        report = handle.tier_stats.remote().result(timeout_s=60)
        seen[report["replica"]] = report
        if len(seen) >= len(where):
            break
    return [
        {
            "replica": rid,
            "node": where.get(rid, "?"),
            "slot": sorted(a for a, t in r["residency"].items() if t == "slot"),
            # loads into this node's disk cache (from the store) and into slots
            "disk_loads": r["tiers"].get("disk", {}).get("loads", 0),
            "slot_loads": r["tiers"].get("slot", {}).get("loads", 0),
        }
        for rid, r in sorted(seen.items(), key=lambda kv: where.get(kv[0], "?"))
    ]


def placement(mn: MultiNodeCluster, model: Path, store: dict, args: argparse.Namespace) -> dict:
    names = [f"a{i:02d}" for i in range(24)]
    out: dict[str, Any] = {}
    for policy in ("default", "affinity"):
        with_cold_caches(mn)
        mn.deploy(app_config(model, store, model_replicas=4, slots=4, policy=policy))
        traffic = zipf_sequence(names, args.requests, 1.0, seed=0)
        samples = asyncio.run(load(mn.url, traffic, args.concurrency, args.max_tokens))
        ok = [s for s in samples if s.ok]
        tiers = Counter(s.tier for s in ok)
        out[policy] = {
            "requests": len(samples),
            "failed": len(samples) - len(ok),
            "slot_hit": round(tiers["slot"] / max(1, len(ok)), 3),
            "store_fetches": tiers["store"],
            "replicas_used": len({s.replica for s in ok}),
            "replicas": replica_report(mn),
        }
        serve.delete("molora")
    return {
        "affinity_slot_hit": out["affinity"]["slot_hit"],
        "default_slot_hit": out["default"]["slot_hit"],
        "affinity_store_fetches": out["affinity"]["store_fetches"],
        "default_store_fetches": out["default"]["store_fetches"],
        "adapters": len(names),
        "replicas_x_slots": "4 x 4",
        "zipf_s": 1.0,
        "cells": out,
    }


def with_cold_caches(mn: MultiNodeCluster) -> None:
    """Empty every node's adapter disk cache (no app is deployed while this runs)."""
    for home in mn.work.glob("home-*"):
        shutil.rmtree(home / "store-cache", ignore_errors=True)


async def _node_loss(mn: MultiNodeCluster, n_streams: int, max_tokens: int) -> dict[str, Any]:
    names = [f"a{i:02d}" for i in range(8)] + ["tiny-base"]
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens}
    body |= {"ignore_eos": True, "stream": True}
    results: list[dict[str, Any]] = []
    started = [asyncio.Event() for _ in range(n_streams)]
    nodes = {nid: name for name, nid in mn.node_ids().items()}
    where = {r["replica_id"]: nodes.get(r["node_id"]) for r in mn.replicas()}

    async def one(i: int, http: httpx.AsyncClient) -> None:
        res: dict[str, Any] = {"status": None, "end": "none", "replica": None}
        try:
            async with http.stream(
                "POST", "/v1/chat/completions", json=body | {"model": names[i % 9]}
            ) as r:
                res["status"] = r.status_code
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    started[i].set()
                    if line == "data: [DONE]":
                        res["done"] = True
                        continue
                    event = json.loads(line[6:])
                    res["replica"] = res["replica"] or event.get("molora", {}).get("replica")
                    if "error" in event:
                        res["end"], res["ended_at"] = "error", time.monotonic()
                    elif event.get("choices") and event["choices"][0].get("finish_reason"):
                        res["end"] = "finish"
        except httpx.HTTPError as exc:
            res["end"] = f"transport: {type(exc).__name__}"
        finally:
            started[i].set()
            results.append(res)

    after: list[int] = []
    async with httpx.AsyncClient(base_url=mn.url, timeout=300) as http:
        tasks = [asyncio.create_task(one(i, http)) for i in range(n_streams)]
        await asyncio.gather(*(e.wait() for e in started))
        killed_at = time.monotonic()
        mn.kill_worker("node_b")
        deadline = killed_at + 180  # a hung stream shows up as a silent loss, not a hang here
        while (not all(t.done() for t in tasks) or len(after) < 8) and time.monotonic() < deadline:
            chat = {"model": names[len(after) % 9], "max_tokens": 4}
            chat["messages"] = body["messages"]
            try:
                after.append((await http.post("/v1/chat/completions", json=chat)).status_code)
            except httpx.HTTPError:
                after.append(-1)
        await asyncio.wait(tasks, timeout=max(1.0, deadline - time.monotonic()))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    affected = [r for r in results if r["end"] == "error"]
    # Refused at admission (429/503 before the first token) is an answer, not a loss.
    admitted = [r for r in results if r["status"] == 200]
    silent = [
        r for r in admitted if r["end"] != "error" and not (r["end"] == "finish" and r.get("done"))
    ]
    readd = time.monotonic()
    mn.add_worker("node_b")
    while mn.running_by_node() != {"node_a": 2, "node_b": 2}:
        if time.monotonic() - readd > 300:
            break
        time.sleep(0.5)
    return {
        "streams": len(results),
        "affected": len(affected),
        "affected_on_lost_node": sum(where.get(r["replica"]) == "node_b" for r in affected),
        "silent_losses": len(silent),
        "silent_ends": dict(Counter(r["end"] for r in silent)),
        "stream_statuses": dict(Counter(str(r["status"]) for r in results)),
        "http_5xx": sum(500 <= s < 600 for s in after)
        + sum(500 <= (r["status"] or 0) < 600 for r in results),
        "requests_during_loss": len(after),
        "requests_during_loss_failed": sum(s != 200 for s in after),
        "error_event_after_kill_s": round(
            max((r["ended_at"] - killed_at for r in affected), default=0), 2
        ),
        "recovery_s": round(time.monotonic() - readd, 1),
        "replicas_after": mn.running_by_node(),
    }


async def _rolling(mn: MultiNodeCluster, app: dict, concurrency: int) -> dict[str, Any]:
    statuses: list[int] = []
    stop = asyncio.Event()
    names = [f"a{i:02d}" for i in range(8)]

    async def client(i: int, http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            s = await one_request(http, names[(i + len(statuses)) % 8], PROMPT, 16)
            statuses.append(200 if s.ok else 0)

    async with httpx.AsyncClient(base_url=mn.url, timeout=300) as http:
        tasks = [asyncio.create_task(client(i, http)) for i in range(concurrency)]
        await asyncio.sleep(3)
        started = time.monotonic()
        await asyncio.to_thread(mn.deploy, app)
        took = time.monotonic() - started
        await asyncio.sleep(3)
        stop.set()
        await asyncio.gather(*tasks)
    return {
        "requests": len(statuses),
        "failed": sum(s != 200 for s in statuses),
        "rollout_s": round(took, 1),
    }


def autoscale(mn: MultiNodeCluster, model: Path, store: dict, args: argparse.Namespace) -> dict:
    serve.delete("molora")
    auto = {
        "min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2,
        "upscale_delay_s": 2, "downscale_delay_s": 8, "look_back_period_s": 4,
    }  # fmt: skip
    mn.deploy(app_config(model, store, autoscaling=auto, max_num_seqs=4))
    timeline: list[dict[str, Any]] = []
    names = [f"a{i:02d}" for i in range(8)]
    t0 = time.monotonic()

    async def burst() -> list[Sample]:
        return await load(mn.url, names * (args.burst // 8), 16, args.max_tokens * 2)

    async def watch(stop: asyncio.Event) -> None:
        """Replicas per node each second, until the load ended and one replica is left (or 90 s)."""
        stopped_at = None
        while stopped_at is None or time.monotonic() - stopped_at < 90:
            counts = await asyncio.to_thread(mn.running_by_node)
            timeline.append({"t_s": round(time.monotonic() - t0, 1), "replicas": counts})
            if stop.is_set():
                stopped_at = stopped_at or time.monotonic()
                if sum(counts.values()) <= 1:
                    return
            await asyncio.sleep(1)

    async def run() -> list[Sample]:
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(stop))
        samples = await burst()
        timeline.append({"t_s": round(time.monotonic() - t0, 1), "load_ended": True})
        stop.set()
        await watcher
        return samples

    samples = asyncio.run(run())
    ok = [s for s in samples if s.ok]
    counted = [r for r in timeline if "replicas" in r]
    peak = max(counted, key=lambda r: sum(r["replicas"].values()))
    return {
        "max_replicas_seen": sum(peak["replicas"].values()),
        "nodes_used": sorted({n for r in counted for n in r["replicas"]}),
        "scaled_down_to": sum(counted[-1]["replicas"].values()),
        "requests": len(samples),
        "failed": len(samples) - len(ok),
        "ttft_p50_ms": round(1000 * pct([s.ttft for s in ok], 0.5), 1),
        "ttft_p99_ms": round(1000 * pct([s.ttft for s in ok], 0.99), 1),
        "timeline": timeline,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer requests per phase")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    args = parser.parse_args(argv)
    args.requests = 96 if args.quick else 384
    args.concurrency = 8
    args.max_tokens = 16
    args.burst = 64 if args.quick else 192
    ensure_token_auth()
    work = Path(tempfile.mkdtemp(prefix="molora-cluster-bench-"))
    model, adapters = make_assets(work / "assets", 24)
    mn = start_multinode(work / "cluster")
    kept = json.loads(args.out.read_text()) if args.out.exists() else {}
    result: dict[str, Any] = {k: v for k, v in kept.items() if k in PHASES}
    for phase in result.values():  # a kept phase keeps the box it ran on
        phase.setdefault("machine_info", kept.get("machine_info") or kept.get("machine"))
    try:
        store = mn.publish(adapters)
        app = app_config(model, store, model_replicas=4, slots=4)
        if "placement" in args.phases:
            result["placement"] = placement(mn, model, store, args)
            cells = {k: v for k, v in result["placement"].items() if k != "cells"}
            print("placement", cells, flush=True)
        if "node_loss" in args.phases:
            mn.deploy(app)
            result["node_loss"] = asyncio.run(_node_loss(mn, 32, 200 if args.quick else 400))
            print("node_loss", result["node_loss"], flush=True)
        if "rolling_update" in args.phases:
            mn.deploy(app)
            changed = copy.deepcopy(app)
            changed["args"]["engine"]["max_num_seqs"] = 6
            changed["args"]["server"]["default_max_tokens"] = 24
            result["rolling_update"] = asyncio.run(_rolling(mn, changed, 4))
            print("rolling_update", result["rolling_update"], flush=True)
        if "autoscale" in args.phases:
            result["autoscale"] = autoscale(mn, model, store, args)
            timeline = {k: v for k, v in result["autoscale"].items() if k != "timeline"}
            print("autoscale", timeline, flush=True)
        if "scale" in args.phases:
            serve.delete("molora")
            with_cold_caches(mn)
            result["scale"] = scale(mn, model, work / "scale", args.quick)
            print("scale", json.dumps(scale_table(result["scale"])), flush=True)
    finally:
        mn.stop()
        shutil.rmtree(work, ignore_errors=True)
    for name in args.phases:
        if name in result:
            result[name]["machine_info"] = machine_info()
    result["machine"] = {  # write_json adds the CPU model and flags under machine_info
        "note": "3 Ray nodes on one shared 2-core box: timings are noisy, counts are the result",
    }
    result["quick"] = args.quick
    print(table(result))
    write_json(args.out, result)
    return 0


def table(r: dict[str, Any]) -> str:
    rows: list[tuple[str, str]] = []
    if p := r.get("placement"):
        hit = f"{p['affinity_slot_hit']} / {p['default_slot_hit']}"
        fetches = f"{p['affinity_store_fetches']} / {p['default_store_fetches']}"
        rows.append(("placement slot hit (affinity / default)", hit))
        rows.append(("store fetches (affinity / default)", fetches))
    if n := r.get("node_loss"):
        lost = f"{n['streams']} / {n['affected']} / {n['silent_losses']} / {n['http_5xx']}"
        rows.append(("node loss: streams / affected / silent / 5xx", lost))
        rows.append(("node loss: recovery s after re-add", str(n["recovery_s"])))
    if u := r.get("rolling_update"):
        rows.append(("rolling update: requests / failed", f"{u['requests']} / {u['failed']}"))
    if a := r.get("autoscale"):
        nodes = ", ".join(a["nodes_used"])
        rows.append(("autoscale: max replicas / nodes", f"{a['max_replicas_seen']} / {nodes}"))
    if s := r.get("scale"):
        rows += scale_table(s)
    return "\n".join(["| phase | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


if __name__ == "__main__":
    raise SystemExit(main())
