"""Hot-set slot generations: every write of a slot gets a new generation, a slot held by a
running request keeps its generation (it is never rewritten under the request), and two versions
of one name are two keys, each in its own slot."""

from __future__ import annotations

import pytest

from molora_runtime.errors import HotSetFullError
from tests.molora_runtime.rt_util import request, run_to_completion


def test_generation_changes_on_every_write(tiny_engine_factory) -> None:
    hot = tiny_engine_factory(hot_set={"num_slots": 1}).hot_set
    assert hot.generation_of("a") == 0  # not resident
    hot.ensure(["a"])
    first = hot.generation_of("a")
    hot.ensure(["a"])  # a hit writes nothing
    assert hot.generation_of("a") == first
    hot.ensure(["b"])  # evicts a, rewrites the slot
    second = hot.generation_of("b")
    assert hot.generation_of("a") == 0 and second > first
    hot.ensure(["a"])  # a again: new weights in the slot, so a new generation
    assert hot.generation_of("a") > second and hot.generation_of("b") == 0


def test_a_held_slot_is_never_rewritten(tiny_engine_factory) -> None:
    engine = tiny_engine_factory(hot_set={"num_slots": 1})
    hot = engine.hot_set
    hot.ensure(["a"])
    hot.acquire(["a"])
    held = hot.generation_of("a")
    with pytest.raises(HotSetFullError):
        hot.ensure(["b"])  # the only slot is held: b must wait
    with pytest.raises(RuntimeError, match="held by a running request"):
        hot._load(hot.slot_of("a"), "b")  # even a direct write is refused
    assert hot.generation_of("a") == held and hot.loaded() == ["a"]
    hot.release(["a"])
    hot.ensure(["b"])
    assert hot.loaded() == ["b"]


def test_a_request_keeps_its_slot_generation_while_it_runs(tiny_engine_factory) -> None:
    """`a` decodes while `b` and `c` cycle through the other slot: a's generation never moves."""
    engine = tiny_engine_factory(hot_set={"num_slots": 2})
    seen: set[int] = set()

    def check(_step: int, eng) -> None:
        if any(s.request_id == "long" for s in eng.running):
            seen.add(eng.hot_set.generation_of("a"))

    reqs = [request("long", [9, 8, 7], "a", 20), request("b", [1, 2], "b", 3)]
    reqs.append(request("c", [3, 4], "c", 3))
    got = run_to_completion(engine, reqs, after_step=check)
    assert got["long"]["finish_reason"] == "length"
    assert len(seen) == 1 and seen != {0}
