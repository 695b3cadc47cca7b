"""The catalog epoch's wait-for-every-router logic, run on its own event loop: a bump carries the
names a change touched to every watcher, returns once every live router came back with the new
epoch, stops waiting for a router that went silent (and forgets it once Ray says it is dead),
still waits for a live router that is only slow, and names every router that did not confirm."""

from __future__ import annotations

import asyncio
import time

import pytest

from deployments.catalog import epoch as epoch_mod

Epoch = epoch_mod.CatalogEpoch.func_or_class
X = {"kind": "adapter", "name": "acme~x", "versions": ["v2"]}
Y = {"kind": "composition", "name": "c", "versions": []}


@pytest.fixture(autouse=True)
def short_windows(monkeypatch) -> None:
    """Liveness windows in tenths of a second, so a dead router costs the test little."""
    monkeypatch.setattr(epoch_mod, "WATCH_S", 0.1)
    monkeypatch.setattr(epoch_mod, "DEAD_CHECK_S", 0.2)
    monkeypatch.setattr(epoch_mod, "LIVE_S", 0.4)
    monkeypatch.setattr(epoch_mod, "POLL_S", 0.02)
    monkeypatch.setattr(epoch_mod, "REAP_S", 0.05)


def _epoch() -> Epoch:
    epoch = Epoch()
    epoch.started -= 10  # past the restart window: the routers below are all there is
    epoch.is_dead = lambda name, namespace: None  # Ray cannot be asked
    return epoch


async def _router(
    epoch, name: str, applied: list, stop: asyncio.Event, apply_s: float = 0.0
) -> None:
    """A router's watch loop (as deployments/catalog/watch.py runs it): apply what each reply
    says (taking `apply_s`), then call again with the epoch reached."""
    known, instance = -1, ""
    while not stop.is_set():
        reply = epoch_mod.WatchReply.model_validate(
            await epoch.watch(name, known, instance, f"actor-{name}", "serve")
        )
        if reply.epoch != known or reply.instance != instance:
            await asyncio.sleep(apply_s)
            full = reply.instance != instance or reply.changes is None
            applied.append((name, reply.epoch, "full" if full else [c.name for c in reply.changes]))
        known, instance = reply.epoch, reply.instance


async def _stop(epoch, stop: asyncio.Event, tasks: list[asyncio.Task]) -> None:
    stop.set()
    await epoch.bump([], 0.05)  # wakes the watchers so they see `stop`
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if epoch._reaper is not None:
        epoch._reaper.cancel()


async def test_a_bump_carries_its_names_and_waits_for_every_live_router() -> None:
    epoch, stop, applied = _epoch(), asyncio.Event(), []
    tasks = [asyncio.create_task(_router(epoch, r, applied, stop)) for r in ("a", "b")]
    await asyncio.sleep(0.05)
    assert sorted(applied) == [("a", 0, "full"), ("b", 0, "full")]  # a new router loads all
    result = await epoch.bump([X], 5.0)
    assert result["epoch"] == 1 and result["routers"] == 2 and result["unconfirmed"] == []
    # Returned only once both had applied it, each re-reading just the name it carried.
    assert {("a", 1, ("acme~x",)), ("b", 1, ("acme~x",))} <= set(map(_hashable, applied))
    # A router that fell behind gets every name since its epoch at once.
    assert epoch._reply(0).changes == [epoch_mod.ChangedName.model_validate(X)]
    await epoch.bump([Y], 5.0)
    assert [c.name for c in epoch._reply(0).changes] == ["acme~x", "c"]
    await _stop(epoch, stop, tasks)


