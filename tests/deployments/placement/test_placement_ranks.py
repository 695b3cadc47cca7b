"""Placement aware of rank pools: pure `place` over replica views (no Ray)."""

from __future__ import annotations

import pytest

from deployments.catalog import rank_hints
from deployments.placement.affinity import ReplicaView, place, rendezvous_order
from deployments.placement.rank_fit import EVICT, FREE, WAIT, PoolView, fit, occupy, parse_pools

SMALL = (PoolView(8, 4, free=4),)  # only rank-8 slots
MIXED = (PoolView(8, 4, free=4), PoolView(32, 1, free=1))
RANKS = {"big": 32, "tiny": 4, "mid": 16, "huge": 64}


def homes(key: str) -> tuple[str, str]:
    """Two replica ids, the first the rendezvous home of `key` (so a test beats the hash)."""
    first, second = rendezvous_order(key, ["r0", "r1"])
    return first, second


def test_a_rank_32_adapter_never_goes_where_only_rank_8_slots_are():
    home, other = homes("big")
    views = [ReplicaView(home, pools=SMALL), ReplicaView(other, pools=MIXED)]
    decision = place(["big"], views, ranks=RANKS)
    assert decision.ranked == [other, home]


def test_cannot_hold_loses_even_to_an_overloaded_replica():
    home, other = homes("big")
    views = [
        ReplicaView(home, pools=SMALL, load=0),
        ReplicaView(other, pools=MIXED, load=30, capacity=32),
    ]
    assert place(["big"], views, load_bound=1, ranks=RANKS).ranked[0] == other


def test_a_small_adapter_keeps_the_last_big_slot_free():
    home, other = homes("tiny")
    one_big_left = (PoolView(8, 2, free=0), PoolView(64, 1, free=1))
    views = [ReplicaView(home, pools=one_big_left), ReplicaView(other, pools=SMALL)]
    decision = place(["tiny"], views, ranks=RANKS)
    assert decision.ranked == [other, home]


def test_a_free_slot_beats_an_eviction_beats_a_wait():
    evict = (PoolView(32, 1, free=0, evictable=1),)
    wait = (PoolView(32, 1, free=0, evictable=0),)
    free = (PoolView(64, 1, free=1),)
    for order in (["a", "b", "c"], ["c", "b", "a"]):
        pools = dict(zip(order, (wait, evict, free), strict=True))
        views = [ReplicaView(rid, pools=pools[rid]) for rid in order]
        # Even a bigger pool's free slot beats evicting someone in a snug pool.
        assert place(["big"], views, ranks=RANKS).ranked == [order[2], order[1], order[0]]


def test_resident_beats_a_better_fitting_free_slot():
    home, other = homes("tiny")
    holder = ReplicaView(other, hot_set=frozenset({"tiny"}), pools=(PoolView(64, 1),))
    views = [ReplicaView(home, pools=SMALL), holder]
    decision = place(["tiny"], views, ranks=RANKS)
    assert decision.ranked[0] == other and decision.outcome == "affinity"


def test_unknown_rank_or_no_pools_places_exactly_as_before():
    views = [
        ReplicaView("r0", frozenset({"x"}), load=2, slots=2),
        ReplicaView("r1", frozenset(), load=0, slots=4),
        ReplicaView("r2", frozenset({"y", "z"}), load=1, slots=2),
        ReplicaView("r3", frozenset(), load=5, slots=1),
    ]
    for wanted in (["big"], ["tiny", "x"], ["q"], ["y", "big"], []):
        before = place(wanted, views)
        assert place(wanted, views, ranks=RANKS) == before  # padded: no pools reported
        pooled = [
            ReplicaView(v.replica_id, v.hot_set, v.load, slots=v.slots, pools=MIXED) for v in views
        ]
        assert place(wanted, pooled, ranks={}) == place(wanted, pooled)
        assert place(wanted, pooled).ranked == before.ranked


def test_the_cannot_hold_rule_needs_a_replica_that_can():
    views = [ReplicaView("r0", pools=SMALL), ReplicaView("r1", pools=SMALL)]
    assert place(["huge"], views, ranks=RANKS) == place(["huge"], views)


def test_a_set_needing_more_big_slots_than_a_replica_has():
    two_big = (PoolView(8, 4, free=4), PoolView(32, 2, free=2))
    home, other = homes("big+mid")
    views = [ReplicaView(home, pools=MIXED), ReplicaView(other, pools=two_big)]
    assert place(["big", "mid"], views, ranks=RANKS).ranked[0] == other


def test_resident_adapters_of_the_set_keep_their_slots():
    """`big` sits in x's only rank-32 slot and stays there: `big2` cannot join it on x."""
    home, other = homes("big+big2")
    one_big = (PoolView(8, 2, free=2), PoolView(32, 1, free=0, evictable=1))
    views = [
        ReplicaView(home, frozenset({"big"}), pools=one_big),
        ReplicaView(other, pools=(PoolView(32, 2, free=2),)),
    ]
    assert place(["big", "big2"], views, ranks={**RANKS, "big2": 32}).ranked[0] == other


def test_fit_follows_the_hot_set_rule():
    pools = (PoolView(8, 1, free=0, evictable=1), PoolView(32, 1, free=1))
    # Largest first: big takes the free 32 slot; tiny then evicts in the 8 pool.
    assert fit(pools, [4, 32]) == fit(pools, [32, 4])
    got = fit(pools, [4, 32])
    assert (got.cannot, got.cost, got.taken) == (False, EVICT, 40)
    assert fit(pools, [4]).cost == FREE  # a free bigger slot before an eviction
    assert fit(pools, [64]).cannot
    assert fit(pools, [16, 16]).cannot  # one slot of rank >= 16
    assert fit((PoolView(8, 1),), [4]).cost == WAIT


def test_recent_placements_take_slots_until_reported():
    pools = parse_pools([[32, 1, 1, 0], [8, 1, 1, 0]])
    assert [p.rank for p in pools] == [8, 32]
    once = occupy(pools, 4)
    assert [(p.free, p.evictable) for p in once] == [(0, 0), (1, 0)]
    twice = occupy(once, 4)
    assert [(p.free, p.evictable) for p in twice] == [(0, 0), (0, 0)]
    assert occupy(twice, 4) == twice  # nothing left: unchanged (the replica will queue it)


@pytest.mark.parametrize(
    "report",
    [
        None,
        "8:4",
        [[8, 4, 4]],
        [[8, 4, 5, 0]],
        [[0, 4, 0, 0]],
        [[8, 4, True, 0]],
        [[8, 4, -1, 0]],
        [[8.0, 4, 1, 0]],
        [[8, 1, 0, 0]] * 17,
    ],
)
def test_a_malformed_pool_report_reads_as_no_pools(report):
    assert parse_pools(report) == ()


def test_catalog_ranks_are_replaced_whole():
    rank_hints.publish({"a": 8, "b": 64})
    assert rank_hints.catalog_rank("b") == 64
    rank_hints.publish({"a": 16})
    assert (rank_hints.catalog_rank("a"), rank_hints.catalog_rank("b")) == (16, None)
    rank_hints.publish({})
