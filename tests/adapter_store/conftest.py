"""Store test fixtures: one real SeaweedFS S3 server per session, and every store test runs
against both backends (`local` directory and `s3` bucket) through the `store_url` fixture."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from adapter_store import AdapterStoreSource, Registry, open_registry
from tests.adapter_store.store_helpers import SMALL_LLAMA, make_peft_adapter
from tests.support.seaweedfs import SeaweedFS


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs")).start()
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        yield server
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def s3_bucket(seaweed: SeaweedFS) -> str:
    """One bucket per session (creating one is slow); each test gets its own prefix in it."""
    return seaweed.create_bucket()


@pytest.fixture(params=["local", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "store")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/{uuid.uuid4().hex[:12]}/adapters"


@pytest.fixture
def registry(store_url: str) -> Registry:
    return open_registry(store_url, create=True)


@pytest.fixture
def source(registry: Registry, tmp_path: Path) -> AdapterStoreSource:
    return AdapterStoreSource(registry=registry, cache_dir=tmp_path / "cache", cache_bytes=1 << 30)


@pytest.fixture(scope="session")
def adapters_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two PEFT-saved adapters (built once per session) and the tiny base config."""
    root = tmp_path_factory.mktemp("peft")
    make_peft_adapter(root / "alpha", r=4, targets=["q_proj", "v_proj", "down_proj"], seed=1)
    make_peft_adapter(root / "beta", r=8, targets=["q_proj", "k_proj", "o_proj", "up_proj"], seed=2)
    (root / "base").mkdir()
    (root / "base" / "config.json").write_text(json.dumps({"model_type": "llama", **SMALL_LLAMA}))
    return root


@pytest.fixture
def alpha(adapters_dir: Path, tmp_path: Path) -> Path:
    """A private copy (tests may corrupt it)."""
    return Path(shutil.copytree(adapters_dir / "alpha", tmp_path / "alpha"))


@pytest.fixture
def beta(adapters_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(adapters_dir / "beta", tmp_path / "beta"))


@pytest.fixture
def base_config(adapters_dir: Path) -> dict:
    return json.loads((adapters_dir / "base" / "config.json").read_text())
