"""One loopback Ray cluster per test session, tiny real assets, and the app several modules share:
the modules that use it run first and back to back, so it is deployed once (`SHARED`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deployments.serve_assets import make_assets
from tests.deployments.serve_helpers import SHARED, openai_client, tiny_args
from tests.start_once import StartOnce
from tests.support.local_ray import ClusterStartError, start_local_cluster, stop_local_cluster

HERE = Path(__file__).parent

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
    SHARED.key = None  # the cluster goes, its app with it
    RAY.stop()


@pytest.fixture(scope="module")
def app_url(ray_cluster: dict[str, Any], tiny_assets: dict[str, Path]) -> str:
    """The module's app unless it defines its own: the shipped config on the tiny assets, one
    replica of four sequences and a 256-token context, shared with the other modules using it."""
    args = tiny_args(tiny_assets, seqs=4, model_len=256, max_tokens=16)
    return SHARED.serve(ray_cluster, args, replicas=1, max_ongoing=16)


@pytest.fixture
def client(app_url: str) -> Any:
    """The official OpenAI client against the module's `app_url` app."""
    return openai_client(app_url)


def _shares_the_app(item: pytest.Item) -> bool:
    """The item takes this conftest's `app_url` (its module defines none of its own)."""
    names = getattr(item, "fixturenames", ())
    module = getattr(item, "module", None)
    return "app_url" in names and module is not None and not hasattr(module, "app_url")


# The files of the modules with a test that takes the shared app (set at collection).
SHARING: set[Path] = set()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules of this folder that share the app run first, whole and in their order, then
    the rest: the app is deployed once for all of them (items outside this folder stay put)."""
    here = [i for i, item in enumerate(items) if item.path.is_relative_to(HERE)]
    mine = [items[i] for i in here]
    SHARING.update(item.path for item in mine if _shares_the_app(item))
    ordered = [it for it in mine if it.path in SHARING] + [
        it for it in mine if it.path not in SHARING
    ]
    for i, item in zip(here, ordered, strict=True):
        items[i] = item


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """The shared app is removed after the last module that shares it, before the next one's;
    the cluster after this folder's last test and its fixtures' teardown (tests/k8s then starts
    one of its own)."""
    if item.path in SHARING and (nextitem is None or nextitem.path not in SHARING):
        SHARED.release()
    result = yield
    if nextitem is None or not nextitem.path.is_relative_to(HERE):
        SHARED.key = None  # the cluster goes, its app with it
        RAY.stop()
    return result
