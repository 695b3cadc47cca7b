"""Every shipped config runs Serve's streaming fast path (deployments/replica/serve_env.py)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import yaml

from deployments.replica.serve_env import (
    ROUTER_PORT,
    SERVE_ENV_VARS,
    direct_ingress_env,
    missing_serve_env,
    port_free,
    unpinned_direct_ingress,
    wait_for_router_port,
)
from tests.support import ports
from tests.support.local_ray import ROUTER_POOL, harness_env

ROOT = Path(__file__).resolve().parents[3]


def _applications(name: str) -> list[dict]:
    data = yaml.safe_load((ROOT / name).read_text())
    if data.get("kind") == "RayService":
        data = yaml.safe_load(data["spec"]["serveConfigV2"])
    return data["applications"]


@pytest.mark.parametrize(
    "name", ["serve_config.yaml", "serve_config.gpu.yaml", "k8s/base/rayservice.yaml"]
)
def test_shipped_configs_set_the_serve_env(name: str) -> None:
    for app in _applications(name):
        env = (app.get("runtime_env") or {}).get("env_vars")
        assert missing_serve_env(env) == {}, f"{name}: {app['name']}"


def test_dev_overlay_keeps_the_serve_env() -> None:
    """The overlay replaces serveConfigV2 whole, so it must carry the settings itself."""
    ops = yaml.safe_load((ROOT / "k8s/overlays/dev/rayservice-patch.yaml").read_text())
    (op,) = [o for o in ops if o["path"] == "/spec/serveConfigV2"]
    for app in yaml.safe_load(op["value"])["applications"]:
        assert missing_serve_env(app["runtime_env"]["env_vars"]) == {}, app["name"]


def test_missing_names_what_differs() -> None:
    assert missing_serve_env(None) == SERVE_ENV_VARS
    wrong = {**SERVE_ENV_VARS, "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
    assert missing_serve_env(wrong) == {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}


def test_shipped_configs_give_each_node_one_router() -> None:
    """The router's port is one per node: a second router on a node would find it taken."""
    for name in ["serve_config.yaml", "serve_config.gpu.yaml", "k8s/base/rayservice.yaml"]:
        for app in _applications(name):
            router = next(d for d in app["deployments"] if d["name"] == "Router")
            assert router["max_replicas_per_node"] == 1, name


def test_the_pool_is_the_one_port() -> None:
    """Serve's port pool is [min, max): the router gets exactly the documented port, and a
    freed port is not held back from the router that replaces it."""
    env = direct_ingress_env()
    low = int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"])
    high = int(env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"])
    assert list(range(low, high)) == [ROUTER_PORT]
    assert env["RAY_SERVE_PORT_QUARANTINE_S"] == "0"
    assert direct_ingress_env(enabled=False) == {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
    wide = direct_ingress_env(20000, pool=4)  # room for more routers on a node (the harness)
    assert wide["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] == "20004"


def test_an_unpinned_cluster_is_named() -> None:
    assert unpinned_direct_ingress({}) is None
    assert unpinned_direct_ingress(direct_ingress_env()) is None
    why = unpinned_direct_ingress({"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"})
    assert why is not None and "make serve" in why and "30000" in why


def test_make_serve_starts_the_cluster_with_direct_ingress() -> None:
    recipe = (ROOT / "Makefile").read_text().split("\nserve:", 1)[1].split("\n\n", 1)[0]
    assert "-m deployments.replica.serve_env" in recipe
    assert "serve run serve_config.yaml" in recipe


def test_the_test_cluster_runs_the_fast_path(ray_cluster) -> None:
    """local_ray hands the settings to the cluster, so a worker of the test cluster (where
    replicas run) imports Serve the way `serve run serve_config.yaml` makes it; the test
    process itself keeps Ray's defaults."""
    import ray

    expected = harness_env(ray_cluster["router_port"])

    @ray.remote(num_cpus=0)
    def worker_view() -> tuple[dict[str, str | None], bool]:
        from deployments.replica.serve_env import serve_fast_path_active

        return {k: os.environ.get(k) for k in expected}, serve_fast_path_active()

    env, active = ray.get(worker_view.remote(), timeout=60)
    # Direct ingress on, as shipped, from a pool of ports drawn for this run.
    assert env == expected and env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"]) == ray_cluster["router_port"]
    assert active
    assert "RAY_SERVE_THROUGHPUT_OPTIMIZED" not in os.environ


async def test_the_router_waits_for_its_port_while_closed_connections_linger() -> None:
    """A connection the server side closed first leaves the port in TIME_WAIT: Serve's bind
    (no SO_REUSEADDR) would fail and drop the port from the pool, so the router waits."""
    port = ports.free_port()
    env = direct_ingress_env(port)
    listener = socket.create_server(("127.0.0.1", port))
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    assert not port_free(port)  # listening
    accepted.close()  # the server closes first, as a stopping router does
    client.close()
    listener.close()
    assert not port_free(port)  # TIME_WAIT
    assert await wait_for_router_port(env, timeout_s=0.3, poll_s=0.1) is False
    other = ports.free_port(exclude=[port])
    assert port_free(other)
    assert await wait_for_router_port(direct_ingress_env(other), timeout_s=0.3) is True
    # A pool of several ports (the harness): Serve takes the next one, nothing to wait for.
    assert await wait_for_router_port(direct_ingress_env(port, pool=ROUTER_POOL), timeout_s=0)
    # Not pinned (direct ingress off, or a bare `serve run`): nothing to wait for.
    assert await wait_for_router_port({"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}, timeout_s=0)
