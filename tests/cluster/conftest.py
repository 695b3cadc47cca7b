"""One multi-node cluster (head + node_a + node_b, SeaweedFS) per cluster-test session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.start_once import StartOnce
from tests.support.multinode import (
    MultiNodeCluster,
    RedisServer,
    app_config,
    make_assets,
    start_multinode,
)

ADAPTERS = 8

# GCS fault tolerance on where Debian's redis-server is installed (the head-loss test needs it).
CLUSTER = StartOnce(
    "multinode", lambda: start_multinode(gcs_ft=RedisServer.available()), lambda c: c.stop()
)


@pytest.fixture(scope="session")
def cluster_assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_assets(tmp_path_factory.mktemp("cluster-assets"), ADAPTERS)


# Module scope: Ray is torn down before the next folder's tests, which start Ray of their own.
@pytest.fixture(scope="module")
def multinode(request: pytest.FixtureRequest) -> Iterator[MultiNodeCluster]:
    yield CLUSTER.ensure(request.node.nodeid)
    CLUSTER.stop()


@pytest.fixture(scope="module")
def deployed(multinode: MultiNodeCluster, cluster_assets: tuple[Path, Path]) -> dict:
    """The app on 2 model replicas (one per worker node) and 2 routers on the head."""
    model, adapters = cluster_assets
    store = multinode.publish(adapters)
    app = app_config(model, store, model_replicas=2, slots=4, max_num_seqs=8, max_per_node=1)
    multinode.deploy(app)
    return {"app": app, "model": model, "store": store}
