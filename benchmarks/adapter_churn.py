"""Adapter churn: N distinct adapters with Zipf popularity through a real Serve deployment.

The benchmark makes N adapters (r=4 on q_proj/v_proj of SmolLM2-135M, random small weights,
seeded), publishes them to a local store and to SeaweedFS (started here, ports from
`tests.support.ports`), deploys 2 model replicas with 8 slots each that serve from SeaweedFS
(store -> disk cache -> host tier -> slot), and streams chat completions from 16-32
concurrent clients over HTTP. Per cell: tok/s, TTFT and ITL p50/p99, failed requests, and the
share of requests whose adapters were in a slot / the host tier / the disk cache / only the
store on arrival (the replica's tier metrics, reported in each response's `molora.tier`).
Cells: an all-resident baseline (the same stream over 4 adapters), then N = 100 and 1,000
under the affinity router and under Ray Serve's default router.

    .venv/bin/python -m benchmarks.adapter_churn [--quick] [--sizes 100 1000]

Writes `benchmarks/results/adapter_churn.json` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
from ray import serve
from safetensors.torch import save_file

from adapter_store import open_registry
from adapter_store.errors import VersionExistsError
from benchmarks.report import write_json
from benchmarks.serve_load import Sample, pct, zipf_sequence
from benchmarks.serve_load import drive as load_drive
from deployments.app import build
from deployments.config import ServeConfig
from molora_runtime.model.model_paths import resolve_model_path
from tests.support.local_ray import start_local_cluster, stop_local_cluster
from tests.support.seaweedfs import SeaweedFS

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "adapter_churn.json"
APP = "molora-churn"
MODEL = "smollm2-135m-instruct"
RANK = 4
TARGETS = ("q_proj", "v_proj")
PROMPTS = [
    "Explain why the sky is blue.",
    "Write a haiku about the sea.",
    "Give three tips for writing clean Python.",
    "What is 17 times 23?",
]
TIERS = ("slot", "host", "loading", "disk", "store")
WARM = [f"warm{i}" for i in range(4)]  # warm-up adapters, never measured


# ---- adapters ------------------------------------------------------------------------------


def make_adapters(model_dir: Path, n: int, out: Path, seed: int) -> list[Path]:
    """`n` PEFT folders: r=4 LoRA on q/v of every layer, small random weights (seeded)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    d_out = {"q_proj": hidden, "v_proj": cfg["num_key_value_heads"] * head_dim}
    folders = []
    for i in range(n):
        gen = torch.Generator().manual_seed(seed * 100_003 + i)
        tensors = {}
        for layer in range(layers):
            for module in TARGETS:
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                a = torch.randn(RANK, hidden, generator=gen) * 0.02
                b = torch.randn(d_out[module], RANK, generator=gen) * 0.02
                tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16)
                tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16)
        folder = out / f"churn{i:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        config = {
            "peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK,
            "target_modules": list(TARGETS), "base_model_name_or_path": MODEL,
            "task_type": "CAUSAL_LM", "bias": "none", "fan_in_fan_out": False,
        }  # fmt: skip
        (folder / "adapter_config.json").write_text(json.dumps(config))
        folders.append(folder)
    return folders


def publish(registry: Any, folders: list[Path]) -> list[str]:
    """Publish every folder as `<folder name>@v1` (8 at a time: S3 puts are latency-bound)."""

    def one(folder: Path) -> None:
        # a retried put that had landed, or a reused work dir: already published
        with contextlib.suppress(VersionExistsError):
            registry.publish_adapter(folder, folder.name, "v1")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, folders))
    return [f.name for f in folders]


# ---- the load -----------------------------------------------------------------------------


async def drive(url: str, models: list[str], concurrency: int, max_tokens: int):
    """The serve_load client (streaming chat, TTFT and gaps per request) on these prompts."""
    return await load_drive(url, models, concurrency, max_tokens, PROMPTS)


