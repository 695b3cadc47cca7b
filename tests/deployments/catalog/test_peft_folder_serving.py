"""End to end on a real app: a Ray Serve LLM folder of PEFT adapters (a local directory and a
real SeaweedFS bucket) served through `molora serve --dynamic-lora-loading-path`, by name and
as `<base>:<adapter>`; runtime loads land in the writable store, never in the PEFT folder; and
on the default config a runtime load writes nothing under the checkout."""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from adapter_store import open_backend, open_registry
from adapter_store.errors import ReadOnlyStoreError
from deployments.catalog.lora_admin import LoadLoraBody, load_lora
from deployments.config import StoreConfig
from deployments.ops import serve_cli
from deployments.protocol.errors import status_of
from tests.deployments.serve_helpers import ROOT, adapter_files, deployed, shipped_args
from tests.support.seaweedfs import SeaweedFS

MESSAGES = [{"role": "user", "content": "Say something."}]


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
    }


def _chat(url: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def _load(url: str, name: str) -> None:
    """`POST /v1/load_lora_adapter` of the folder `name` under the load dir, as `name`."""
    r = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": name}, timeout=120
    )
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_peft_folder_prefix_is_served_read_only(
    where: str,
    request: pytest.FixtureRequest,
    ray_cluster,
    tiny_assets,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = ray_cluster["url"]
    env: dict[str, str] = {}
    flags = ["--dynamic-lora-loading-path"]
    if where == "local":
        prefix = str(tmp_path / "loras")
        backend = open_backend(prefix, create=True)
        flags.append(prefix)
    else:
        seaweed = request.getfixturevalue("seaweed")
        env = seaweed.env()
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        prefix = f"s3://{seaweed.create_bucket()}/ray/loras"
        backend = open_backend(prefix, seaweed.endpoint_url)
        flags += [prefix, "--store-endpoint-url", seaweed.endpoint_url]
    src = adapter_files(tiny_assets["store"], "math")
    for path in sorted(src.iterdir()):
        backend.upload_file(f"ray-math/{path.name}", path)
    before = backend.list_keys("")
    argv = [str(tiny_assets["model"]), "--store", str(tmp_path / "mine"), "--dtype", "float32"]
    argv += ["--served-model-name", "tiny-base", *flags]
    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    doc = serve_cli.build_document(parser.parse_args(["serve", *argv]))
    assert serve_cli.publish_modules(doc, {}) == []  # as `molora serve` does: makes the store
    args = doc["applications"][0]["args"]
    # No background reload during the test: what appears, appears by a request or a change.
    args["store"] |= {"cache_dir": str(tmp_path / "cache"), "refresh_s": 3600}
    load_dir = tmp_path / "load"
    shutil.copytree(src, load_dir / "own")
    args["server"]["runtime_lora"] = {"load_dir": str(load_dir)}
    with deployed(url, args, env=env or None):
        models = {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
        assert {"tiny-base", "ray-math"} <= models
        by_name = _chat(url, "ray-math")
        assert by_name.status_code == 200, by_name.text
        prefixed = _chat(url, "tiny-base:ray-math")
        assert prefixed.status_code == 200, prefixed.text
        texts = [r.json()["choices"][0]["message"]["content"] for r in (by_name, prefixed)]
        assert texts[0] == texts[1] and texts[0]
        assert _chat(url, "tiny-base:ray-math:0.5").status_code == 400
        # A folder written behind the router's back is found by the first request naming it.
        assert _chat(url, "ray-never").status_code == 404
        for path in sorted(src.iterdir()):
            backend.upload_file(f"ray-late/{path.name}", path)
        late = _chat(url, "ray-late")
        assert late.status_code == 200, late.text
        before = backend.list_keys("")
        # Runtime loads and unloads write to the writable store, not the PEFT folder.
        _load(url, "own")
        assert _chat(url, "tiny-base:own").status_code == 200
        r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "ray-math"}, timeout=60)
        assert r.status_code == 200, r.text
        assert _chat(url, "ray-math").status_code == 404
    assert backend.list_keys("") == before
    assert open_registry(str(tmp_path / "mine")).names("adapter") == ["own", "ray-math"]


def test_a_runtime_load_on_the_default_config_writes_nothing_in_the_checkout(
    ray_cluster, tiny_assets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = ray_cluster["url"]
    monkeypatch.setenv("MOLORA_HOME", str(tmp_path / "home"))
    bundled = ROOT / "deployments" / "default_store"
    before = _snapshot(bundled)
    load_dir = tmp_path / "load"
    shutil.copytree(adapter_files(tiny_assets["store"], "math"), load_dir / "mine")
    args = shipped_args(tiny_assets, server={"runtime_lora": {"load_dir": str(load_dir)}})
    args["store"] = {"cache_dir": str(tmp_path / "cache"), "refresh_s": 0.5}  # default url
    with deployed(url, args):
        _load(url, "mine")
        assert _chat(url, "mine").status_code == 200
        # Unloading a bundled adapter yanks it in the user store; the bundled files stay.
        models = {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
        assert "sorting" in models
        r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sorting"}, timeout=60)
        assert r.status_code == 200, r.text
        models = {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
        assert "sorting" not in models and "mine" in models
    assert _snapshot(bundled) == before
    user = open_registry(str(tmp_path / "home" / "data" / "store"))
    assert user.names("adapter") == ["mine", "sorting"]
    yanks = user.backend.list_keys("adapters/sorting/")
    assert yanks and all(k.endswith("/yanked.json") for k in yanks)


def test_a_runtime_load_into_a_read_only_store_is_403(tiny_assets, tmp_path: Path) -> None:
    peft = tmp_path / "loras"
    shutil.copytree(adapter_files(tiny_assets["store"], "math"), peft / "ray-math")
    shutil.copytree(adapter_files(tiny_assets["store"], "code"), tmp_path / "load" / "own")
    base = json.loads((tiny_assets["model"] / "config.json").read_text())
    before = _snapshot(peft)
    for store in (StoreConfig(url=f"peft:{peft}"), StoreConfig(url=str(peft), writable=None)):
        with pytest.raises(ReadOnlyStoreError, match="read-only") as err:
            body = LoadLoraBody(lora_name="own", lora_path="own")
            load_lora(store, tmp_path / "load", base, None, body)
        assert status_of(err.value) == 403
    assert _snapshot(peft) == before
