"""One loopback Ray cluster per test session, tiny real assets, and an app deployer."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_assets import make_store, make_tiny_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serve-assets")
    (root / "model").mkdir()
    (root / "work").mkdir()
    model = make_tiny_model(root / "model")
    store = make_store(model, root / "store", root / "work")
    return {"model": model, "store": store, "cache": root / "cache"}


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[dict[str, Any]]:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray import serve

    metrics_port = free_port()
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _metrics_export_port=metrics_port,
        log_to_driver=False,
        configure_logging=False,
    )
    http_port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    yield {"url": f"http://127.0.0.1:{http_port}", "metrics_port": metrics_port}
    serve.shutdown()
    ray.shutdown()
