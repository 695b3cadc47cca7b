"""Prefix caching keyed by route identity: greedy tokens are the same with cache hits and misses,
every route kind hits its own blocks, and routes that differ in any part of their identity
(adapter version, composition gates) never share a block."""

from __future__ import annotations

from pathlib import Path

import pytest

from molora_runtime.routes import LearnedRoute, MixRoute, VocabRoute
from tests.molora_runtime.rt_util import (
    make_composition,
    random_prompts,
    request,
    run_to_completion,
)

BS = 4
VOCAB = VocabRoute(ranges=[{"start": 0, "end": 128, "adapter": "b"}], default="c")
ROUTES = {
    "base": None,
    "single": "a",
    "mix": MixRoute(weights={"a": 0.5, "c": 0.5}),
    "vocab": VOCAB,
    "learned": LearnedRoute(composition="moe"),
}


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    """A 21-token shared prefix, then different suffixes."""
    shared = random_prompts(1, 256, [21], seed=3)[0]
    tails = random_prompts(3, 256, [6, 3, 9], seed=4)
    return {"p1": shared + tails[0], "p2": shared + tails[1], "p3": shared[:9] + tails[2]}


def _kv(engine):
    return engine.stats().kv


@pytest.mark.parametrize("kind", list(ROUTES))
def test_hits_give_the_same_greedy_tokens_as_misses(kind, tiny_engine_factory, prompts) -> None:
    route = ROUTES[kind]
    reqs = [request(rid, p, route, 7) for rid, p in prompts.items()]
    cold = {}
    for req in reqs:  # every request alone, no prefix cache
        engine = tiny_engine_factory(kv_block_size=BS, enable_prefix_caching=False)
        cold[req.request_id] = run_to_completion(engine, [req])[req.request_id]["tokens"]
    engine = tiny_engine_factory(kv_block_size=BS)
    warm = {}
    for req in reqs:  # one after another on one engine: p2 and p3 reuse p1's prefix blocks
        warm.update(run_to_completion(engine, [req]))
    for rid, tokens in cold.items():
        assert warm[rid]["tokens"] == tokens, rid
    stats = _kv(engine)
    # p2 reuses the shared prefix's 5 full blocks (20 tokens), p3 its first 2 (8 tokens)
    assert stats.prefix_hit_tokens == 20 + 8
    assert stats.blocks_used == 0 and stats.blocks_cached > 0
    # the same requests again, concurrently, still equal (hits, and registration under load)
    again = run_to_completion(
        engine, [request(f"x-{r.request_id}", r.prompt_token_ids, route, 7) for r in reqs]
    )
    for rid, tokens in cold.items():
        assert again[f"x-{rid}"]["tokens"] == tokens, rid


def test_base_blocks_are_shared_by_every_base_request(tiny_engine_factory, prompts) -> None:
    engine = tiny_engine_factory(kv_block_size=BS)
    run_to_completion(engine, [request("one", prompts["p1"], None, 3)])
    run_to_completion(engine, [request("two", prompts["p2"], None, 3)])
    assert _kv(engine).prefix_hit_tokens == 20
    # a single-adapter request with the same prompt shares none of them
    run_to_completion(engine, [request("three", prompts["p2"], "a", 3)])
    assert _kv(engine).prefix_hit_tokens == 20


def test_two_versions_of_one_adapter_name_never_share(
    tiny_engine_factory, tiny_adapters, prompts
) -> None:
    """`x@1` and `x@2` (different weights) with the same prompt: the second misses."""
    adapters = {**tiny_adapters, "x@1": tiny_adapters["a"], "x@2": tiny_adapters["b"]}
    engine = tiny_engine_factory(kv_block_size=BS, adapters=adapters)
    first = run_to_completion(engine, [request("v1", prompts["p1"], "x@1", 6)])["v1"]
    second = run_to_completion(engine, [request("v2", prompts["p1"], "x@2", 6)])["v2"]
    assert _kv(engine).prefix_hit_tokens == 0
    fresh = tiny_engine_factory(kv_block_size=BS, adapters=adapters, enable_prefix_caching=False)
    assert (
        second["tokens"]
        == run_to_completion(fresh, [request("v2", prompts["p1"], "x@2", 6)])["v2"]["tokens"]
    )
    assert first["tokens"] != second["tokens"]


def test_compositions_over_the_same_experts_with_different_gates_never_share(
    tiny_llama: Path, tiny_engine_factory, tiny_composition, prompts, tmp_path: Path
) -> None:
    other = make_composition(
        tiny_llama, tmp_path / "moe2", ["a", "b", "c"], top_k=2, temperature=0.7, seed=6
    )
    comps = {"moe": tiny_composition, "moe2": other}
    engine = tiny_engine_factory(kv_block_size=BS, compositions=comps)
    run_to_completion(engine, [request("g1", prompts["p1"], LearnedRoute(composition="moe"), 5)])
    got = run_to_completion(
        engine, [request("g2", prompts["p1"], LearnedRoute(composition="moe2"), 5)]
    )["g2"]
    assert _kv(engine).prefix_hit_tokens == 0
    # nor the same composition with another top-k or temperature
    for route in (
        LearnedRoute(composition="moe", top_k=1),
        LearnedRoute(composition="moe", temperature=2.0),
    ):
        run_to_completion(engine, [request("g3", prompts["p1"], route, 2)])
        assert _kv(engine).prefix_hit_tokens == 0
    fresh = tiny_engine_factory(kv_block_size=BS, compositions=comps, enable_prefix_caching=False)
    want = run_to_completion(
        fresh, [request("g2", prompts["p1"], LearnedRoute(composition="moe2"), 5)]
    )["g2"]
    assert got["tokens"] == want["tokens"]
