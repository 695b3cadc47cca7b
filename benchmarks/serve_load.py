"""Load test of the serving endpoint: many concurrent streaming clients, Zipf adapter popularity.

Reports throughput, TTFT and inter-token p50/p99, and the hot-set hit rate (the share of requests
whose adapters were already resident on the replica that served them), for our adapter-affinity
placement and for Ray's default power-of-two router on the same request sequence.

    # start a local loopback cluster, deploy each policy on 2 replicas, compare, write JSON:
    .venv/bin/python -m benchmarks.serve_load
    # only drive an endpoint that is already running (e.g. `make serve`):
    .venv/bin/python -m benchmarks.serve_load --url http://127.0.0.1:8000

Writes `benchmarks/results/serve_load.json` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from ray import serve

from benchmarks.report import RESULTS_DIR, write_json
from benchmarks.sse import sse_events
from deployments.app import build
from deployments.config import ServeConfig
from molora_runtime.model.model_paths import resolve_model_path
from tests.deployments.serve_assets import make_store, make_tiny_model
from tests.support.local_ray import start_local_cluster, stop_local_cluster

RESULTS = RESULTS_DIR / "serve_load.json"
APP = "molora-bench"
PROMPTS = [
    "Explain why the sky is blue.",
    "Write a haiku about the sea.",
    "What is 17 times 23?",
    "Summarize the plot of Hamlet in two sentences.",
    "Give three tips for writing clean Python.",
]


@dataclass
class Sample:
    model: str
    ok: bool
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    hit: bool | None = None
    replica: str | None = None
    tier: str | None = None  # where its adapter was when it reached the replica
    error: str | None = None


def zipf_sequence(names: list[str], n: int, s: float, seed: int) -> list[str]:
    """`n` draws where the i-th most popular name has weight 1 / i**s."""
    weights = [1.0 / (i + 1) ** s for i in range(len(names))]
    return random.Random(seed).choices(names, weights=weights, k=n)


async def one_request(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> Sample:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sample = Sample(model=model, ok=False)
    start = time.perf_counter()
    last = None
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                sample.error = f"{resp.status_code}: {(await resp.aread())[:200]!r}"
                return sample
            async for chunk in sse_events(resp):
                if "error" in chunk:
                    sample.error = chunk["error"]["message"]
                    return sample
                if chunk.get("molora", {}).get("replica"):
                    sample.hit = chunk["molora"].get("hot_set_hit")
                    sample.replica = chunk["molora"]["replica"]
                    sample.tier = sample.tier or chunk["molora"].get("tier")
                if chunk.get("usage"):
                    sample.tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    now = time.perf_counter()
                    if last is None:
                        sample.ttft = now - start
                    else:
                        sample.gaps.append(now - last)
                    last = now
        sample.ok = True
    except httpx.HTTPError as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
    return sample


async def drive(
    url: str,
    models: list[str],
    concurrency: int,
    max_tokens: int,
    prompts: list[str] = PROMPTS,
) -> tuple[list[Sample], float]:
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for i, m in enumerate(models):
        queue.put_nowait((i, m))
    samples: list[Sample] = []
    limits = httpx.Limits(
        max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4
    )
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as http:

        async def worker() -> None:
            while not queue.empty():
                i, model = queue.get_nowait()
                samples.append(
                    await one_request(http, model, prompts[i % len(prompts)], max_tokens)
                )

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return samples, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(samples: list[Sample], wall: float) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    gaps = [g for s in ok for g in s.gaps]
    hits = [s.hit for s in ok if s.hit is not None]
    tokens = sum(s.tokens for s in ok)
    return {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "first_errors": [s.error for s in samples if not s.ok][:3],
        "wall_s": round(wall, 2),
        "req_per_s": round(len(ok) / wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "ttft_p50_ms": round(1000 * pct([s.ttft for s in ok], 0.5), 1),
        "ttft_p99_ms": round(1000 * pct([s.ttft for s in ok], 0.99), 1),
        "itl_p50_ms": round(1000 * pct(gaps, 0.5), 2),
        "itl_p99_ms": round(1000 * pct(gaps, 0.99), 2),
        "hot_set_hit_rate": round(sum(hits) / len(hits), 3) if hits else None,
        "per_replica": dict(Counter(s.replica for s in ok)),
        "mean_completion_tokens": round(statistics.mean(s.tokens for s in ok), 1) if ok else 0,
    }


async def run_load(url: str, names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    warm = zipf_sequence(names, args.warmup, args.zipf, args.seed + 1)
    await drive(url, warm, args.concurrency, args.max_tokens)
    models = zipf_sequence(names, args.requests, args.zipf, args.seed)
    samples, wall = await drive(url, models, args.concurrency, args.max_tokens)
    return summarize(samples, wall)


# ---- local cluster mode --------------------------------------------------------------------


def build_assets(args: argparse.Namespace, work: Path) -> tuple[str, Path, list[str]]:
    names = [f"skill{i}" for i in range(args.adapters)]
    if args.tiny:
        (work / "model").mkdir()
        model = make_tiny_model(work / "model")
    else:
        model = resolve_model_path(args.model)
    (work / "adapters").mkdir()
    store = make_store(model, work / "store", work / "adapters", tuple(names), rank=args.rank)
    return str(model), store, names


def launch_and_compare(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="molora-bench-"))
    model, store, names = build_assets(args, work)
    # Ray on loopback with token auth; Serve's port from tests.support.ports, retried if lost.
    cluster = start_local_cluster(num_cpus=8)
    url = cluster.url
    results: dict[str, Any] = {}
    try:
        for policy in args.policies:
            cfg = ServeConfig.from_args(
                {
                    "engine": {
                        "model": model,
                        "device": "cpu",
                        "dtype": "float32",
                        "enable_cuda_graph": False,
                        "max_num_seqs": args.max_num_seqs,
                        "max_queue_len": 256,
                        "hot_set": {"num_slots": args.slots, "max_rank": args.rank},
                    },
                    "store": {"url": str(store), "cache_dir": str(work / "cache")},
                    "placement": {"policy": policy, "load_bound": args.load_bound},
                }
            )
            replica_options = {
                "num_replicas": args.replicas,
                "max_ongoing_requests": 2 * args.max_num_seqs,
                "ray_actor_options": {"num_cpus": 1},
            }
            serve.run(
                build(cfg, replica_options=replica_options),
                name=APP,
                route_prefix="/",
                blocking=False,
            )
            deadline = time.monotonic() + 300
            while httpx.get(f"{url}/health", timeout=30).status_code != 200:
                if time.monotonic() > deadline:
                    raise TimeoutError("the app did not become healthy")
                time.sleep(1)
            print(f"[{policy}] running {args.requests} requests ...", flush=True)
            results[policy] = asyncio.run(run_load(url, names, args))
            serve.delete(APP)
    finally:
        stop_local_cluster(cluster)
    return {"model": Path(model).name, "adapters": names, "results": results}


def table(results: dict[str, dict[str, Any]]) -> str:
    cols = [
        ("placement", None),
        ("req/s", "req_per_s"),
        ("tok/s", "tokens_per_s"),
        ("TTFT p50 ms", "ttft_p50_ms"),
        ("TTFT p99 ms", "ttft_p99_ms"),
        ("ITL p50 ms", "itl_p50_ms"),
        ("ITL p99 ms", "itl_p99_ms"),
        ("hot-set hit", "hot_set_hit_rate"),
        ("errors", "errors"),
    ]
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for policy, r in results.items():
        label = {"affinity": "adapter affinity (ours)", "default": "Ray default (pow-2)"}.get(
            policy, policy
        )
        lines.append("| " + " | ".join([label] + [str(r[k]) for _, k in cols[1:]]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="drive this running endpoint instead of launching one")
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--zipf", type=float, default=1.1, help="popularity exponent")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--adapters", type=int, default=8, help="adapters in the launched store")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--slots", type=int, default=3, help="hot-set slots per replica")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--load-bound", type=int, default=4)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer random model instead")
    parser.add_argument(
        "--policies", nargs="+", default=["affinity", "default"], choices=["affinity", "default"]
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    if args.url:
        models = httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"]
        names = [m["id"] for m in models if m.get("molora", {}).get("kind") == "adapter"]
        if not names:
            parser.error("the endpoint lists no adapters")
        report = {
            "model": "endpoint",
            "adapters": names,
            "results": {"endpoint": asyncio.run(run_load(args.url, names, args))},
        }
    else:
        report = launch_and_compare(args)
    report["load"] = {k: v for k, v in vars(args).items() if k not in ("out", "url")}
    print(table(report["results"]))
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
