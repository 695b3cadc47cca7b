"""Ray Serve's own settings for the per-token streaming path, in one place.

Every streamed token crosses Ray twice (model replica -> router -> HTTP proxy), so Serve's
per-message overhead is paid once per token per request. By default Serve runs user code on a
second event loop in its own thread and the handle's router on a third, handing every message
across threads; on the 2-core box that work took a core from the engine's step thread (29% of
its time spent waiting to run, measured with schedstat). `RAY_SERVE_THROUGHPUT_OPTIMIZED` is
Ray's bundle that keeps user code and the router on the replica's main loop and sends handle
calls over the replicas' (token-authenticated) inter-deployment gRPC servers; measured side by
side at the endpoint (bf16, 2 replicas x 1 CPU) it served base c=8 +37%, base c=32 +15%,
mixed adapters c=32 +19%.

Of the bundle we turn two parts back: direct ingress (every router replica would open a
second public HTTP port of its own, beside the proxy's), and the log changes (replica logs keep
going to stderr, unbuffered, so an operator sees a warning when it happens).

The variables are read when a Ray process imports Serve, so they must be in the replicas'
environment: the shipped configs set them as the application's `runtime_env.env_vars` (a test
keeps every shipped config in step with `SERVE_ENV_VARS`), and `local_ray` exports them before
it starts a test cluster.
"""

from __future__ import annotations

from collections.abc import Mapping

SERVE_ENV_VARS: dict[str, str] = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_LOG_TO_STDERR": "1",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
}


def missing_serve_env(env_vars: Mapping[str, str] | None) -> dict[str, str]:
    """The settings of `SERVE_ENV_VARS` that `env_vars` lacks or sets otherwise."""
    have = dict(env_vars or {})
    return {k: v for k, v in SERVE_ENV_VARS.items() if have.get(k) != v}


def serve_fast_path_active() -> bool:
    """Whether this process imported Serve with user code on the replica's main loop."""
    from ray.serve._private import constants

    return not constants.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD
