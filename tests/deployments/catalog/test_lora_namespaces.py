"""Per-tenant adapter names: `load_lora_adapter` / `unload_lora_adapter` with another tenant's
private name answer exactly as for a name that does not exist, and the caller gets its own
adapter under that name without touching the other's (no Ray: the store and the catalog view)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapter_store.errors import InvalidInputError
from deployments.access.tenancy import visible_catalog
from deployments.catalog.lora_admin import (
    LoadLoraBody,
    LoraAdminError,
    UnloadLoraBody,
    load_lora,
    unload_lora,
)
from deployments.catalog.model_names import Catalog, Resolver
from deployments.catalog.store import load_catalog
from deployments.config import ServeConfig, StoreConfig
from tests.deployments.serve_helpers import adapter_files, store_copy


@pytest.fixture
def store_env(tiny_assets, tmp_path):
    from adapter_store import open_registry

    store = store_copy(tiny_assets, tmp_path)
    registry = open_registry(str(store))
    folder = adapter_files(store)
    registry.publish_adapter(folder, "secret", "v1", tenant="acme")  # a plain private name
    base = json.loads((tiny_assets["model"] / "config.json").read_text())
    return {"cfg": StoreConfig(url=str(store)), "registry": registry, "base": base}


def _answer(fn, *args) -> tuple[int, str | None, str] | dict:
    """A call's outcome as a client sees it, with the asked name replaced by NAME."""
    try:
        result = fn(*args)
    except LoraAdminError as exc:
        return exc.status, exc.param, exc.message.replace(repr(args[-1].lora_name), "NAME")
    dumped = result.model_dump()
    dumped["message"] = dumped["message"].replace(args[-1].lora_name, "NAME")
    return {**dumped, "name": "NAME"}


def test_another_tenants_name_answers_like_a_missing_one(store_env) -> None:
    cfg, base, registry = store_env["cfg"], store_env["base"], store_env["registry"]
    before = registry.versions("adapter", "secret")
    # unload: acme's private name and a name that never existed give the same 404
    taken = _answer(unload_lora, cfg, "evil", UnloadLoraBody(lora_name="secret"))
    ghost = _answer(unload_lora, cfg, "evil", UnloadLoraBody(lora_name="ghost"))
    assert taken == ghost and taken[0] == 404
    # load: both succeed the same way, into evil's own namespace
    load = [
        _answer(load_lora, cfg, None, base, "evil", LoadLoraBody(lora_name=n, lora_path=p))
        for n, p in (("secret", "store:code"), ("ghost", "store:code"))
    ]
    assert load[0] == load[1] and load[0]["versions"] == ["v1"]
    assert registry.versions("adapter", "secret") == before  # acme's name untouched
    assert registry.resolve("adapter", "evil~secret").tenant == "evil"
    # evil unloads its own `secret`; acme's stays live
    assert unload_lora(cfg, "evil", UnloadLoraBody(lora_name="secret")).versions == ["v1"]
    assert registry.resolve("adapter", "secret").tenant == "acme"
    # acme still manages its plain name from before namespaces, in place
    again = load_lora(
        cfg, None, base, "acme", LoadLoraBody(lora_name="secret", lora_path="store:poem",
                                              load_inplace=True),
    )  # fmt: skip
    assert again.versions == ["v2"] and registry.owner("adapter", "secret") == "acme"
    # a caller without a tenant cannot write a tenant's plain name (auth off: no tenants)
    with pytest.raises(LoraAdminError) as err:
        load_lora(cfg, None, base, None, LoadLoraBody(lora_name="secret", lora_path="store:x"))
    assert err.value.status == 400


def test_store_paths_of_another_tenant_resolve_like_missing(store_env) -> None:
    cfg, base = store_env["cfg"], store_env["base"]
    taken = _answer(
        load_lora, cfg, None, base, "evil", LoadLoraBody(lora_name="a", lora_path="store:secret")
    )
    ghost = _answer(
        load_lora, cfg, None, base, "evil", LoadLoraBody(lora_name="a", lora_path="store:nope")
    )
    assert taken[0] == ghost[0] == 404 and taken[1] == ghost[1] == "lora_path"
    # a namespaced name is not a name a caller can write
    for bad in ("acme~secret", "evil~x"):
        with pytest.raises(LoraAdminError) as err:
            load_lora(cfg, None, base, "evil", LoadLoraBody(lora_name=bad, lora_path="store:code"))
        assert err.value.status == 400 and err.value.param == "lora_name"


def test_namespaces_belong_to_their_tenant(store_env) -> None:
    registry = store_env["registry"]
    math = registry.resolve("adapter", "math")
    files = Path(store_env["cfg"].url) / "adapters" / "math" / math.version / math.blob_dir
    for name, tenant in (("acme~mine", "evil"), ("acme~mine", None), ("~x", "acme")):
        with pytest.raises(InvalidInputError):
            registry.publish_adapter(files, name, "v1", tenant=tenant)
    assert registry.versions("adapter", "acme~mine") == []


def test_catalog_view_names_own_adapters_plainly_and_shadows_public(store_env) -> None:
    cfg, base = store_env["cfg"], store_env["base"]
    load_lora(cfg, None, base, "evil", LoadLoraBody(lora_name="math", lora_path="store:code"))
    catalog = load_catalog(cfg)
    assert "evil~math" in catalog.adapters and catalog.adapters["evil~math"].tenant == "evil"
    serve = ServeConfig.model_validate({"engine": {"model": "tiny"}})
    routes = {}
    for tenant in ("evil", "acme", None):
        view = visible_catalog(catalog, tenant)
        assert not any("~" in n for n in view.adapters)
        routes[tenant] = Resolver(serve, view).resolve("math").route.adapter
    assert routes == {"evil": "evil~math@v1", "acme": "math@v1", None: "math@v1"}
    assert "secret" in visible_catalog(catalog, "acme").adapters
    assert "secret" not in visible_catalog(catalog, "evil").adapters
    # another tenant's store name, written out, is as unknown as a missing name
    empty = Resolver(serve, visible_catalog(Catalog(), "acme"))
    for resolver in (Resolver(serve, visible_catalog(catalog, "acme")), empty):
        with pytest.raises(LookupError):
            resolver.resolve("evil~math")


def test_responses_name_the_callers_own_adapters_plainly(store_env) -> None:
    cfg, base = store_env["cfg"], store_env["base"]
    load_lora(cfg, None, base, "evil", LoadLoraBody(lora_name="mine", lora_path="store:code"))
    serve = ServeConfig.model_validate({"engine": {"model": "tiny"}})
    resolver = Resolver(serve, visible_catalog(load_catalog(cfg), "evil"))
    resolved = resolver.resolve("mine")
    assert resolved.route.adapter == "evil~mine@v1" and resolved.versions == ["mine@v1"]
    assert resolver.resolve("mine:0.5+math:0.5").versions == ["mine@v1", "math@v1"]
