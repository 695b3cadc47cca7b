"""The engine's process takes SCHED_OTHER back from a cluster started under SCHED_BATCH (`make
serve`), for every thread it has and those it starts later; any other policy is left alone.
Real processes under `chrt`, their policies read back from the kernel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getscheduler") or shutil.which("chrt") is None,
    reason="needs Linux scheduling policies and chrt",
)

PROBE = """
import json, os, threading
from deployments.replica.scheduling import compute_at_normal_policy, threads_of
started = threading.Event(); stop = threading.Event()
def idle():
    started.set(); stop.wait()
before = threading.Thread(target=idle); before.start(); started.wait()
moved = compute_at_normal_policy()
later = threading.Thread(target=stop.wait); later.start()
policies = sorted({os.sched_getscheduler(t) for t in threads_of(os.getpid())})
stop.set(); before.join(); later.join()
print(json.dumps({"moved": moved, "policies": policies}))
"""


def _probe(*chrt: str) -> dict:
    out = subprocess.run(
        [*chrt, sys.executable, "-c", PROBE], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_a_batch_started_engine_moves_every_thread_back_to_normal() -> None:
    got = _probe("chrt", "--batch", "0")
    assert got["moved"] >= 2  # the main thread and the one started before
    assert got["policies"] == [os.SCHED_OTHER]  # the thread started after inherits it


def test_a_normal_process_is_left_alone() -> None:
    assert _probe() == {"moved": 0, "policies": [os.SCHED_OTHER]}


def test_an_operator_chosen_idle_policy_is_left_alone() -> None:
    assert _probe("chrt", "--idle", "0") == {"moved": 0, "policies": [os.SCHED_IDLE]}
