"""The catalog epoch's wait-for-every-router logic, run on its own event loop: a bump returns
once every live router came back with the new epoch, names the ones that did not within the
timeout, and does not wait on a router it has not heard from for `ALIVE_S`."""

from __future__ import annotations

import asyncio
import time

from deployments.catalog import epoch as epoch_mod

Epoch = epoch_mod.CatalogEpoch.func_or_class


async def _router(epoch, name: str, reloads: list[str], stop: asyncio.Event) -> None:
    """A router's watch loop (as deployments/catalog/watch.py runs it), reloading instantly."""
    known = -1
    while not stop.is_set():
        got = await epoch.watch(name, known)
        if got != known:
            reloads.append(f"{name}:{got}")
            known = got


def test_bump_waits_for_every_live_router() -> None:
    async def scenario() -> None:
        epoch = Epoch()
        stop, reloads = asyncio.Event(), []
        tasks = [asyncio.create_task(_router(epoch, r, reloads, stop)) for r in ("a", "b")]
        await asyncio.sleep(0.05)
        result = await epoch.bump(5.0)
        assert result == {"epoch": 1, "routers": 2, "unconfirmed": []}
        assert {"a:1", "b:1"} <= set(reloads)
        # A router that stopped answering is named after the timeout; the epoch still moves.
        tasks[1].cancel()
        await asyncio.sleep(0.05)
        epoch._seen["b"] = (1, time.monotonic())
        started = time.monotonic()
        result = await epoch.bump(0.3)
        assert result["epoch"] == 2 and result["unconfirmed"] == ["b"]
        assert time.monotonic() - started >= 0.3
        # ... and once unheard of for ALIVE_S it is no longer waited on.
        epoch._seen["b"] = (1, time.monotonic() - epoch_mod.ALIVE_S - 1)
        result = await epoch.bump(5.0)
        assert result == {"epoch": 3, "routers": 1, "unconfirmed": []}
        stop.set()
        await epoch.bump(0.1)  # wakes the last watcher so it sees `stop`
        await asyncio.wait_for(tasks[0], 5)

    asyncio.run(scenario())
