"""Admission pins every ref to one live version of the store's catalog (local and S3): a bare
name means the latest live version, a new version or an in-place load moves it at once, and a
yanked version is not found even when a request names it."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapter_store import Registry
from deployments.catalog.lora_admin import LoadLoraBody, load_lora
from deployments.catalog.model_names import BadModelName, ModelNotFound, Resolver
from deployments.catalog.store import load_catalog
from deployments.config import ServeConfig, StoreConfig
from deployments.replica.deployment import pin_versions
from molora_runtime.routes import MixRoute, VocabRoute


def _resolver(url: str) -> Resolver:
    return Resolver(ServeConfig.from_args({"served_model_name": "base"}), load_catalog(_cfg(url)))


def _cfg(url: str) -> StoreConfig:
    return StoreConfig(url=url)


def test_bare_names_pin_to_the_latest_live_version(
    registry: Registry, store_url: str, alpha: Path, beta: Path, base_config: dict
) -> None:
    registry.publish_adapter(alpha, "n0", "v1", base_config=base_config)
    got = _resolver(store_url).resolve("n0")
    assert got.route.adapter == "n0@v1" and got.versions == ["n0@v1"]
    assert got.placement_adapters == ("n0",)
    registry.publish_adapter(beta, "n0", "v2", base_config=base_config)
    assert _resolver(store_url).resolve("n0").route.adapter == "n0@v2"
    assert _resolver(store_url).resolve("n0@v1").route.adapter == "n0@v1"
    # Yanked: never resolved again, by bare name or by its exact version.
    registry.yank("adapter", "n0", "v2", "leaked")
    resolver = _resolver(store_url)
    assert resolver.resolve("n0").route.adapter == "n0@v1"
    with pytest.raises(ModelNotFound, match="yanked or never published"):
        resolver.resolve("n0@v2")
    registry.yank("adapter", "n0", "v1")
    with pytest.raises(ModelNotFound):
        _resolver(store_url).resolve("n0")
    registry.unyank("adapter", "n0", "v2")
    assert _resolver(store_url).resolve("n0").route.adapter == "n0@v2"


def test_every_route_kind_is_pinned(
    registry: Registry, store_url: str, alpha: Path, beta: Path, base_config: dict
) -> None:
    registry.publish_adapter(alpha, "a", "v1", base_config=base_config)
    registry.publish_adapter(beta, "b", "v3", base_config=base_config)
    resolver = _resolver(store_url)
    mix = resolver.resolve("a:0.5+b:0.5")
    assert isinstance(mix.route, MixRoute) and set(mix.route.weights) == {"a@v1", "b@v3"}
    with pytest.raises(BadModelName, match="twice"):  # a and a@v1 are one version
        resolver.resolve("a:0.5+a@v1:0.5")
    vocab = VocabRoute.model_validate(
        {"ranges": [{"start": 0, "end": 10, "adapter": "a"}], "default": "b"}
    )
    pinned = resolver.resolve("base", vocab).route
    assert pinned.ranges[0].adapter == "a@v1" and pinned.default == "b@v3"
    assert sorted(resolver.resolve("base", vocab).versions) == ["a@v1", "b@v3"]


def test_in_place_load_of_a_store_version_leaves_only_it_live(
    registry: Registry, store_url: str, alpha: Path, beta: Path, base_config: dict
) -> None:
    registry.publish_adapter(alpha, "n0", "v1", base_config=base_config)
    registry.publish_adapter(beta, "n0", "v2", base_config=base_config)
    body = LoadLoraBody(lora_name="n0", lora_path="store:n0@v1", load_inplace=True)
    assert load_lora(_cfg(store_url), None, base_config, None, body).versions == ["v1"]
    assert _resolver(store_url).resolve("n0").route.adapter == "n0@v1"
    assert [v.version for v in registry.versions("adapter", "n0") if not v.yanked] == ["v1"]
    # In place from another name publishes a new version; the old ones are yanked.
    registry.publish_adapter(beta, "other", "v1", base_config=base_config)
    body = LoadLoraBody(lora_name="n0", lora_path="store:other", load_inplace=True)
    new = load_lora(_cfg(store_url), None, base_config, None, body).versions[0]
    assert _resolver(store_url).resolve("n0").route.adapter == f"n0@{new}"
    with pytest.raises(ModelNotFound):
        _resolver(store_url).resolve("n0@v1")
    assert _resolver(store_url).resolve("n0").versions == [f"n0@{new}"]


def test_replica_pins_hot_set_pins_to_the_live_version(
    registry: Registry, source, alpha: Path, beta: Path, base_config: dict
) -> None:
    registry.publish_adapter(alpha, "n0", "v1", base_config=base_config)
    registry.publish_adapter(beta, "n0", "v2", base_config=base_config)
    cfg = ServeConfig.from_args(
        {"served_model_name": "base", "engine": {"hot_set": {"pinned": ["n0", "n0@v1", "ghost"]}}}
    )
    pin_versions(cfg, source)
    # Requests arrive as n0@v2: the pin must be that key; a missing name is left for the
    # hot-set to report.
    assert cfg.engine.hot_set.pinned == ["n0@v2", "n0@v1", "ghost"]
