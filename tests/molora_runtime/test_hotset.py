"""Hot-set: LRU eviction order, in-use adapters never evicted, pinning, more adapters queued than
slots (requests held, outputs equal a roomy run), and routes that can never fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from molora_runtime.errors import InvalidRequestError
from molora_runtime.routes import LearnedRoute, MixRoute
from tests.molora_runtime.rt_util import (
    make_composition,
    random_prompts,
    request,
    run_to_completion,
)


def test_eviction_order_fewest_uses_then_least_recent(tiny_engine_factory) -> None:
    engine = tiny_engine_factory(hot_set={"num_slots": 2})
    hot = engine.hot_set
    hot.ensure(["a"])
    hot.ensure(["b"])
    hot.ensure(["a"])  # a: two uses, b: one
    hot.ensure(["c"])  # evicts b, the fewest uses
    assert hot.loaded() == ["a", "c"]
    hot.ensure(["b"])  # b's uses count while it was out: two, as a; c has one and goes
    assert hot.loaded() == ["a", "b"]
    stats = engine.stats()
    assert (stats.hot_set_evictions, stats.hot_set_loads, stats.hot_set_hits) == (2, 4, 1)
    assert stats.free_slots == 0 and stats.num_slots == 2


def test_a_popular_adapter_keeps_its_slot_through_a_run_of_tail_adapters(
    tiny_engine_factory,
) -> None:
    engine = tiny_engine_factory(hot_set={"num_slots": 2})
    hot = engine.hot_set
    for _ in range(3):
        hot.ensure(["a"])  # a: three uses
    for tail in ["b", "c", "b", "c"]:
        hot.ensure([tail])  # least recently used would evict `a` at the first c
        assert hot.loaded() == ["a", tail]
    assert engine.stats().hot_set_evictions == 3


def test_lru_through_requests(tiny_engine_factory) -> None:
    engine = tiny_engine_factory(hot_set={"num_slots": 2})
    for name in ["a", "b", "a", "c"]:
        run_to_completion(engine, [request(name, [1, 2, 3], name, 2)])
    assert engine.hot_set.loaded() == ["a", "c"]
    assert engine.stats().hot_set_evictions == 1


def test_running_adapter_is_never_evicted(tiny_engine_factory) -> None:
    """`a` decodes for 30 steps while b, c, mix(b, c) and c again cycle through the only other
    slot (mix waits until both of its adapters fit); `a` stays resident throughout."""
    engine = tiny_engine_factory(hot_set={"num_slots": 3})
    long = request("long", [9, 8, 7], "a", 30)
    others = [
        request("b1", [1, 2], "b", 3),
        request("c1", [3, 4], "c", 3),
        request("mix", [5, 6], MixRoute(weights={"b": 0.5, "c": 0.5}), 3),
    ]
    engine2 = tiny_engine_factory(hot_set={"num_slots": 1})
    seen = []

    def check(_step: int, eng) -> None:
        if any(s.request_id == "long" for s in eng.running):
            assert "a" in eng.hot_set.loaded()
            assert "a" in eng.hot_set.in_use()
        seen.append(eng.hot_set.loaded())

    got = run_to_completion(engine, [long, *others], after_step=check)
    assert all(got[r.request_id]["finish_reason"] == "length" for r in [long, *others])
    # with a single slot the same requests run one adapter at a time
    check_one = []
    got1 = run_to_completion(
        engine2, [long, *others[:2]], after_step=lambda s, e: check_one.append(e.hot_set.loaded())
    )
    assert got1["long"]["tokens"] == got["long"]["tokens"]
    assert all(len(x) <= 1 for x in check_one)


def test_pinned_adapter_survives_pressure(tiny_engine_factory) -> None:
    engine = tiny_engine_factory(hot_set={"num_slots": 2, "pinned": ["c"]})
    assert engine.stats().pinned == ["c"] and engine.hot_set.loaded() == ["c"]
    for name in ["a", "b", "a", "b"]:
        run_to_completion(engine, [request(name, [1, 2, 3], name, 2)])
        assert "c" in engine.hot_set.loaded()
    assert engine.stats().hot_set_evictions == 3  # a and b took turns in the one free slot
    engine.hot_set.unpin("c")
    run_to_completion(engine, [request("a", [1, 2, 3], "a", 2)])
    run_to_completion(engine, [request("x", [1, 2, 3], MixRoute(weights={"a": 1, "b": 1}), 2)])
    assert engine.hot_set.loaded() == ["a", "b"]  # c is an ordinary adapter now


MANY_ROUTES = [
    "a",
    "b",
    "c",
    MixRoute(weights={"a": 0.3, "b": 0.7}),
    "c",
    LearnedRoute(composition="moe"),
    None,
    MixRoute(weights={"c": 1.0, "b": -0.5}),
    "b",
    "a",
]


@pytest.mark.parametrize("slots", [2, 3])
def test_more_adapters_queued_than_slots(
    slots: int, tiny_engine_factory, tiny_llama: Path, tiny_composition: Path, tmp_path: Path
) -> None:
    """Ten requests over a, b, c, mixes and two compositions; 2 or 3 adapter slots and a single
    composition slot: requests are held until slots free up, and all finish with the tokens of a
    run with plenty of slots."""
    moe2 = make_composition(tiny_llama, tmp_path / "moe2", ["a", "b"], top_k=1, seed=3)
    comps = {"moe": tiny_composition, "moe2": moe2}
    routes = list(MANY_ROUTES)
    routes.append(LearnedRoute(composition="moe2"))
    if slots == 2:  # "moe" has 3 experts: it cannot fit 2 slots
        routes = [LearnedRoute(composition="moe2") if r == routes[5] else r for r in routes]
    prompts = random_prompts(len(routes), 256, [6, 11, 4, 9], seed=5)
    reqs = [request(f"r{i}", p, r, 6) for i, (p, r) in enumerate(zip(prompts, routes, strict=True))]
    roomy = tiny_engine_factory(compositions=comps, hot_set={"num_slots": 8})
    tight = tiny_engine_factory(
        compositions=comps, hot_set={"num_slots": slots, "max_compositions": 1}
    )
    expected = run_to_completion(roomy, reqs)
    held = []
    got = run_to_completion(tight, reqs, after_step=lambda s, e: held.append(len(e.waiting)))
    for i in range(len(reqs)):
        assert got[f"r{i}"]["finish_reason"] == "length", got[f"r{i}"]["error"]
        assert got[f"r{i}"]["tokens"] == expected[f"r{i}"]["tokens"]
    assert max(held) > 0  # some requests really had to wait for slots
    assert tight.stats().hot_set_evictions > 0 or slots == 3  # 3 slots hold a, b, c at once
    assert not tight.hot_set.in_use()


def test_route_needing_more_adapters_than_slots(tiny_engine_factory) -> None:
    engine = tiny_engine_factory(hot_set={"num_slots": 2})
    with pytest.raises(InvalidRequestError, match="needs 3 adapters at once but the hot-set has 2"):
        engine.add_request(request("x", [1, 2], MixRoute(weights={"a": 1, "b": 1, "c": 1}), 4))
    # a composition over 3 experts cannot fit 2 slots either: refused up front, not left to fail
    with pytest.raises(InvalidRequestError, match="needs 3 adapters at once but the hot-set has 2"):
        engine.add_request(request("y", [1, 2], LearnedRoute(composition="moe"), 4))
    assert not engine.has_work()
