"""A throwaway single-machine Ray cluster with Serve on loopback, for tests and benchmarks.

Ports: Ray's own servers (GCS, raylet, agents, the Prometheus metrics exporter) pick their ports
themselves and report them back, so no number is handed to Ray; Serve's HTTP port is drawn by
`tests.support.ports` (outside the ephemeral range, checked bindable) and a start that fails (a
port lost to a race, or anything else) is retried once, whole, on fresh ports. A start that fails
twice raises `ClusterStartError` with the tail of the raylet, dashboard-agent, GCS and proxy logs.

Direct ingress (`direct_ingress=True`, the shipped mode): the router replicas serve HTTP
themselves from a pool of `ROUTER_POOL` ports right above the proxy's, drawn with it per run (a
fixed 8000 would collide between parallel sessions); Serve's proxy serves the same app on
`url`, and `router_url` finds the port a router answers on. A pool of several ports lets a test
deploy more than one router, and a port a stopped router's connections still hold (TIME_WAIT) is
skipped by Serve for the next one.

Loopback: every node, driver and client is on 127.0.0.1 (`LOOPBACK`), whatever this machine's
interfaces; `pin_loopback` keeps Ray from rewriting that address, `loopback_faults` checks it.

Auth: Ray token authentication stays on (Ray 2.60's default for a new local cluster). Without it
every Serve replica's gRPC server, which listens on all interfaces and unpickles requests, would
take unauthenticated calls. A `disabled` RAY_AUTH_MODE in the environment is overridden here.

Ray 2.60's dashboard agent always tries its HTTP port 52365 (ray.init cannot change it); when
another cluster on the machine holds it, the agent logs the bind error and runs on without its
HTTP service, which nothing here needs (the metrics exporter is separate and picks its own port).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deployments.replica.serve_env import (
    ENABLE,
    LOOPBACK,
    PROXY_ENV_VARS,
    SERVE_ENV_VARS,
    direct_ingress_env,
)
from tests.support import ports

# Ray's switch for where a loopback address leads (named for Windows and macOS, read on Linux too).
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

# The shipped Serve settings with direct ingress off: such a cluster serves through Serve's proxy
# alone (the multi-node harness; `start_local_cluster(direct_ingress=False)`).
HARNESS_ENV_VARS: dict[str, str] = {**SERVE_ENV_VARS, ENABLE: "0"}
ROUTER_POOL = 8  # ports a node's routers may take, right above the proxy's
# Nothing has to deregister a loopback router: undeploys between test modules need no drain.
HARNESS_DRAINING_S = 0.0


def harness_env(router_port: int | None) -> dict[str, str]:
    """What the cluster's processes inherit: the shipped Serve settings, with direct ingress on
    the pool from `router_port` (None: off, Serve's proxy alone)."""
    if router_port is None:
        return dict(HARNESS_ENV_VARS)
    direct = direct_ingress_env(router_port, HARNESS_DRAINING_S, pool=ROUTER_POOL)
    return {**SERVE_ENV_VARS, **direct}


# Newest first in the report: the logs that say why a local cluster did not come up.
LOG_PATTERNS = (
    "raylet.out", "raylet.err", "dashboard_agent.log", "dashboard_agent.err", "gcs_server.out",
    "gcs_server.err", "serve/proxy_*.log", "serve/controller_*.log",
)  # fmt: skip


class ClusterStartError(RuntimeError):
    """The local Ray cluster (or Serve on it) did not start, twice; the message has log tails."""

    def __init__(self, error: str, tail: str = "") -> None:
        super().__init__(f"{error}\n{tail}" if tail else error)
        self.error, self.tail = error, tail


@dataclass
class LocalCluster:
    http_port: int
    metrics_port: int
    temp_dir: Path
    session_dir: Path | None = None
    router_port: int | None = None  # the first port of the routers' pool (direct ingress on)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """Serve's HTTP proxy."""
        return f"http://127.0.0.1:{self.http_port}"


def router_url(router_port: int, timeout_s: float = 60.0) -> str:
    """The URL of the one router serving HTTP itself from the pool at `router_port`: the pool's
    port that answers `/health` (Serve hands the lowest port it can bind)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        for port in range(router_port, router_port + ROUTER_POOL):
            url = f"http://127.0.0.1:{port}"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return url
            except httpx.HTTPError:
                continue
        if time.monotonic() > deadline:
            raise TimeoutError(f"no router answers on ports {router_port}-{port}")
        time.sleep(0.5)


def pin_loopback() -> None:
    """Make Ray dial and bind 127.0.0.1 as given, in this process and the ones it starts.

    Ray rewrites a loopback host handed to `ray.init` (`address` or `_node_ip_address`) to this
    machine's interface address unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, and reads that
    variable once, when Ray is first imported. A process that imported Ray before setting it
    (`benchmarks.cluster` imports Serve first) dialled a loopback-only GCS at the interface
    address, retrying forever. So the variable is set for the processes started later, Ray's
    constant (read at each call) is set here too, and Ray's own resolver is asked to agree.
    """
    os.environ[LOOPBACK_SWITCH] = "0"
    from ray._private import ray_constants, services

    ray_constants.ENABLE_RAY_CLUSTER = False
    resolved = services.resolve_ip_for_localhost(LOOPBACK)
    if resolved != LOOPBACK:
        raise RuntimeError(
            f"Ray resolves {LOOPBACK} to {resolved}: the cluster would leave loopback"
        )


def loopback_faults(gcs_address: str) -> list[str]:
    """What of the connected cluster is off loopback: its address, the address this driver
    dialled, each live node's; empty when all are on `LOOPBACK`."""
    import ray

    faults = []
    if gcs_address.rpartition(":")[0] != LOOPBACK:
        faults.append(f"cluster address {gcs_address}")
    dialled = ray.get_runtime_context().gcs_address
    if dialled != gcs_address:
        faults.append(f"the driver dialled {dialled}, not {gcs_address}")
    for node in ray.nodes():
        if node["Alive"] and node["NodeManagerAddress"] != LOOPBACK:
            faults.append(f"node {node['NodeID'][:8]} on {node['NodeManagerAddress']}")
    return faults


def require_token_auth() -> None:
    """Token auth on for the cluster this process starts (Ray's default; `disabled` refused)."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    try:  # Ray caches its config: refresh it so this process sees token mode too
        from ray._raylet import Config

        Config.initialize("")
    except (ImportError, AttributeError):
        pass


def log_tail(logs_dir: Path | None, lines: int = 30) -> str:
    """The last lines of the logs that explain a failed start (raylet, agent, GCS, proxy)."""
    if logs_dir is None or not logs_dir.is_dir():
        return f"(no Ray log directory found at {logs_dir})"
    parts: list[str] = []
    for pattern in LOG_PATTERNS:
        for path in sorted(logs_dir.glob(pattern)):
            text = path.read_text(errors="replace").splitlines()
            if text:
                parts.append(f"--- {path} (last {min(lines, len(text))} lines) ---")
                parts.extend(text[-lines:])
    return "\n".join(parts) or f"(no logs in {logs_dir})"


def _session_dir(temp_dir: Path) -> Path | None:
    latest = temp_dir / "session_latest"
    if latest.exists():
        return latest.resolve()
    sessions = sorted(temp_dir.glob("session_2*"))
    return sessions[-1] if sessions else None


def _wait_proxies_healthy(timeout_s: float) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    proxies: dict[str, Any] = {}
    while time.monotonic() < deadline:
        proxies = serve.status().proxies
        if proxies and all(str(getattr(s, "value", s)) == "HEALTHY" for s in proxies.values()):
            return
        time.sleep(0.5)
    raise TimeoutError(f"Serve's HTTP proxy not healthy after {timeout_s}s: {proxies}")


@contextlib.contextmanager
def cluster_serve_env(router_port: int | None = None) -> Iterator[None]:
    """The shipped configs' Serve settings (`harness_env`) and the proxy's stream guard
    (deployments/api/proxy_guard.py) in the environment the cluster's processes inherit from
    its raylet, but not in this process: its own Serve (test handles on short-lived event
    loops) keeps Ray's defaults."""
    import ray.serve  # noqa: F401  (the driver's Serve constants are read now, without them)

    wanted = {**harness_env(router_port), **PROXY_ENV_VARS}
    saved = {key: os.environ.get(key) for key in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _draw_port(span: int) -> int:
    """The proxy's port, with the `span` ports above it bindable too (the routers' pool)."""
    return ports.free_ports(1, offsets=range(span + 1))[0]


def _stop_ray() -> None:
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def _start_once(
    num_cpus: int,
    system_config: dict[str, Any] | None,
    http_port: int,
    ready_timeout_s: float,
    direct_ingress: bool,
) -> LocalCluster:
    import ray
    from ray import serve

    temp_dir = Path(tempfile.mkdtemp(prefix="molora-ray-"))  # its own logs; short socket paths
    router_port = http_port + 1 if direct_ingress else None
    cluster = LocalCluster(
        http_port=http_port, metrics_port=-1, temp_dir=temp_dir, router_port=router_port
    )
    try:
        with cluster_serve_env(router_port):
            context = ray.init(
                num_cpus=num_cpus,
                include_dashboard=False,
                _node_ip_address=LOOPBACK,
                _temp_dir=str(temp_dir),
                _system_config=system_config or None,
                log_to_driver=False,
                configure_logging=False,
            )
        cluster.session_dir = Path(context.address_info["session_dir"])
        if faults := loopback_faults(context.address_info["gcs_address"]):
            raise RuntimeError(f"the cluster is not on {LOOPBACK}: {'; '.join(faults)}")
        # Ray's metrics exporter bound a port of its own choosing; read it back.
        cluster.metrics_port = int(context.address_info.get("metrics_export_port") or -1)
        if cluster.metrics_port <= 0:
            raise RuntimeError(f"Ray reports no metrics export port ({cluster.metrics_port})")
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        _wait_proxies_healthy(ready_timeout_s)
    except Exception as exc:  # not KeyboardInterrupt: an interrupted start is not retried
        cluster.session_dir = cluster.session_dir or _session_dir(temp_dir)
        logs = cluster.session_dir / "logs" if cluster.session_dir else None
        tail = log_tail(logs)
        with contextlib.suppress(Exception):  # the start's own error is the one to report
            _stop_ray()
        lines = f"{type(exc).__name__}: {exc}".splitlines()
        error = "\n".join(lines[:3] + (["  ..."] if len(lines) > 15 else []) + lines[3:][-12:])
        raise ClusterStartError(error, tail) from exc
    return cluster


def start_local_cluster(
    num_cpus: int = 8,
    *,
    system_config: dict[str, Any] | None = None,
    attempts: int = 2,
    ready_timeout_s: float = 90.0,
    pick_port: Callable[[], int] | None = None,
    direct_ingress: bool = False,
) -> LocalCluster:
    """Start Ray (head on 127.0.0.1) and Serve's HTTP proxy, with `direct_ingress` the routers'
    own servers on the ports above it; retried once on fresh ports."""
    pin_loopback()
    require_token_auth()
    if pick_port is None:
        span = ROUTER_POOL if direct_ingress else 0
        pick_port = functools.partial(_draw_port, span)
    errors: list[str] = []
    tail = ""
    for attempt in range(1, attempts + 1):
        try:
            return _start_once(
                num_cpus, system_config, pick_port(), ready_timeout_s, direct_ingress
            )
        except ClusterStartError as exc:
            errors.append(f"=== attempt {attempt}/{attempts}: {exc.error}")
            tail = exc.tail
    raise ClusterStartError(
        f"the local Ray cluster did not start in {attempts} attempts (fresh ports each):\n"
        + "\n".join(errors)
        + "\n=== Ray's logs of the last attempt:",
        tail,
    )


def stop_local_cluster(cluster: LocalCluster | None = None) -> None:
    """Shut Serve and Ray down; the cluster's temp dir (sockets, logs) is removed."""
    _stop_ray()
    if cluster is not None:
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)
