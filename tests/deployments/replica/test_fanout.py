"""The replica's fanout on a real engine: each step's batch reaches every request in one pass,
the head (info, first output) goes back on the request's call and the rest through the router's
channel outbox, where one drain carries several requests' items; n > 1 choices keep their index
and one usage counts them all; a request the engine refuses gets its own error item."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from deployments.protocol.errors import error_item
from deployments.protocol.wire import InfoItem, decode, encode
from deployments.replica.choices import choice_requests
from deployments.replica.fanout import Fanout, Job
from deployments.replica.stream_channel import Outbox
from molora_runtime.config import EngineConfig
from molora_runtime.engine.async_engine import AsyncEngine
from molora_runtime.engine.types import GenerationRequest, SamplingParams
from molora_runtime.lora.source import DirectorySource

TOKENS = 12


def _request(rid: str, **extra: Any) -> GenerationRequest:
    sampling = SamplingParams(max_tokens=TOKENS, ignore_eos=True, temperature=0.8, seed=3)
    return GenerationRequest(request_id=rid, prompt="tell me", sampling=sampling, **extra)


async def _head(job: Job) -> list[dict[str, Any]]:
    out = []
    while (item := await asyncio.wait_for(job.head.get(), 60)) is not None:
        out.append(item)
    return out


async def test_fanout_routes_step_batches(tiny_assets: dict[str, Path]) -> None:
    config = EngineConfig(model=str(tiny_assets["model"]), device="cpu", max_num_seqs=8)
    engine = AsyncEngine(config, DirectorySource({}))
    try:
        fanout = Fanout(engine.tokenizer)
        engine.add_sink(fanout)
        box = Outbox()
        jobs = {}
        for rid, n in (("two", 2), ("one", 1)):
            reqs = choice_requests(_request(rid), n)
            info = encode(InfoItem(replica="r", hot_set_hit=True, channel=True))
            job = jobs[rid] = Job(rid, n, info, box)
            fanout.add(job, [r.request_id for r in reqs])
            await engine.submit(reqs)
        heads = {rid: await _head(job) for rid, job in jobs.items()}
        batches = []
        while not all(job.ended for job in jobs.values()) or box._items:
            batch = await box.drain(30)
            assert batch is not None, "the outbox went quiet before every request ended"
            batches.append(batch)
        for rid, head in heads.items():
            assert [i["type"] for i in head] == ["info", "delta"], rid
            items = [item for key, item in (p for b in batches for p in b) if key == rid]
            for item in items:
                decode(item)  # every wire dict is a valid typed item
            assert items[-1]["type"] == "usage"
            deltas = [head[1], *items[:-1]]
            n = 2 if rid == "two" else 1
            assert {d["index"] for d in deltas} == set(range(n))
            assert sum(len(d["token_ids"]) for d in deltas) == n * TOKENS
            assert items[-1]["completion_tokens"] == n * TOKENS
            assert sum(d["finish_reason"] == "length" for d in deltas) == n
        assert any(len({key for key, _ in b}) == 2 for b in batches)  # both in one message

        bad = Job("bad", 1, encode(InfoItem(replica="r", hot_set_hit=False)), None)
        too_long = SamplingParams(max_tokens=10**9, clamp_to_context=False)
        req = GenerationRequest(request_id="bad", prompt="tell me", sampling=too_long)
        fanout.add(bad, ["bad"])
        try:
            await engine.submit([req])
        except Exception as exc:  # the replica turns a refusal into the call's error item
            bad.fail(error_item(exc))
        (item,) = await _head(bad)
        assert item["type"] == "error" and item["status"] == 400
    finally:
        await engine.shutdown()
