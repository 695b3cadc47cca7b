"""Placement over two tiers: a slot hit beats a host-tier hit beats a miss, within the load bound."""

from __future__ import annotations

from deployments.placement.affinity import ReplicaView, place


def test_host_hit_beats_a_miss():
    views = [
        ReplicaView("r0", frozenset(), load=0, host_set=frozenset()),
        ReplicaView("r1", frozenset(), load=1, host_set=frozenset({"a"})),
    ]
    decision = place(["a"], views, load_bound=4)
    assert decision.ranked[0] == "r1" and decision.outcome == "host"


def test_slot_hit_beats_a_host_hit():
    views = [
        ReplicaView("r0", frozenset(), load=0, host_set=frozenset({"a", "b"})),
        ReplicaView("r1", frozenset({"a"}), load=0, host_set=frozenset()),
    ]
    decision = place(["a", "b"], views)
    assert decision.ranked[0] == "r1" and decision.outcome == "affinity"


def test_host_tier_breaks_slot_ties():
    views = [
        ReplicaView("r0", frozenset({"a"}), load=0, host_set=frozenset({"a"})),
        ReplicaView("r1", frozenset({"a"}), load=0, host_set=frozenset({"a", "b"})),
    ]
    assert place(["a", "b"], views).ranked[0] == "r1"


def test_host_in_slot_counts_once():
    view = ReplicaView("r0", frozenset({"a@1"}), host_set=frozenset({"a", "b"}))
    assert view.overlap(frozenset({"a", "b"})) == 1
    assert view.host_overlap(frozenset({"a", "b"})) == 1


def test_host_hit_beyond_the_load_bound_spills():
    views = [
        ReplicaView("r0", frozenset(), load=10, host_set=frozenset({"a"})),
        ReplicaView("r1", frozenset(), load=1),
    ]
    decision = place(["a"], views, load_bound=4, load_bound_ratio=0.0)
    assert decision.ranked == ["r1", "r0"] and decision.outcome != "host"


def test_after_a_spill_the_parsed_copy_wins_over_the_cold_home():
    home = place(["a"], [ReplicaView("r0"), ReplicaView("r1"), ReplicaView("r2")]).ranked[0]
    other = next(r for r in ("r0", "r1", "r2") if r != home)
    views = [
        ReplicaView(
            r, frozenset(), load=0, host_set=frozenset({"a"}) if r == other else frozenset()
        )
        for r in ("r0", "r1", "r2")
    ]
    decision = place(["a"], views)
    assert decision.ranked[0] == other and decision.outcome == "host"