async def test_a_dead_router_is_not_waited_for_and_forgotten_once_ray_says_so() -> None:
    epoch, stop, applied = _epoch(), asyncio.Event(), []
    tasks = [asyncio.create_task(_router(epoch, r, applied, stop)) for r in ("a", "b")]
    await asyncio.sleep(0.05)
    tasks[1].cancel()  # router b is killed
    await asyncio.sleep(0.01)
    started = time.monotonic()
    result = await epoch.bump([X], 10.0)
    waited = time.monotonic() - started
    # Not the 10 s timeout: b stopped being waited for once silent for LIVE_S ...
    assert waited < epoch_mod.LIVE_S + 0.5, waited
    # ... but the answer names it: a stalled router may still serve the old catalog.
    assert result["unconfirmed"] == ["b"] and result["routers"] == 1
    # Ray reports b's actor dead: forgotten, and the next change is confirmed by all.
    epoch.is_dead = lambda name, namespace: name in ("actor-b", "actor-c")
    for _ in range(40):
        await asyncio.sleep(0.05)
        if "b" not in epoch._seen:
            break
    result = await epoch.bump([Y], 10.0)
    assert result["unconfirmed"] == [] and result["routers"] == 1
    # A router killed where Ray can tell: dropped after DEAD_CHECK_S, before LIVE_S, unnamed.
    tasks.append(asyncio.create_task(_router(epoch, "c", applied, stop)))
    await asyncio.sleep(0.05)
    tasks[-1].cancel()
    await asyncio.sleep(0.01)
    started = time.monotonic()
    result = await epoch.bump([X], 10.0)
    assert time.monotonic() - started < epoch_mod.LIVE_S, time.monotonic() - started
    assert result["unconfirmed"] == [] and result["routers"] == 1
    await _stop(epoch, stop, tasks[:1])


async def test_a_live_router_that_is_slow_is_waited_for() -> None:
    epoch, stop, applied = _epoch(), asyncio.Event(), []
    tasks = [
        asyncio.create_task(_router(epoch, "fast", applied, stop)),
        asyncio.create_task(_router(epoch, "slow", applied, stop, apply_s=0.25)),
    ]
    await asyncio.sleep(0.4)
    started = time.monotonic()
    result = await epoch.bump([X], 5.0)
    # Slower than LIVE_S's poll but within it: waited for, and confirmed.
    assert time.monotonic() - started >= 0.2
    assert result["unconfirmed"] == [] and ("slow", 1, ("acme~x",)) in map(_hashable, applied)
    # Slower than the bump's timeout: the answer names it, not waited for past the timeout.
    tasks[1].cancel()
    tasks[1] = asyncio.create_task(_router(epoch, "slow", applied, stop, apply_s=1.0))
    await asyncio.sleep(1.2)  # its first full load, then it watches at epoch 1
    result = await epoch.bump([Y], 0.15)
    assert result["unconfirmed"] == ["slow"]
    await _stop(epoch, stop, tasks)


async def test_a_restarted_epoch_makes_every_router_reload_in_full() -> None:
    old, new = _epoch(), _epoch()
    first = epoch_mod.WatchReply.model_validate(await old.watch("a", -1, ""))
    await old.bump([X], 0.01)
    # The router comes back with the old instance's epoch: the new one cannot say what changed.
    reply = epoch_mod.WatchReply.model_validate(await new.watch("a", 1, first.instance))
    assert reply.instance == new.instance and reply.changes is None
    # A router further behind than the log reaches reloads in full too.
    old._log.clear()
    assert old._reply(0).changes is None
    # A bump on an epoch younger than LIVE_S waits for routers to call in, and says so if not.
    fresh = Epoch()
    result = await fresh.bump([X], 0.05)
    assert result["unconfirmed"] == ["routers-not-yet-heard-from"]


def _hashable(entry: tuple) -> tuple:
    name, epoch, what = entry
    return name, epoch, what if isinstance(what, str) else tuple(what)


async def test_one_dead_answer_from_ray_is_not_enough_to_forget_a_router() -> None:
    """A router forgotten while alive would see changes confirmed without it: two lookups in a
    row must both say its actor is gone."""
    epoch = _epoch()
    silent = time.monotonic() - 10 * epoch_mod.DEAD_CHECK_S
    epoch._seen["x"] = epoch_mod._Seen(0, silent, "actor-x", "serve")
    answers = iter([True, None, True, True])
    epoch.is_dead = lambda name, namespace: next(answers)
    assert await epoch.reap() == []  # dead once
    assert await epoch.reap() == []  # not known: the count starts over
    assert await epoch.reap() == []
    assert await epoch.reap() == ["x"] and "x" not in epoch._seen
