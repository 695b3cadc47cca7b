"""The test harnesses keep Ray on 127.0.0.1 whatever this machine's interfaces: a process that
imported Ray before the harness set Ray's loopback switch (`benchmarks.cluster` imports Serve
first) dialled the loopback-only GCS at the interface address and hung (issue 55)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.local_ray import LOOPBACK, LOOPBACK_SWITCH

ROOT = Path(__file__).resolve().parents[1]
INTERFACE = "192.0.2.7"  # an interface address (TEST-NET), whatever this machine has

# Ray imported first, with the switch unset, and an interface Ray would prefer to loopback.
PROBE = f"""
import json
import ray
from ray._private import services

services.node_ip_address_from_perspective = lambda address=None: {INTERFACE!r}
before = services.canonicalize_bootstrap_address("{LOOPBACK}:6379")

from tests.support.local_ray import pin_loopback

pin_loopback()
print(json.dumps({{
    "before": before,
    "driver_dials": services.canonicalize_bootstrap_address("{LOOPBACK}:6379"),
    "node_ip": services.resolve_ip_for_localhost("{LOOPBACK}"),
    "switch": __import__("os").environ.get("{LOOPBACK_SWITCH}"),
}}))
"""


def test_the_harness_keeps_loopback_when_ray_was_imported_first() -> None:
    env = {k: v for k, v in os.environ.items() if k != LOOPBACK_SWITCH}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # The fault, reproduced: Ray's default sends a loopback address to the interface.
    assert got["before"] == f"{INTERFACE}:6379"
    # After the harness's pin: the driver dials, and a node binds, loopback itself; the
    # processes it starts inherit the switch.
    assert got["driver_dials"] == f"{LOOPBACK}:6379"
    assert got["node_ip"] == LOOPBACK
    assert got["switch"] == "0"


def test_both_harnesses_pin_loopback_before_handing_ray_an_address() -> None:
    """The pin comes before the first node starts; the multi-node driver names loopback too and
    the start checks the result (`loopback_faults`)."""
    import inspect

    from tests.support import local_ray, multinode

    body = inspect.getsource(multinode.MultiNodeCluster.start)
    assert body.index("pin_loopback()") < body.index("Cluster(") < body.index("ray.init(")
    assert "_node_ip_address=LOOPBACK" in body and "loopback_faults(" in body
    body = inspect.getsource(local_ray.start_local_cluster)
    assert body.index("pin_loopback()") < body.index("_start_once(")
    assert "loopback_faults(" in inspect.getsource(local_ray._start_once)
