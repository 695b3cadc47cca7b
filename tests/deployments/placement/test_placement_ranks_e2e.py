"""Rank-aware placement on 2 real replicas with rank pools (one rank-8 slot, one rank-32 slot
each): a rank-4 adapter goes where a rank-8 slot is free instead of taking another replica's
last rank-32 slot, and a rank-32 adapter goes where a rank-32 slot is free instead of evicting,
each time against the rendezvous home that placement without ranks would pick."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from deployments.placement.affinity import rendezvous_order
from tests.deployments.serve_assets import make_adapter
from tests.deployments.serve_helpers import deployed, model_handle, shipped_args

SMALL = [f"small{i}" for i in range(12)]  # rank 4
BIG = [f"big{i}" for i in range(12)]  # rank 32
POOLS = [{"rank": 8, "slots": 2}, {"rank": 32, "slots": 1}]
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def mixed_store(tiny_assets, tmp_path_factory) -> dict[str, Path]:
    """The tiny model's store of 12 rank-4 and 12 rank-32 adapters (two weight sets, many
    names: placement only sees names and ranks)."""
    from adapter_store import open_registry

    root = tmp_path_factory.mktemp("rank-store")
    registry = open_registry(str(root / "store"), create=True)
    small = make_adapter(tiny_assets["model"], root / "small", seed=1, rank=4)
    big = make_adapter(tiny_assets["model"], root / "big", seed=2, rank=32)
    for name in SMALL:
        registry.publish_adapter(small, name, "v1")
    for name in BIG:
        registry.publish_adapter(big, name, "v1")
    return {**tiny_assets, "store": root / "store", "cache": root / "cache"}


@pytest.fixture(scope="module")
def app_url(ray_cluster, mixed_store):
    args = shipped_args(
        mixed_store, placement={"load_bound": 4, "load_bound_ratio": 0.0, "stats_period_s": 0.5}
    )
    args["engine"].update(max_num_seqs=4, hot_set={"rank_pools": POOLS})
    with deployed(ray_cluster["url"], args, replicas=2, max_ongoing=8):
        yield ray_cluster["url"]


async def replica_ids() -> list[str]:
    handle = model_handle()
    seen: set[str] = set()
    for _ in range(50):
        stats = await asyncio.gather(*(handle.stats.remote() for _ in range(4)))
        seen |= {s["replica"] for s in stats}
        if len(seen) == 2:
            return sorted(seen)
    raise AssertionError(f"one replica answered: {seen}")


async def served_by(http: httpx.AsyncClient, model: str) -> str:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 2, "ignore_eos": True}
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    await asyncio.sleep(1.2)  # the replicas report their pools
    return resp.json()["molora"]["replica"]


async def pools_of(replica: str) -> list[list[int]]:
    handle = model_handle()
    for _ in range(50):
        stats = await asyncio.gather(*(handle.stats.remote() for _ in range(4)))
        for s in stats:
            if s["replica"] == replica:
                return [list(p) for p in s["rank_pools"]]
    raise AssertionError(f"replica {replica} did not answer")


def homed(names: list[str], replica: str, ids: list[str]) -> list[str]:
    return [n for n in names if rendezvous_order(n, ids)[0] == replica]


async def test_ranks_decide_between_replicas_that_both_have_room(app_url):
    ids = await replica_ids()
    # x: the home of at least 3 small adapters; y, the other, of at least 2 big ones.
    x, y = next(
        (x, y)
        for x, y in (ids, ids[::-1])
        if len(homed(SMALL, x, ids)) >= 3 and len(homed(BIG, y, ids)) >= 2
    )
    s0, s1, s2 = homed(SMALL, x, ids)[:3]
    b0, b1 = homed(BIG, y, ids)[:2]
    for replica in (x, y):
        await pools_of(replica)  # both replicas up and answering
    await asyncio.sleep(1.2)  # and their pool reports at the router before the first request
    async with httpx.AsyncClient(base_url=app_url, timeout=120) as http:
        # Both rank-8 slots of x fill: these are x's adapters by rendezvous alone.
        assert [await served_by(http, s0), await served_by(http, s1)] == [x, x]
        assert await pools_of(x) == [[8, 2, 0, 2], [32, 1, 1, 0]]
        # s2's home x still has room (its rank-32 slot), but y has a free rank-8 slot.
        assert await served_by(http, s2) == y
        # b0 goes home to y's free rank-32 slot; b1, also y's by rendezvous, would evict b0
        # there (y still has a free rank-8 slot): x's free rank-32 slot takes it instead.
        assert await served_by(http, b0) == y
        assert await pools_of(y) == [[8, 2, 1, 1], [32, 1, 0, 1]]
        assert await served_by(http, b1) == x
    assert await pools_of(x) == [[8, 2, 0, 2], [32, 1, 0, 1]]
