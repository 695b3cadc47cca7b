"""The app on a real multi-node Ray cluster: replicas on two worker nodes, a rolling update under
load, and a worker node killed (raylet and workers) while streams run on it."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections import Counter
from typing import Any

import httpx
import pytest

from tests.support.local_ray import LOOPBACK, loopback_faults
from tests.support.multinode import MultiNodeCluster, stream_events

MESSAGES = [{"role": "user", "content": "Hello"}]
NAMES = [f"a{i:02d}" for i in range(8)] + ["tiny-base"]


def replica_nodes(multinode: MultiNodeCluster) -> dict[str, str]:
    """Running model replica id -> node name."""
    names = {nid: name for name, nid in multinode.node_ids().items()}
    return {
        r["replica_id"]: names.get(r["node_id"], "?")
        for r in multinode.replicas()
        if r["state"] == "RUNNING"
    }


async def chat(http: httpx.AsyncClient, model: str, max_tokens: int = 4) -> dict:
    body = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "ignore_eos": True}
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


async def stream(
    http: httpx.AsyncClient,
    model: str,
    max_tokens: int,
    started: asyncio.Event,
    first: list[dict[str, Any]] | None = None,
):
    """One streamed chat: (status, events, saw [DONE]); `started` set at the first event, which
    is also appended to `first` when given."""
    body = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "ignore_eos": True}
    body["stream"] = True
    lines: list[str] = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            return resp.status_code, [{"error": (await resp.aread()).decode()}], False
        async for line in resp.aiter_lines():
            lines.append(line)
            if line.startswith("data: ") and not started.is_set():
                if first is not None:
                    first.append(json.loads(line[6:]))
                started.set()
    return 200, stream_events(lines), "data: [DONE]" in lines


def wait_replicas(multinode: MultiNodeCluster, want: dict[str, int], timeout_s: float = 180):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = multinode.running_by_node()
        if got == want:
            return got
        time.sleep(1)
    raise AssertionError(f"replicas per node {multinode.running_by_node()}, wanted {want}")


def test_every_node_and_the_driver_are_on_loopback(multinode):
    """The cluster's address, the one this driver dialled and every node's are 127.0.0.1, not
    this machine's interface address (the GCS listens on loopback only: a driver sent to the
    interface retried there forever)."""
    import ray

    assert multinode.gcs_address.rpartition(":")[0] == LOOPBACK
    assert ray.get_runtime_context().gcs_address == multinode.gcs_address
    alive = [n for n in ray.nodes() if n["Alive"]]
    assert {n["NodeID"] for n in alive} >= set(multinode.node_ids().values())
    assert {n["NodeManagerAddress"] for n in alive} == {LOOPBACK}
    assert loopback_faults(multinode.gcs_address) == []


async def test_replicas_on_two_nodes_serve_requests_across_them(multinode, deployed):
    assert multinode.running_by_node() == {"node_a": 1, "node_b": 1}
    assert multinode.running_by_node("Router") == {"head": 2}
    nodes = replica_nodes(multinode)
    async with httpx.AsyncClient(base_url=multinode.url, timeout=120) as http:
        served = [await chat(http, name) for name in NAMES * 2]
    by_node = {nodes[s["molora"]["replica"]] for s in served}
    assert by_node == {"node_a", "node_b"}
    # Each node fetched from the shared store into its own disk cache.
    for name in ("node_a", "node_b"):
        cache = multinode.work / f"home-{name}" / "store-cache"
        assert cache.is_dir() and any(cache.rglob("adapter_model.safetensors")), name


async def test_rolling_update_under_load_fails_no_request(multinode, deployed):
    before = set(replica_nodes(multinode))
    app = copy.deepcopy(deployed["app"])
    app["args"]["engine"]["max_num_seqs"] = 6
    app["args"]["server"]["default_max_tokens"] = 24
    for d in app["deployments"]:
        if d["name"] == "ModelReplica":
            d["max_ongoing_requests"] = 7
    results: list[tuple[int, str]] = []
    stop = asyncio.Event()

    async def client(i: int, http: httpx.AsyncClient) -> None:
        n = 0
        while not stop.is_set():
            body = {"model": NAMES[(i + n) % len(NAMES)], "messages": MESSAGES, "max_tokens": 8}
            try:
                resp = await http.post("/v1/chat/completions", json=body)
                results.append((resp.status_code, "" if resp.is_success else resp.text[:200]))
            except httpx.HTTPError as exc:
                results.append((-1, repr(exc)))
            n += 1

    async with httpx.AsyncClient(base_url=multinode.url, timeout=120) as http:
        load = [asyncio.create_task(client(i, http)) for i in range(4)]
        await asyncio.sleep(2)
        await asyncio.to_thread(multinode.deploy, app)
        after = set(replica_nodes(multinode))
        await asyncio.sleep(2)
        stop.set()
        await asyncio.gather(*load)
    failed = [r for r in results if r[0] != 200]
    assert len(results) > 20 and not failed, (len(results), failed[:5])
    assert not (before & after), "every model replica was replaced"
    assert multinode.running_by_node() == {"node_a": 1, "node_b": 1}
    deployed["app"] = app


async def test_node_loss_mid_stream_ends_streams_with_errors_and_capacity_returns(
    multinode, deployed
):
    nodes = replica_nodes(multinode)
    async with httpx.AsyncClient(base_url=multinode.url, timeout=120) as http:
        events = [asyncio.Event() for _ in range(16)]
        firsts: list[dict[str, Any]] = []
        tasks = [
            asyncio.create_task(stream(http, NAMES[i % len(NAMES)], 440, events[i], firsts))
            for i in range(16)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
        # Placement decides where the streams run: the node holding the most of them is lost.
        on = Counter(nodes[f["molora"]["replica"]] for f in firsts)
        lost = on.most_common(1)[0][0]
        kept = next(n for n in ("node_a", "node_b") if n != lost)
        killed_at = time.monotonic()
        await asyncio.to_thread(multinode.kill_worker, lost)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        ended_s = time.monotonic() - killed_at
        affected = 0
        for status, evs, done in outcomes:
            assert status == 200 and done, (status, evs[-1:])
            replica = evs[0]["molora"]["replica"]
            if "error" in evs[-1]:
                affected += 1
                assert nodes[replica] == lost
                assert evs[-1]["error"]["code"] == 503, evs[-1]
            else:
                assert evs[-1]["choices"][0]["finish_reason"] == "length", evs[-1]
                tokens = sum(1 for e in evs if e.get("choices") and e["choices"][0]["delta"])
                assert tokens >= 400, tokens
        assert affected > 0, "no stream was on the lost node"
        assert ended_s < 60, ended_s
        # New requests succeed on the survivors at once.
        served = [await chat(http, name) for name in NAMES]
        assert {nodes.get(s["molora"]["replica"]) for s in served} == {kept}
    multinode.add_worker(lost)  # Ray starts nodes from the main thread only
    await asyncio.to_thread(wait_replicas, multinode, {"node_a": 1, "node_b": 1})
    async with httpx.AsyncClient(base_url=multinode.url, timeout=120) as http:
        served = [await chat(http, name) for name in NAMES * 2]
    now = replica_nodes(multinode)
    assert {now[s["molora"]["replica"]] for s in served} == {"node_a", "node_b"}


async def test_gcs_killed_serve_keeps_answering_and_the_head_recovers(multinode, deployed):
    if multinode.redis is None:
        pytest.skip("no redis-server: GCS fault tolerance needs an external Redis")
    import ray

    async with httpx.AsyncClient(base_url=multinode.url, timeout=60) as http:
        multinode.kill_gcs()
        try:
            started = asyncio.Event()
            streamed = asyncio.create_task(stream(http, "a01", 200, started))
            served = [await chat(http, name) for name in NAMES]
            assert all(s["choices"][0]["finish_reason"] == "length" for s in served)
            status, events, done = await streamed
            assert status == 200 and done and "error" not in events[-1], events[-1:]
        finally:
            multinode.restart_gcs()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the head serves its API again, nodes intact
            try:
                alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
                break
            except Exception:
                await asyncio.sleep(1)
        assert set(multinode.node_ids().values()) <= alive
        assert multinode.running_by_node() == {"node_a": 1, "node_b": 1}
        served = [await chat(http, name) for name in NAMES]
        assert len(served) == len(NAMES)
