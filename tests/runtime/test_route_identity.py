"""Route identities (prefix-cache key material): every part of a route's KV dependence changes
the key, equal inputs give equal keys, and the block chain depends on its parent."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import torch

from adapter_store.manifest import AdapterManifest, CompositionManifest, FileEntry
from molora_runtime.lora.composition import Composition, CompositionConfig
from molora_runtime.lora.peft_adapter import AdapterWeights
from molora_runtime.lora.route_identity import (
    AdapterKey,
    RouteIdentityCache,
    adapter_weights_sha256,
    base_route_identity,
    chain_block_hash,
    route_identity,
    route_key_parts,
)
from molora_runtime.routes import (
    BaseRoute,
    LearnedRoute,
    MixRoute,
    SingleRoute,
    VocabRange,
    VocabRoute,
)

BASE = "smollm2-135m-instruct|sha:abc|bf16"


def _weights(name: str, seed: int) -> AdapterWeights:
    g = torch.Generator().manual_seed(seed)
    w = AdapterWeights(name=name, rank=2)
    w.modules["q_proj"] = {0: (torch.randn(2, 4, generator=g), torch.randn(4, 2, generator=g))}
    return w


def _manifest(name: str, version: str, sha: str) -> AdapterManifest:
    return AdapterManifest(
        name=name, version=version, base_model="m", blob_dir="u-abcdefgh",
        created=datetime(2026, 1, 1, tzinfo=UTC), rank=2, alpha=4.0, target_modules=["q_proj"],
        num_layers=1, dtype="F32",
        files=[FileEntry(path="adapter_model.safetensors", sha256=sha * 64, size=10),
               FileEntry(path="adapter_config.json", sha256="c" * 64, size=5)],
    )  # fmt: skip


def _comp(name: str, experts: list[str], top_k: int = 1, temp: float = 1.0, seed: int = 0):
    cfg = CompositionConfig(
        base_model="m", adapters=experts, top_k=top_k, temperature=temp, num_layers=1,
        hidden_size=4,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    return Composition(name, cfg, torch.randn(1, len(experts), 4, generator=g), None)


@pytest.fixture
def cache() -> RouteIdentityCache:
    c = RouteIdentityCache(BASE)
    for i, ref in enumerate(["a", "b", "c", "a@v1", "a@v2"]):
        c.note_adapter(ref, _weights(ref.split("@")[0], i))
    c.note_composition("moe", _comp("moe", ["a", "b"], top_k=1, temp=1.0, seed=0))
    return c


def _key(cache: RouteIdentityCache, route) -> bytes:
    return cache.identity(route)


def test_equal_inputs_give_equal_keys(cache: RouteIdentityCache) -> None:
    other = RouteIdentityCache(BASE)
    for i, ref in enumerate(["a", "b", "c", "a@v1", "a@v2"]):
        other.note_adapter(ref, _weights(ref.split("@")[0], i))
    other.note_composition("moe", _comp("moe", ["a", "b"], top_k=1, temp=1.0, seed=0))
    for route in (
        BaseRoute(),
        SingleRoute(adapter="a"),
        MixRoute(weights={"a": 0.7, "b": 0.3}),
        VocabRoute(ranges=[VocabRange(start=0, end=10, adapter="a")], default="b"),
        LearnedRoute(composition="moe"),
    ):
        assert cache.identity(route) == other.identity(route)
        assert len(cache.identity(route)) == 32


def test_base_route_is_one_identity_per_base_model(cache: RouteIdentityCache) -> None:
    assert cache.identity(BaseRoute()) == base_route_identity(BASE)
    assert base_route_identity(BASE) != base_route_identity(BASE + "-other")
    other = RouteIdentityCache(BASE + "-other")
    other.note_adapter("a", _weights("a", 0))
    assert other.identity(SingleRoute(adapter="a")) != cache.identity(SingleRoute(adapter="a"))


def test_two_versions_of_one_name_differ(cache: RouteIdentityCache) -> None:
    assert _key(cache, SingleRoute(adapter="a@v1")) != _key(cache, SingleRoute(adapter="a@v2"))
    # same bytes, other version label: still different (the version is part of the key)
    c = RouteIdentityCache(BASE)
    c.note_adapter("a@v1", _weights("a", 9))
    c.note_adapter("a@v2", _weights("a", 9))
    assert c.identity(SingleRoute(adapter="a@v1")) != c.identity(SingleRoute(adapter="a@v2"))


def test_same_name_and_version_with_other_weights_differ() -> None:
    c1, c2 = RouteIdentityCache(BASE), RouteIdentityCache(BASE)
    c1.note_adapter("a@v1", _weights("a", 1))
    c2.note_adapter("a@v1", _weights("a", 2))
    assert c1.identity(SingleRoute(adapter="a@v1")) != c2.identity(SingleRoute(adapter="a@v1"))
    # one changed element is enough
    w = _weights("a", 1)
    before = adapter_weights_sha256(w)
    w.modules["q_proj"][0][1][0, 0] += 1e-6
    assert adapter_weights_sha256(w) != before


def test_manifest_checksums_are_the_weights_digest() -> None:
    c1, c2 = RouteIdentityCache(BASE), RouteIdentityCache(BASE)
    k1 = c1.note_adapter("a@v1", manifest=_manifest("a", "v1", "1"))
    k2 = c2.note_adapter("a@v1", manifest=_manifest("a", "v1", "2"))
    assert (k1.name, k1.version) == ("a", "v1") and k1.weights_sha256 != k2.weights_sha256
    assert c1.identity(SingleRoute(adapter="a@v1")) != c2.identity(SingleRoute(adapter="a@v1"))
    with pytest.raises(ValueError, match="manifest or its loaded weights"):
        c1.note_adapter("x")


def test_mix_weights_and_order(cache: RouteIdentityCache) -> None:
    m73 = MixRoute(weights={"a": 0.7, "b": 0.3})
    assert _key(cache, m73) != _key(cache, MixRoute(weights={"a": 0.6, "b": 0.4}))
    assert _key(cache, m73) != _key(cache, MixRoute(weights={"a": 0.7, "c": 0.3}))
    # slot order decides the fp32 summation order: a reordered mix is a different key
    assert _key(cache, m73) != _key(cache, MixRoute(weights={"b": 0.3, "a": 0.7}))
    # a single adapter is the same computation as a mix of one with weight 1
    assert _key(cache, SingleRoute(adapter="a")) == _key(cache, MixRoute(weights={"a": 1.0}))
    assert _key(cache, SingleRoute(adapter="a")) != _key(cache, MixRoute(weights={"a": 0.5}))


def test_vocab_tables(cache: RouteIdentityCache) -> None:
    def route(end: int = 10, adapter: str | None = "a", default: str | None = "b") -> VocabRoute:
        return VocabRoute(
            ranges=[VocabRange(start=0, end=end, adapter=adapter),
                    VocabRange(start=20, end=30, adapter="c")],
            default=default,
        )  # fmt: skip

    key = _key(cache, route())
    assert key != _key(cache, route(end=11))
    assert key != _key(cache, route(adapter="b"))
    assert key != _key(cache, route(adapter=None))
    assert key != _key(cache, route(default=None))
    assert key != _key(cache, route(default="c"))
    # ranges are disjoint and each token picks one: their listed order changes nothing
    swapped = VocabRoute(ranges=list(reversed(route().ranges)), default="b")
    assert key == _key(cache, swapped)


def test_compositions_over_the_same_experts(cache: RouteIdentityCache) -> None:
    learned = LearnedRoute(composition="moe")
    key = _key(cache, learned)
    variants = {
        "gates": _comp("moe", ["a", "b"], seed=1),
        "top_k": _comp("moe", ["a", "b"], top_k=2),
        "temperature": _comp("moe", ["a", "b"], temp=0.5),
        "expert order": _comp("moe", ["b", "a"]),
    }
    for what, comp in variants.items():
        c = RouteIdentityCache(BASE)
        c.note_adapter("a", _weights("a", 0))
        c.note_adapter("b", _weights("b", 1))
        c.note_composition("moe", comp)
        assert c.identity(learned) != key, what
    # request overrides count by their effective value
    assert _key(cache, LearnedRoute(composition="moe", top_k=2)) != key
    assert _key(cache, LearnedRoute(composition="moe", temperature=0.5)) != key
    assert _key(cache, LearnedRoute(composition="moe", top_k=1, temperature=1.0)) == key
    # an expert's weights are part of the composition's key
    c = RouteIdentityCache(BASE)
    c.note_adapter("a", _weights("a", 0))
    c.note_adapter("b", _weights("b", 5))
    c.note_composition("moe", _comp("moe", ["a", "b"], seed=0))
    assert c.identity(learned) != key
    # and a composition's version
    cache.note_composition("moe@v2", _comp("moe", ["a", "b"], seed=0))
    assert _key(cache, LearnedRoute(composition="moe@v2")) != key


def test_route_kinds_never_collide(cache: RouteIdentityCache) -> None:
    keys = {
        _key(cache, r)
        for r in (
            BaseRoute(),
            SingleRoute(adapter="a"),
            VocabRoute(ranges=[VocabRange(start=0, end=10, adapter="a")]),
            LearnedRoute(composition="moe"),
        )
    }
    assert len(keys) == 4


def test_key_parts_are_plain_values() -> None:
    """The engine can build the parts from its own lookups (no cache object needed)."""
    keys = {"a": AdapterKey("a", "v1", "0" * 64)}
    parts = route_key_parts(SingleRoute(adapter="a"), BASE, keys.__getitem__)
    assert parts.kind == "mix" and parts.mix[0].adapter == keys["a"]
    assert route_identity(parts) == route_identity(
        route_key_parts(SingleRoute(adapter="a"), BASE, keys.__getitem__)
    )
    with pytest.raises(ValueError, match="composition lookup"):
        route_key_parts(LearnedRoute(composition="moe"), BASE, keys.__getitem__)
    with pytest.raises(KeyError, match="no weights digest"):
        RouteIdentityCache(BASE).identity(SingleRoute(adapter="zz"))


def test_composition_manifest_is_the_gates_digest() -> None:
    def manifest(sha: str) -> CompositionManifest:
        return CompositionManifest(
            name="moe", version="v1", base_model="m", blob_dir="u-abcdefgh",
            created=datetime(2026, 1, 1, tzinfo=UTC), adapters=["a@v1", "b@v1"], top_k=1,
            temperature=1.0, num_layers=1, hidden_size=4,
            files=[FileEntry(path="gates.safetensors", sha256=sha * 64, size=1)],
        )  # fmt: skip

    keys = []
    for sha in ("1", "2"):
        c = RouteIdentityCache(BASE)
        c.note_adapter("a@v1", _weights("a", 0))
        c.note_adapter("b@v1", _weights("b", 1))
        k = c.note_composition("moe@v1", _comp("moe", ["a@v1", "b@v1"]), manifest=manifest(sha))
        keys.append(c.identity(LearnedRoute(composition="moe@v1")))
        assert (k.name, k.version) == ("moe", "v1")
    assert keys[0] != keys[1]


def test_block_chain() -> None:
    ida, idb = base_route_identity("x"), base_route_identity("y")
    first = chain_block_hash(None, ida, [1, 2, 3, 4])
    assert first == chain_block_hash(None, ida, [1, 2, 3, 4])
    assert first != chain_block_hash(None, idb, [1, 2, 3, 4])
    assert first != chain_block_hash(None, ida, [1, 2, 3, 5])
    assert first != chain_block_hash(None, ida, [2, 1, 3, 4])
    second = chain_block_hash(first, ida, [5, 6, 7, 8])
    other_parent = chain_block_hash(chain_block_hash(None, ida, [0, 2, 3, 4]), ida, [5, 6, 7, 8])
    assert second != other_parent
    assert second != chain_block_hash(None, ida, [5, 6, 7, 8])
    assert len(second) == 32
    # large ids and a tuple input hash the same as a list
    assert chain_block_hash(first, ida, (2**40, 0)) == chain_block_hash(first, ida, [2**40, 0])