def summarize(samples: list[Sample], wall: float) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    gaps = [g for s in ok for g in s.gaps]
    tiers = Counter(s.tier for s in ok if s.tier)
    seen = sum(tiers.values()) or 1
    return {
        "requests": len(samples),
        "failed": len(samples) - len(ok),
        "first_errors": [s.error for s in samples if not s.ok][:3],
        "wall_s": round(wall, 1),
        "tokens_per_s": round(sum(s.tokens for s in ok) / wall, 1),
        "ttft_p50_ms": round(1000 * pct([s.ttft for s in ok], 0.5), 1),
        "ttft_p99_ms": round(1000 * pct([s.ttft for s in ok], 0.99), 1),
        "itl_p50_ms": round(1000 * pct(gaps, 0.5), 1),
        "itl_p99_ms": round(1000 * pct(gaps, 0.99), 1),
        # share of requests by the tier their adapter was in when they reached the replica
        "tier_rates": {t: round(tiers.get(t, 0) / seen, 3) for t in TIERS},
    }


# ---- cells ---------------------------------------------------------------------------------


def serve_cell(
    cluster_url: str, store: dict[str, str], names: list[str], policy: str,
    args: argparse.Namespace, cache_dir: Path, resident: bool = False,
) -> dict[str, Any]:  # fmt: skip
    cfg = ServeConfig.from_args(
        {
            "engine": {
                "model": MODEL,
                "device": "cpu",
                "dtype": "float32",
                "enable_cuda_graph": False,
                "max_num_seqs": args.max_num_seqs,
                "max_model_len": 512,
                "max_queue_len": 256,
                "hot_set": {
                    "num_slots": args.slots,
                    "max_rank": RANK,
                    "target_modules": list(TARGETS),
                    "host_bytes": args.host_bytes,
                    "fetch_workers": 2,
                },
            },
            "store": {
                **store,
                "cache_dir": str(cache_dir),
                "cache_bytes": args.disk_bytes,
                "refresh_s": 600,  # the ingress lists N adapters once, not every 10 s
            },
            "placement": {"policy": policy},
            "server": {"default_max_tokens": args.max_tokens},
        }
    )
    options = {
        "num_replicas": args.replicas,
        "max_ongoing_requests": 2 * args.max_num_seqs,
        "ray_actor_options": {"num_cpus": 1},
    }
    serve.run(build(cfg, replica_options=options), name=APP, route_prefix="/", blocking=False)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{cluster_url}/health", timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the app did not become healthy")
            time.sleep(2)
        # Warm both replicas (first forward, first adapter load and its imports) on the base
        # model and on WARM adapters outside the measured set, so the measured tiers start cold
        # but no first-use cost lands in a cell. The all-resident baseline also loads its own
        # adapters first (each at its home): resident means in a slot before the first request.
        warm = [MODEL] * 12 + WARM + (names * 4 if resident else [])
        asyncio.run(drive(cluster_url, warm, 16, 4))
        models = zipf_sequence(names, args.requests, 1.0, args.seed)
        load_before = os.getloadavg()[0]
        samples, wall = asyncio.run(drive(cluster_url, models, args.concurrency, args.max_tokens))
        return {**summarize(samples, wall), "load_average_1m_at_start": round(load_before, 2)}
    finally:
        serve.delete(APP)


def table(cells: dict[str, dict[str, Any]]) -> str:
    cols = [
        ("cell", None), ("tok/s", "tokens_per_s"), ("TTFT p50 ms", "ttft_p50_ms"),
        ("TTFT p99 ms", "ttft_p99_ms"), ("ITL p50 ms", "itl_p50_ms"),
        ("ITL p99 ms", "itl_p99_ms"), ("slot", "slot"), ("host", "host"), ("disk", "disk"),
        ("store", "store"), ("failed", "failed"),
    ]  # fmt: skip
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for label, r in cells.items():
        rates = r["tier_rates"]
        values = [label] + [
            str(rates.get(k, "")) if k in TIERS else str(r[k])
            for _, k in cols[1:]  # type: ignore[operator]
        ]
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)


