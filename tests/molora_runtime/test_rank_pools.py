"""Rank pools in the engine: a hot-set whose adapters of ranks 4..32 sit in slots padded only to
their pool's rank returns PEFT's tokens, and the padded hot-set's tokens and logits, for mixed
batches, mixes across pools and learned routes whose experts sit in different pools; adapters
take the smallest pool that fits and never a pool too small; bad pool configs are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from molora_runtime.config import HotSetConfig
from molora_runtime.errors import HotSetFullError
from molora_runtime.routes import LearnedRoute, MixRoute
from tests.molora_runtime.rt_util import (
    engine_prefill_logits,
    make_peft_adapter,
    random_prompts,
    request,
    run_to_completion,
)
from tests.molora_runtime.test_peft_equality import BASE, peft_tokens
from tests.molora_runtime.test_static_decode import ROUTES, CountingRunner

# a: r=4, b: r=6, c: r=8 with one module at r=12 (rank_pattern), big: r=32.
POOLS = [{"rank": 4, "slots": 2}, {"rank": 8, "slots": 1}, {"rank": 32, "slots": 2}]
PADDED = {"num_slots": 5, "max_rank": 32}


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rank-pool-adapters")
    extra = {
        "big": make_peft_adapter(tiny_llama, root / "big", r=32, alpha=16, seed=9, std=0.05),
        "a2": make_peft_adapter(tiny_llama, root / "a2", r=4, alpha=8, seed=10),
    }
    return {**tiny_adapters, **extra}


@pytest.fixture(scope="module")
def peft_model(tiny_llama: Path, adapters: dict[str, Path]):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    pm = PeftModel.from_pretrained(base, str(adapters["a"]), adapter_name="a")
    for name in ("b", "c", "big"):
        pm.load_adapter(str(adapters[name]), adapter_name=name)
    return pm.eval()


def engines(factory, adapters, **kwargs):
    pooled = factory(adapters=adapters, hot_set={"rank_pools": POOLS}, **kwargs)
    padded = factory(adapters=adapters, hot_set=PADDED, **kwargs)
    return pooled, padded


def test_mixed_rank_batch_equals_peft_and_the_padded_layout(
    tiny_engine_factory, adapters, peft_model
) -> None:
    pooled, padded = engines(tiny_engine_factory, adapters)
    assert pooled.hot_set.backend.name.endswith("+rank-pools")
    routes = ["a", "big", "c", None, "b", "big", "a", "c"]
    prompts = random_prompts(len(routes), 256, [9], seed=12)
    expected = peft_tokens(peft_model, prompts, [r or BASE for r in routes], 12, None)
    reqs = [
        request(f"r{i}", p, r, 12) for i, (p, r) in enumerate(zip(prompts, routes, strict=True))
    ]
    got_pooled = run_to_completion(pooled, reqs)
    got_padded = run_to_completion(padded, reqs)
    for i, route in enumerate(routes):
        assert got_pooled[f"r{i}"]["tokens"] == expected[i], f"route {route}"
        assert got_padded[f"r{i}"]["tokens"] == expected[i], f"route {route}"
    assert len({tuple(t) for t in expected[:4]}) == 4  # the adapters change the output
    # each adapter sits in the smallest pool that fits it
    hot = pooled.hot_set
    pool_rank = {n: hot.slots.pool_of(hot.slot_of(n))[0].rank for n in ("a", "b", "c", "big")}
    assert pool_rank == {"a": 4, "b": 8, "c": 32, "big": 32}


def test_mix_across_pools_and_learned_route_equal_the_padded_layout(
    tiny_engine_factory, adapters
) -> None:
    """Rows whose top-k spans pools (a static mix, a learned top-2 over a, b, c whose experts
    sit in three pools) have the padded hot-set's logits and tokens."""
    pooled, padded = engines(tiny_engine_factory, adapters)
    routes = [
        MixRoute(weights={"a": 0.7, "big": 0.5}),
        MixRoute(weights={"b": 1.0, "c": -0.4, "big": 0.3}),
        LearnedRoute(composition="moe"),
        LearnedRoute(composition="moe", top_k=3, temperature=0.5),
    ]
    prompts = random_prompts(len(routes), 256, [11, 7], seed=13)
    for route, prompt in zip(routes, prompts, strict=True):
        torch.testing.assert_close(
            engine_prefill_logits(pooled, route, prompt),
            engine_prefill_logits(padded, route, prompt),
            atol=1e-5,
            rtol=1e-5,
        )
    reqs = [
        request(f"m{i}", p, r, 10) for i, (p, r) in enumerate(zip(prompts, routes, strict=True))
    ]
    got_pooled, got_padded = run_to_completion(pooled, reqs), run_to_completion(padded, reqs)
    for i in range(len(routes)):
        assert got_pooled[f"m{i}"]["tokens"] == got_padded[f"m{i}"]["tokens"]


