"""The cluster benchmarks' load client: one streamed chat request timed and attributed (its
replica, hot-set hit and adapter tier from the `molora` stream field), Zipf draws of adapter
names, and a percentile. Affinity's hit rate over Ray's router is measured by
`benchmarks/cluster.py` (its placement phase)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.sse import sse_events


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


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
