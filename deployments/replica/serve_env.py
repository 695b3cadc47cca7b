"""Ray Serve's own settings for the per-token streaming path, in one place.

Every streamed token crosses Ray on its way out, so Serve's per-message overhead is paid once
per token per request. By default Serve runs user code on a second event loop in its own thread
and the handle's router on a third, handing every message across threads; on a 2-core box that
work took a core from the engine's step thread. `RAY_SERVE_THROUGHPUT_OPTIMIZED` is Ray's bundle
that keeps user code and the router on the replica's main loop and sends handle calls over the
replicas' (token-authenticated) inter-deployment gRPC servers.

Direct ingress (part of that bundle) is on: the router replica serves HTTP itself, so the Serve
proxy's hop (one Ray message per request per write) leaves the token path. Serve would give the
router a port from a pool (30000 and up); `direct_ingress_env` shrinks the pool to one fixed port
per node, so clients have one documented address, and hence one router replica per node
(`max_replicas_per_node: 1` in the shipped configs). The router binds `http_options.host`
(loopback locally) and Serve's proxy keeps serving `http_options.port` beside it. Of the bundle
we turn the log changes back (replica logs keep going to stderr, unbuffered).

Two places must carry the settings. `SERVE_ENV_VARS` are read when a replica imports Serve: the
shipped configs set them as the application's `runtime_env.env_vars` (a test keeps every shipped
config in step). `direct_ingress_env` is read by Serve's controller as well (port pool, draining)
and a config cannot reach the controller: `make serve`, `molora serve` and the KubeRay pods put
it in the environment of the cluster they start.

Which cluster: `make serve` and `molora serve` start a new local one on 127.0.0.1 unless given an
address (RAY_ADDRESS, or `--address`), and say which they did (`ray_address_env`). A bare
`serve run` would instead connect to the address Ray's temp dir records for the last cluster
started there (`ray_address_file`), which a killed run leaves behind: it retried a dead GCS forever.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

ROUTER_PORT = 8000  # the API: each node's router replica serves HTTP here itself
PROXY_PORT = 8001  # Serve's HTTP proxy (`http_options.port`), the same app one hop further
# How long a stopping router keeps answering (health says DRAINING) before it closes its port;
# in-flight requests are always waited for. Locally nothing has to deregister it; a cluster
# needs its readiness probe to notice and its endpoints to update within this time.
LOCAL_DRAINING_S = 2.0
CLUSTER_DRAINING_S = 15.0
ENABLE = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
MIN_PORT = "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"
MAX_PORT = "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"
# Linux holds a closed connection's port in TIME_WAIT for 60 s.
PORT_WAIT_S = 90.0
logger = logging.getLogger("ray.serve")
LOOPBACK = "127.0.0.1"
RAY_ADDRESS = "RAY_ADDRESS"
NEW_LOCAL = "local"  # Ray's address for "start a new local instance" (ray.init, RAY_ADDRESS)

# Ray's HTTP proxy (and the router's own server) wrap their app in the stream guard named here
# (deployments/api/proxy_guard.py), by import path: this floor imports nothing of the API's.
PROXY_ENV_VARS: dict[str, str] = {
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "deployments.api.proxy_guard:proxy_middlewares"
}

SERVE_ENV_VARS: dict[str, str] = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    ENABLE: "1",
    "RAY_SERVE_LOG_TO_STDERR": "1",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
}


def direct_ingress_env(
    port: int = ROUTER_PORT,
    draining_s: float = LOCAL_DRAINING_S,
    enabled: bool = True,
    pool: int = 1,
) -> dict[str, str]:
    """What the processes of the cluster (Serve's controller too) must inherit for the router to
    serve on `port`; `enabled=False` is the switch back to Serve's proxy alone. `pool` > 1 lets
    a node hold that many routers, on `port` and the ports above it (the lowest free first)."""
    if not enabled:
        return {ENABLE: "0"}
    return {
        ENABLE: "1",
        # Serve's pool is [min, max): by default exactly `port` on every node.
        MIN_PORT: str(port),
        MAX_PORT: str(port + pool),
        # A freed port is otherwise held back minutes (for HAProxy, not used here): with a pool
        # of one, a router restarted on its node could not serve until then.
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": f"{draining_s:g}",
    }


def missing_serve_env(env_vars: Mapping[str, str] | None) -> dict[str, str]:
    """The settings of `SERVE_ENV_VARS` that `env_vars` lacks or sets otherwise."""
    have = dict(env_vars or {})
    return {k: v for k, v in SERVE_ENV_VARS.items() if have.get(k) != v}


def serve_fast_path_active() -> bool:
    """Whether this process imported Serve with user code on the replica's main loop."""
    from ray.serve._private import constants

    return not constants.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD


def unpinned_direct_ingress(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why the router would serve on a port Serve picks (30000 and up) instead of the fixed one:
    direct ingress is on here but the cluster was started without `direct_ingress_env`."""
    if environ.get(ENABLE) != "1" or environ.get(MIN_PORT):
        return None
    return (
        f"{ENABLE}=1 reaches the replicas but the cluster was started without its port "
        f"settings, so the router serves HTTP on a port Serve allocates (30000 and up), not on "
        f":{ROUTER_PORT}; start with `make serve` or `molora serve`, or run `serve run` under "
        "`python -m deployments.replica.serve_env`"
    )


def port_free(port: int) -> bool:
    """Whether `port` can be bound the way Serve binds the router's server (no SO_REUSEADDR):
    a connection the previous router closed (TIME_WAIT) still holds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                return False
            raise
    return True


async def wait_for_router_port(
    environ: Mapping[str, str] = os.environ, timeout_s: float = PORT_WAIT_S, poll_s: float = 1.0
) -> bool:
    """Called at the end of the router's constructor, before Serve binds its server: wait until
    the fixed port is free. Serve binds it without SO_REUSEADDR and, on a failed bind, takes the
    port out of the node's pool for good; with a pool of one port, a router restarted while the
    last one's connections linger in TIME_WAIT would leave the node without a router. A pool of
    several ports needs no wait: Serve moves on to the next one."""
    if environ.get(ENABLE) != "1" or not environ.get(MIN_PORT):
        return True
    port = int(environ[MIN_PORT])
    if int(environ.get(MAX_PORT) or port + 1) - port > 1:
        return True
    deadline = time.monotonic() + timeout_s
    warned = False
    while not port_free(port):
        if time.monotonic() > deadline:
            logger.warning(f"port {port} still taken after {timeout_s:g} s; starting anyway")
            return False
        if not warned:
            logger.info(f"waiting for port {port} to be released (closed connections linger)")
            warned = True
        await asyncio.sleep(poll_s)
    return True


def ray_address_file(environ: Mapping[str, str] = os.environ) -> Path:
    """Where Ray records the address of the last cluster started on this machine (`ray start`,
    `ray.cluster_utils`), as Ray 2.60 finds it: a `ray.init()` without an address connects there."""
    if "RAY_TMPDIR" in environ:
        base = environ["RAY_TMPDIR"]
    elif sys.platform.startswith("linux") and "TMPDIR" in environ:
        base = environ["TMPDIR"]
    else:
        base = "/tmp"  # Ray's own default, not tempfile's
    return Path(base) / "ray" / "ray_current_cluster"


def command_address(command: Sequence[str]) -> str | None:
    """The `--address`/`-a` a `serve run ...` command line gives itself, if any."""
    for i, arg in enumerate(command):
        if arg.startswith("--address="):
            return arg.partition("=")[2]
        if arg in ("--address", "-a") and i + 1 < len(command):
            return command[i + 1]
    return None


def ray_address_env(
    environ: Mapping[str, str] = os.environ, address: str | None = None
) -> tuple[dict[str, str], str]:
    """What `serve run` needs in its environment to reach the cluster meant, and a line saying
    which: an explicit `address`, else RAY_ADDRESS, as given; else a new local cluster on
    loopback (RAY_ADDRESS=local), never the address an earlier cluster left in Ray's temp dir."""
    if address:
        return {RAY_ADDRESS: address}, f"connecting to --address={address}"
    given = environ.get(RAY_ADDRESS, "")
    if given and given != NEW_LOCAL:
        return {}, f"connecting to RAY_ADDRESS={given}"
    line = f"starting a new local Ray cluster on {LOOPBACK}"
    recorded = ray_address_file(environ)
    if recorded.is_file():
        line += f" (not the earlier one {recorded} names; set RAY_ADDRESS to join a running one)"
    return {RAY_ADDRESS: NEW_LOCAL, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}, line


def main(argv: list[str] | None = None) -> None:
    """`python -m deployments.replica.serve_env [--port P] [--address A] serve run CONFIG`: runs
    the command with the cluster's direct-ingress settings in its environment (without one: prints
    them), and RAY_ADDRESS as `ray_address_env` decides, said on stderr."""
    parser = argparse.ArgumentParser(prog="python -m deployments.replica.serve_env")
    parser.add_argument("--port", type=int, default=ROUTER_PORT, help="the router's HTTP port")
    parser.add_argument("--draining-s", type=float, default=LOCAL_DRAINING_S)
    parser.add_argument(
        "--address", help="a running Ray cluster (default: RAY_ADDRESS, else a new local one)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    # The proxy's stream guard (deployments/api/proxy_guard.py) also wraps the router's server.
    env = {**PROXY_ENV_VARS, **direct_ingress_env(args.port, args.draining_s)}
    if not args.command:
        sys.stdout.write("".join(f"{k}={v}\n" for k, v in env.items()))
        return
    own = command_address(args.command)
    address, line = ray_address_env(os.environ, own or args.address)
    if own:  # `serve run` takes the command's own flag; nothing to add
        address = {}
    print(f"serve_env: {line}", file=sys.stderr, flush=True)
    os.execvpe(args.command[0], args.command, {**os.environ, **env, **address})


if __name__ == "__main__":
    main()
