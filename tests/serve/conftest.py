"""One loopback Ray cluster per test session, tiny real assets, and an app deployer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_assets import make_assets
from serve_helpers import openai_client, serving, tiny_args
from start_once import StartOnce

from tests.support.local_ray import ClusterStartError, start_local_cluster, stop_local_cluster

# Started by tests/conftest.py's setup hook for the first test that needs `ray_cluster`; a start
# that fails (twice: it is retried on fresh ports) is one error with Ray's log tails. Direct
# ingress is on, as shipped: `url` is Serve's proxy, the routers serve HTTP from `router_port` up.
RAY = StartOnce(
    "ray_cluster",
    lambda: start_local_cluster(num_cpus=8, direct_ingress=True),
    stop_local_cluster,
    errors=(ClusterStartError,),
)


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_assets(tmp_path_factory.mktemp("serve-assets"))


@pytest.fixture(scope="session")
def ray_cluster(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    cluster = RAY.ensure(request.node.nodeid)
    yield {
        "url": cluster.url,
        "metrics_port": cluster.metrics_port,
        "router_port": cluster.router_port,
    }
    RAY.stop()


@pytest.fixture(scope="module")
def app_url(ray_cluster: dict[str, Any], tiny_assets: dict[str, Path]) -> Iterator[str]:
    """The module's app unless it defines its own: the shipped config on the tiny assets, one
    replica of four sequences and a 256-token context."""
    args = tiny_args(tiny_assets, seqs=4, model_len=256, max_tokens=16)
    yield from serving(ray_cluster, args, replicas=1, max_ongoing=16)


@pytest.fixture
def client(app_url: str) -> Any:
    """The official OpenAI client against the module's `app_url` app."""
    return openai_client(app_url)