def test_placement_by_rank_spill_and_eviction(tiny_engine_factory, adapters) -> None:
    engine = tiny_engine_factory(
        adapters=adapters,
        hot_set={"rank_pools": [{"rank": 4, "slots": 1}, {"rank": 16, "slots": 1}]},
    )
    hot = engine.hot_set
    for name in ("b", "c"):  # parsed in host memory: admission knows their ranks
        hot.loader.read(name)
    assert hot.ensure(["a"]) == {"a": 1}
    # a second r=4 adapter takes the big pool's free slot rather than evicting `a`
    assert hot.ensure(["a2"]) == {"a2": 2}
    hot.acquire(["a2"])
    # c (rank 12) fits only the big pool, whose one slot a running request holds
    assert not hot.can_hold(["c"])
    with pytest.raises(HotSetFullError, match="rank >= 12"):
        hot.ensure(["c"])
    assert hot.loaded() == ["a", "a2"]
    assert not hot.can_hold(["b"])  # b is r=6: the small pool is too small for it
    hot.release(["a2"])
    assert hot.can_hold(["c"])
    assert hot.ensure(["c"]) == {"c": 2}
    assert hot.loaded() == ["a", "c"]
    # asked together, the big adapter is placed first, so both fit
    hot.acquire(["a", "c"])
    assert not hot.can_hold(["a2"])
    hot.release(["a", "c"])
    assert hot.ensure(["a2", "c"]) == {"a2": 1, "c": 2}


def test_slot_memory_follows_pool_ranks(tiny_engine_factory, adapters) -> None:
    pooled, padded = engines(tiny_engine_factory, adapters)
    for engine in (pooled, padded):
        engine.hot_set.ensure(["a", "big"])
    p, q = pooled.hot_set.tier_report().tiers["slot"], padded.hot_set.tier_report().tiers["slot"]
    r4, r32 = pooled.hot_set.slots.slot_nbytes(1), pooled.hot_set.slots.slot_nbytes(5)
    assert r32 == padded.hot_set.slot_nbytes() and r4 * 8 == r32
    assert p.bytes == r4 + r32 and q.bytes == 2 * r32
    assert p.capacity_bytes == 2 * r4 + (r32 // 4) + 2 * r32 and q.capacity_bytes == 5 * r32


@pytest.mark.parametrize(
    ("hot", "message"),
    [
        ({"rank_pools": [{"rank": 8, "slots": 1}, {"rank": 8, "slots": 2}]}, "repeats a rank"),
        ({"rank_pools": [{"rank": 8, "slots": 2}], "num_slots": 3}, "num_slots=3"),
        ({"rank_pools": [{"rank": 8, "slots": 2}], "max_rank": 16}, "max_rank=16"),
        ({"rank_pools": [{"rank": 0, "slots": 2}]}, "greater than or equal to 1"),
        ({"rank_pools": [{"rank": 8, "slots": 0}]}, "greater than or equal to 1"),
        ({"rank_pools": [{"rank": 8}]}, "slots"),
        ({"rank_pools": [{"rank": 8, "slots": 1, "extra": 1}]}, "extra"),
        ({"rank_pools": [{"rank": 4, "slots": 1000}, {"rank": 8, "slots": 100}]}, "over 1024"),
    ],
)
def test_bad_pool_configs_are_refused(hot: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        HotSetConfig(**hot)


def test_adapter_above_every_pool_is_refused(tiny_engine_factory, adapters) -> None:
    engine = tiny_engine_factory(adapters=adapters, hot_set={"rank_pools": POOLS[:2]})
    assert engine.hot_set.config.max_rank == 8
    got = run_to_completion(
        engine, [request("x", [1, 2, 3], "big", 4), request("y", [1, 2], "a", 4)]
    )
    assert "rank 32" in (got["x"]["error"] or "") and "max_rank=8" in got["x"]["error"]
    assert got["y"]["finish_reason"] == "length" and not engine.hot_set.in_use()


def test_a_route_that_never_fits_the_pools_fails_alone(tiny_engine_factory, adapters) -> None:
    """c (rank 12) and big (rank 32) both need the one rank-32 slot: that request fails with
    the reason, the others run, nothing stays held."""
    pools = [{"rank": 4, "slots": 2}, {"rank": 32, "slots": 1}]
    engine = tiny_engine_factory(adapters=adapters, hot_set={"rank_pools": pools})
    reqs = [
        request("x", [1, 2, 3], MixRoute(weights={"c": 0.5, "big": 0.5}), 4),
        request("y", [4, 5], "a", 4),
        request("z", [6, 7], "big", 4),
    ]
    got = run_to_completion(engine, reqs)
    assert "ranks [12, 32]" in (got["x"]["error"] or ""), got["x"]
    assert "1 of rank 32" in got["x"]["error"]
    assert got["y"]["finish_reason"] == got["z"]["finish_reason"] == "length"
    assert not engine.hot_set.in_use()
    with pytest.raises(HotSetFullError, match="rank pools"):  # now judged before any load
        engine.hot_set.can_hold(["c", "big"])


def test_static_decode_over_pools_equals_eager(tiny_engine_factory) -> None:
    """The static-shape decode step (the CUDA graph's, run eagerly here: every slot of every
    pool, padded rows) over rank pools gives the eager pooled path's tokens."""
    hot = {
        "rank_pools": [{"rank": 4, "slots": 1}, {"rank": 8, "slots": 1}, {"rank": 16, "slots": 2}]
    }
    prompts = random_prompts(len(ROUTES), 256, [5, 9, 14, 3], seed=18)
    reqs = [request(f"s{i}", p, r, 8) for i, (p, r) in enumerate(zip(prompts, ROUTES, strict=True))]
    eager = run_to_completion(tiny_engine_factory(max_num_seqs=8, hot_set=hot), reqs)
    engine = tiny_engine_factory(max_num_seqs=8, hot_set=hot)
    engine.graph_runner = runner = CountingRunner(engine)
    static = run_to_completion(engine, reqs)
    assert runner.sizes and {3, 5, 6, 7} & set(runner.sizes)
    for i in range(len(reqs)):
        assert static[f"s{i}"]["tokens"] == eager[f"s{i}"]["tokens"], ROUTES[i]