def verdict(cells: dict[str, dict[str, Any]], sizes: list[int]) -> dict[str, Any]:
    """The issue's targets, checked on this run."""
    base = cells.get("resident-4 affinity")
    big = max(sizes)
    aff, dflt = cells.get(f"N={big} affinity"), cells.get(f"N={big} default")
    out: dict[str, Any] = {}
    if base and aff:
        out["throughput_ratio"] = round(aff["tokens_per_s"] / base["tokens_per_s"], 3)
        out["throughput_target_met"] = out["throughput_ratio"] >= 0.5
        out["itl_p99_ratio"] = round(aff["itl_p99_ms"] / base["itl_p99_ms"], 3)
        out["itl_target_met"] = out["itl_p99_ratio"] <= 1.5
    out["failed_requests"] = sum(c["failed"] for c in cells.values())
    if aff and dflt:
        out["slot_hit_affinity"] = aff["tier_rates"]["slot"]
        out["slot_hit_default"] = dflt["tier_rates"]["slot"]
        out["affinity_beats_default"] = out["slot_hit_affinity"] > out["slot_hit_default"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer requests per cell")
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--host-bytes", default="96MiB", help="host tier per replica")
    parser.add_argument("--disk-bytes", default="256MiB", help="disk cache (shared by replicas)")
    parser.add_argument("--policies", nargs="+", default=["affinity", "default"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--store", choices=["seaweedfs", "local"], default="seaweedfs",
        help="serve from SeaweedFS (store -> disk cache -> host) or the local directory store",
    )  # fmt: skip
    parser.add_argument("--work", type=Path, help="reuse this work dir's adapters")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.requests = args.requests or (64 if args.quick else 320)

    work = args.work or Path(tempfile.mkdtemp(prefix="molora-churn-"))
    model_dir = Path(resolve_model_path(MODEL))
    started = time.time()
    n = max(args.sizes)
    if (work / "adapters").is_dir() and len(list((work / "adapters").iterdir())) >= n:
        folders = sorted((work / "adapters").iterdir())[:n]  # a reused work dir
        warm = [work / "warm" / name for name in WARM]
    else:
        folders = make_adapters(model_dir, n, work / "adapters", args.seed)
        warm = make_adapters(model_dir, len(WARM), work / "warm", args.seed + 1)
        warm = [w.rename(w.with_name(name)) for w, name in zip(warm, WARM, strict=True)]
    local = open_registry(str(work / "local-store"), create=True)
    names = publish(local, folders + warm)[:n]
    seaweed = None
    if args.store == "seaweedfs":
        seaweed = SeaweedFS(work / "seaweedfs").start()
        os.environ.update(seaweed.env())  # the replicas inherit the S3 credentials and endpoint
        bucket = seaweed.create_bucket()
        remote = open_registry(f"s3://{bucket}/churn", seaweed.endpoint_url, create=True)
        publish(remote, folders + warm)
        store = {"url": f"s3://{bucket}/churn", "endpoint_url": seaweed.endpoint_url}
    else:
        store = {"url": str(work / "local-store")}
    publish_s = round(time.time() - started, 1)
    print(f"made and published {len(names)} adapters in {publish_s} s", flush=True)
    cluster = start_local_cluster(num_cpus=8)
    cells: dict[str, dict[str, Any]] = {}
    plan = [("resident-4 affinity", names[:4], "affinity")]
    for n in args.sizes:
        plan += [(f"N={n} {p}", names[:n], p) for p in args.policies]
    try:
        for i, (label, subset, policy) in enumerate(plan):
            print(f"[{label}] {args.requests} requests ...", flush=True)
            cells[label] = serve_cell(
                cluster.url, store, subset, policy, args, work / f"cache-{i}", i == 0
            )
            print(json.dumps(cells[label]), flush=True)
    finally:
        stop_local_cluster(cluster)
        if seaweed is not None:
            seaweed.stop()
    report = {
        "model": MODEL,
        "adapters": {"rank": RANK, "targets": list(TARGETS), "made": len(names)},
        "published_to": ["local directory store"]
        + (["SeaweedFS"] if args.store == "seaweedfs" else []),
        "served_from": args.store,
        "publish_s": publish_s,
        "cells": cells,
        "targets": verdict(cells, args.sizes),
        # the load's settings (paths left out: a machine's folders say nothing of the run)
        "load": {k: v for k, v in vars(args).items() if not isinstance(v, Path)},
        "zipf": 1.0,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "shared": "2-core box shared with other engineers' jobs, run under nice -n 19: "
            "cells run minutes apart under different loads, so numbers and ratios are noisy",
            "load_average": os.getloadavg(),
        },
    }
    print(table(cells))
    print(json.dumps(report["targets"], indent=2))
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
