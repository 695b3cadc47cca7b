"""Every shipped config runs Serve's streaming fast path (deployments/replica/serve_env.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from deployments.replica.serve_env import SERVE_ENV_VARS, missing_serve_env

ROOT = Path(__file__).resolve().parents[2]


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
    wrong = {**SERVE_ENV_VARS, "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}
    assert missing_serve_env(wrong) == {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}


def test_the_test_cluster_runs_the_fast_path(ray_cluster) -> None:
    """local_ray hands the settings to the cluster, so a worker of the test cluster (where
    replicas run) imports Serve the way `serve run serve_config.yaml` makes it; the test
    process itself keeps Ray's defaults."""
    import ray

    @ray.remote(num_cpus=0)
    def worker_view() -> tuple[dict[str, str | None], bool]:
        from deployments.replica.serve_env import serve_fast_path_active

        return {k: os.environ.get(k) for k in SERVE_ENV_VARS}, serve_fast_path_active()

    env, active = ray.get(worker_view.remote(), timeout=60)
    assert env == SERVE_ENV_VARS
    assert active
    assert "RAY_SERVE_THROUGHPUT_OPTIMIZED" not in os.environ
