"""vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: path containment (no symlink
escapes), publishing through the store's rulebook, and the endpoints round-trip with API keys."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from deployments.catalog.lora_admin import (
    LoadLoraBody,
    LoraAdminError,
    UnloadLoraBody,
    copy_folder,
    load_lora,
    resolve_inside,
    unload_lora,
)
from deployments.config import StoreConfig
from tests.deployments.serve_helpers import (
    adapter_files,
    deployed,
    keyed_server,
    own_store,
    runtime_lora,
    store_copy,
    tiny_args,
)

MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture
def lora_env(tiny_assets, tmp_path):
    store = store_copy(tiny_assets, tmp_path)
    load_dir = tmp_path / "loras"
    load_dir.mkdir()
    shutil.copytree(adapter_files(store), load_dir / "mine")
    base = json.loads((tiny_assets["model"] / "config.json").read_text())
    return {"store": StoreConfig(url=str(store)), "dir": load_dir, "base": base, "root": tmp_path}


def test_containment_refuses_escapes(tmp_path):
    root = tmp_path / "root"
    (root / "ok").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    assert resolve_inside(root, "ok") == (root / "ok").resolve()
    assert resolve_inside(root, str(root / "ok")) == (root / "ok").resolve()
    for bad in ["link", "../outside", str(outside), "missing", ".", "ok/../../outside", "a\x00b"]:
        with pytest.raises(LoraAdminError) as err:
            resolve_inside(root, bad)
        assert err.value.status == 400 and "inside" in err.value.message
    # A symlink inside an allowed folder (to a file outside) is refused when copying.
    (outside / "secret").write_text("x")
    (root / "ok" / "adapter_model.safetensors").symlink_to(outside / "secret")
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(LoraAdminError, match="symlink"):
        copy_folder(root / "ok", dest, 1 << 20)


def test_load_publishes_and_unload_yanks(lora_env):
    from adapter_store import open_registry

    env = lora_env
    got = load_lora(
        env["store"],
        env["dir"],
        env["base"],
        None,
        LoadLoraBody(lora_name="fresh", lora_path="mine"),
    )
    assert got.versions == ["v1"] and "added successfully" in got.message
    registry = open_registry(env["store"].url)
    assert registry.resolve("adapter", "fresh").version == "v1"
    with pytest.raises(LoraAdminError, match="already been loaded"):
        load_lora(
            env["store"],
            env["dir"],
            env["base"],
            None,
            LoadLoraBody(lora_name="fresh", lora_path="mine"),
        )
    assert unload_lora(env["store"], None, UnloadLoraBody(lora_name="fresh")).versions == ["v1"]
    assert "fresh" not in {m.name for m in registry.catalog("adapter")}
    with pytest.raises(LoraAdminError) as err:
        unload_lora(env["store"], None, UnloadLoraBody(lora_name="fresh"))
    assert err.value.status == 404
    # Loading again after unloading publishes a new version; a store reference works too.
    again = load_lora(
        env["store"],
        None,
        env["base"],
        None,
        LoadLoraBody(lora_name="fresh", lora_path="store:code"),
    )
    assert again.versions == ["v2"]
    # Paths are refused without a load_dir; the rulebook refuses a broken adapter.
    with pytest.raises(LoraAdminError) as err:
        load_lora(
            env["store"], None, env["base"], None, LoadLoraBody(lora_name="x", lora_path="mine")
        )
    assert err.value.status == 403 and "load_dir" in err.value.message
    broken = env["dir"] / "broken"
    shutil.copytree(env["dir"] / "mine", broken)
    cfg = json.loads((broken / "adapter_config.json").read_text())
    cfg["r"] = 999
    (broken / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoraAdminError) as err:
        load_lora(
            env["store"],
            env["dir"],
            env["base"],
            None,
            LoadLoraBody(lora_name="x", lora_path="broken"),
        )
    assert err.value.status == 400 and "invalid LoRA adapter" in err.value.message
    with pytest.raises(LoraAdminError) as err:
        load_lora(
            env["store"],
            None,
            env["base"],
            None,
            LoadLoraBody(lora_name="y", lora_path="store:ghost"),
        )
    assert err.value.status == 404


@pytest.fixture(scope="module")
def secured_lora(ray_cluster, tiny_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-admin")
    store = store_copy(tiny_assets, root)
    load_dir = root / "loras"
    load_dir.mkdir()
    shutil.copytree(adapter_files(store, "poem"), load_dir / "poem-copy")
    keys, server = keyed_server(root, [("admin", "ops", True), ("user", "ops", False)])
    server["runtime_lora"] = runtime_lora(load_dir)
    args = tiny_args(tiny_assets, seqs=2, queue=8, model_len=256, max_tokens=4, server=server)
    args["store"] = own_store(store, root)
    with deployed(ray_cluster["url"], args):
        yield {"url": ray_cluster["url"], "keys": keys}


def test_endpoints_round_trip_with_admin_keys(secured_lora):
    url, keys = secured_lora["url"], secured_lora["keys"]

    def post(who: str, path: str, body: dict) -> httpx.Response:
        headers = {"Authorization": f"Bearer {keys[who]}"}
        return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)

    def chat(model: str) -> httpx.Response:
        return post("user", "/v1/chat/completions", {"model": model, "messages": MESSAGES})

    load = {"lora_name": "verse", "lora_path": "poem-copy"}
    denied = post("user", "/v1/load_lora_adapter", load)
    assert denied.status_code == 403 and denied.json()["error"]["type"] == "permission_error"
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=30).status_code == 401
    assert chat("verse").status_code == 404
    ok = post("admin", "/v1/load_lora_adapter", load)
    assert ok.status_code == 200 and "added successfully" in ok.text
    assert chat("verse").status_code == 200
    again = post("admin", "/v1/load_lora_adapter", load)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    escape = post("admin", "/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": "/etc"})
    assert escape.status_code == 400 and escape.json()["error"]["param"] == "lora_path"
    bad = post("admin", "/v1/load_lora_adapter", {"lora_name": "x"})
    assert bad.status_code == 400 and "lora_path" in bad.json()["error"]["message"]
    gone = post("admin", "/v1/unload_lora_adapter", {"lora_name": "verse"})
    assert gone.status_code == 200 and "removed successfully" in gone.text
    assert chat("verse").status_code == 404
    missing = post("admin", "/v1/unload_lora_adapter", {"lora_name": "verse"})
    assert missing.status_code == 404 and set(missing.json()["error"]) == {
        "message", "type", "param", "code",
    }  # fmt: skip


def test_replica_stats_show_tiers_and_residency_to_admins(secured_lora):
    url, keys = secured_lora["url"], secured_lora["keys"]

    def get(who: str | None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {keys[who]}"} if who else {}
        return httpx.get(f"{url}/v1/admin/stats", headers=headers, timeout=60)

    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "math", "messages": MESSAGES, "max_tokens": 2},
        headers={"Authorization": f"Bearer {keys['admin']}"},
        timeout=60,
    )
    assert chat.status_code == 200
    assert chat.json()["molora"]["tier"] in {"slot", "host", "loading", "disk", "store"}
    assert get(None).status_code == 401
    denied = get("user")
    assert denied.status_code == 403 and denied.json()["error"]["type"] == "permission_error"
    stats = get("admin")
    assert stats.status_code == 200
    body = stats.json()
    assert set(body["tiers"]) == {"slot", "host", "disk"}
    assert set(body["stages"]) == {"fetch", "parse", "copy"}
    # slots are keyed by the exact version the router pinned
    assert body["residency"]["math@v1"] in {"slot", "host"}
    assert body["tiers"]["slot"]["loads"] >= 1 and body["stages"]["parse"]["count"] >= 1
    assert sum(body["counts"].values()) == len(body["residency"])
