"""CPU scheduling policy on a small box: the engine pre-empts, the cluster around it does not.

A CPU engine computes on an OpenMP team that owns every core it was given, and each thread of the
team waits at the next barrier for the slowest. Linux lets a task that wakes up pre-empt a running
one at once (wakeup pre-emption), and a Ray Serve cluster wakes ~2,000 times a second (every
worker's 10 ms signal check, the proxy and router per streamed token, GCS and raylet polls): each
wake-up stops one team thread mid-GEMM and the whole team with it. Tasks under `SCHED_BATCH` do
not pre-empt on wake-up; they run at the next scheduler tick or when a core is free, with the same
fair share of CPU as before. So a cluster started under `SCHED_BATCH` (`chrt --batch 0 make
serve`) has the model replica take `SCHED_OTHER` back for itself (its step and OpenMP threads,
and every thread it starts later, which inherit it). Opt-in, because its gain is not established
(the measurements are in benchmarks/HISTORY.md).

Standard library only (no Ray): Linux's per-thread policy, set through `os.sched_setscheduler`.
Moving between `SCHED_BATCH` and `SCHED_OTHER` needs no privilege.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger("ray.serve")


def threads_of(pid: int) -> list[int]:
    """Thread ids of process `pid` (empty where /proc is not there)."""
    try:
        return [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return []


def set_policy(pid: int, policy: int) -> int:
    """Put every thread of `pid` under `policy` (SCHED_OTHER or SCHED_BATCH); how many moved.
    A thread that exits meanwhile is skipped."""
    moved = 0
    for tid in threads_of(pid):
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
            moved += 1
        except ProcessLookupError:
            continue
    return moved


def compute_at_normal_policy() -> int:
    """For the process that runs an engine: if it inherited `SCHED_BATCH` (the cluster was
    started under it), move all its threads back to `SCHED_OTHER`; any other policy an operator
    chose is left alone. Returns the number of threads moved."""
    if not hasattr(os, "sched_getscheduler"):  # not Linux
        return 0
    try:
        if os.sched_getscheduler(0) != os.SCHED_BATCH:
            return 0
        moved = set_policy(os.getpid(), os.SCHED_OTHER)
    except OSError as exc:  # a sandbox that forbids it: serve anyway, say so
        logger.warning("could not take SCHED_OTHER back for the engine: %s", exc)
        return 0
    logger.info("engine threads back on SCHED_OTHER (%d), the cluster stays SCHED_BATCH", moved)
    return moved
