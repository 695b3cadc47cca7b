"""The chaos benchmark's faults, injected while the streams and the catalog driver run:
SIGKILL of a model replica and of a router, SIGSTOP of a model replica (SIGCONT after), SeaweedFS
killed and restarted on its ports (with a cold adapter asked for while it is down), and the Ray
head's GCS killed and restarted (GCS fault tolerance on Redis; only where the cluster has it).

Each fault reports when it was injected, and its recovery: the seconds from injection until the
deployment has its replicas RUNNING again and a probe request completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from typing import Any

import httpx

from benchmarks.chaos_setup import Bench, actor_pids
from benchmarks.chaos_streams import run_stream
from tests.support.seaweedfs import weed_binary


async def _running(bench: Bench, deployment: str) -> int:
    def count() -> int:
        return sum(r["state"] == "RUNNING" for r in bench.mn.replicas(deployment))

    try:
        return await asyncio.wait_for(asyncio.to_thread(count), 30)
    except Exception:
        return -1


async def _probe_ok(bench: Bench, model: str) -> bool:
    async with httpx.AsyncClient(base_url=bench.url, timeout=30) as http:
        r = await run_stream(http, "probe", bench.keys["globex"], model, 0, 4, read_timeout_s=30)
    return r.end == "complete"


async def _recovered(
    bench: Bench, t0: float, deployment: str, want: int, model: str, limit_s: float = 240
) -> float | None:
    """Seconds from `t0` until `deployment` has `want` RUNNING replicas and 3 probes in a row
    complete; None when that did not happen within `limit_s`."""
    streak = 0
    while time.monotonic() - t0 < limit_s:
        if await _running(bench, deployment) >= want:
            streak = streak + 1 if await _probe_ok(bench, model) else 0
            if streak >= 3:
                return round(time.monotonic() - t0, 2)
        else:
            streak = 0
        await asyncio.sleep(0.5)
    return None


async def kill_actor(bench: Bench, deployment: str, model: str) -> dict[str, Any]:
    pids = actor_pids(bench.mn, deployment)
    if not pids:
        return {"fault": f"SIGKILL {deployment}", "error": "no process found"}
    pid = pids[0]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    await asyncio.sleep(1.0)  # the controller notices a dead actor within its health checks
    return {
        "fault": f"SIGKILL {deployment}",
        "pid": pid,
        "t": t0,
        "recovery_s": await _recovered(bench, t0, deployment, 2, model),
    }


async def stall_replica(bench: Bench, seconds: float, model: str) -> dict[str, Any]:
    pids = actor_pids(bench.mn, "ModelReplica")
    if not pids:
        return {"fault": "SIGSTOP ModelReplica", "error": "no process found"}
    pid = pids[-1]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    t_cont = time.monotonic()
    rec = await _recovered(bench, t_cont, "ModelReplica", 2, model)
    return {
        "fault": f"SIGSTOP ModelReplica {seconds:g} s",
        "pid": pid,
        "t": t0,
        "recovery_s": None if rec is None else round(rec + seconds, 2),
        "recovery_after_sigcont_s": rec,
        "replica_pids_after": actor_pids(bench.mn, "ModelReplica"),
    }


def _restart_weed(bench: Bench) -> None:
    """SeaweedFS again on the same ports and data folder (the app's endpoint is fixed)."""
    s = bench.mn.seaweed
    assert s is not None
    data, config = s.workdir / "data", s.workdir / "s3.json"
    args = [
        weed_binary(),
        "mini",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={data}",
        f"-s3.config={config}",
        "-admin.ui=false",
        "-webdav=false",
        *(f"-{flag}={port}" for flag, port in s.ports.items()),
    ]
    with (s.workdir / "weed-restart.log").open("ab") as log:
        s.proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, cwd=s.workdir, start_new_session=True
        )
    s._wait_ready(120)


async def store_outage(
    bench: Bench, seconds: float, resident: str, churn_pause: asyncio.Event, cold: str
) -> dict[str, Any]:
    """SIGKILL SeaweedFS, ask for a cold adapter and a resident one while it is down, restart
    it on its ports after `seconds`; recovery: until a runtime load (a store write) succeeds."""
    s = bench.mn.seaweed
    assert s is not None
    churn_pause.set()  # the catalog driver stops: its changes would only fail with 503
    await asyncio.sleep(1.0)
    t0 = time.monotonic()
    s.kill()
    out: dict[str, Any] = {"fault": "SIGKILL SeaweedFS", "t": t0}
    await asyncio.sleep(1.0)
    async with httpx.AsyncClient(base_url=bench.url, timeout=120) as http:
        t = time.monotonic()
        cold_r = await run_stream(http, "cold", bench.keys["globex"], cold, 0, 4, read_timeout_s=60)
        out["cold_adapter"] = {
            "status": cold_r.status,
            "retry_after": cold_r.retry_after,
            "end": cold_r.end,
            "seconds": round(time.monotonic() - t, 2),
            "error": (cold_r.error or "")[:200],
        }
        resident_ok = 0
        tries = 0
        while time.monotonic() - t0 < seconds:
            r = await run_stream(
                http, "resident", bench.keys["globex"], resident, 1, 8, read_timeout_s=30
            )
            tries += 1
            resident_ok += r.end == "complete"
            await asyncio.sleep(0.3)
        out["resident_requests_during_outage"] = tries
        out["resident_completed_during_outage"] = resident_ok
        t_restart = time.monotonic()
        await asyncio.to_thread(_restart_weed, bench)
        out["restart_s"] = round(time.monotonic() - t_restart, 2)
        headers = bench.headers("admin")
        rec = None
        while time.monotonic() - t_restart < 180:
            resp = await http.post(
                "/v1/load_lora_adapter",
                headers=headers,
                json={"lora_name": "after-outage", "lora_path": "w00", "load_inplace": True},
            )
            if resp.status_code == 200:
                rec = round(time.monotonic() - t0, 2)
                break
            await asyncio.sleep(0.5)
        out["recovery_s"] = rec
        t = time.monotonic()
        after = await run_stream(http, "cold", bench.keys["globex"], cold, 0, 4, read_timeout_s=60)
        out["cold_after_restart"] = {
            "end": after.end,
            "status": after.status,
            "seconds": round(time.monotonic() - t, 2),
        }
    churn_pause.clear()
    return out


async def gcs_restart(bench: Bench, seconds: float, model: str) -> dict[str, Any]:
    if bench.mn.redis is None:
        return {"fault": "SIGKILL GCS", "error": "the cluster runs without GCS fault tolerance"}
    t0 = time.monotonic()
    await asyncio.to_thread(bench.mn.kill_gcs)
    await asyncio.sleep(seconds)
    await asyncio.to_thread(bench.mn.restart_gcs)
    rec = await _recovered(bench, t0, "ModelReplica", 2, model)
    return {"fault": f"SIGKILL GCS (Redis FT), down {seconds:g} s", "t": t0, "recovery_s": rec}
