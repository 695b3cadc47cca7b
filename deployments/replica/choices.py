"""n > 1 on a replica: one engine request per choice, merged into one stream of (index, output).

Choice i runs as request `<id>.<i>` with seed `seed + i` (mod 2**64; no seed: each draws its
own), and every choice after the first names the first as `prefill_from`, so the engine prefills
the prompt once and forks its KV row into the others (when they are admitted together). All
choices run on one replica, so they share that prefill and the adapters' hot-set slots.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from molora_runtime.engine.types import MAX_SEED, GenerationOutput, GenerationRequest, merge_outputs

_DONE = object()


def choice_requests(req: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The engine requests of `n` choices of `req` (n == 1: `req` itself)."""
    if n == 1:
        return [req]
    first = f"{req.request_id}.0"
    out = []
    for i in range(n):
        seed = req.sampling.seed
        sampling = req.sampling.model_copy(
            update={"seed": None if seed is None else (seed + i) % (MAX_SEED + 1)}
        )
        out.append(
            req.model_copy(
                update={
                    "request_id": f"{req.request_id}.{i}",
                    "sampling": sampling,
                    "prefill_from": first if i else None,
                }
            )
        )
    return out


async def merged_choices(
    engine: Any, reqs: list[GenerationRequest]
) -> AsyncIterator[tuple[int, GenerationOutput]]:
    """Every choice's outputs as they come (each item merges what queued up for one choice);
    the first exception of any choice is raised, and closing the iterator aborts them all."""
    if len(reqs) == 1:
        async for outs in engine.stream(reqs[0]):
            yield 0, merge_outputs(outs)
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(i: int, req: GenerationRequest) -> None:
        try:
            async for outs in engine.stream(req):
                await queue.put((i, merge_outputs(outs)))
        except BaseException as exc:  # handed to the consumer, which raises it
            await queue.put(exc)
            return
        await queue.put(_DONE)

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is _DONE:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
