"""Placement by demand: `DemandTracker` counts each adapter set's share of recent requests with
an exponential decay, and `place` keeps a cold set (well under one replica's part of the traffic)
on the replica holding it up to twice the load bound, where a hot set spills as before."""

from __future__ import annotations

import pytest

from benchmarks.placement_policies import Ours, Snapshot
from deployments.placement.affinity import ReplicaView, place
from deployments.placement.demand import DemandTracker


def test_shares_are_fractions_of_recent_requests() -> None:
    demand = DemandTracker(half_life_s=60.0)
    assert demand.share("a") == 0.0
    for i in range(6):
        demand.observe(["a"], now=float(i))
    for i in range(2):
        demand.observe(["b"], now=6.0 + i)
    demand.observe([], now=8.0)  # a base-model request counts in the total only
    assert demand.share("a") == pytest.approx(6 / 9, rel=0.05)
    assert demand.share("b") == pytest.approx(2 / 9, rel=0.05)
    assert demand.share("a") + demand.share("b") < 1.0


def test_an_old_request_weighs_half_one_half_life_later() -> None:
    demand = DemandTracker(half_life_s=10.0)
    demand.observe(["old"], now=0.0)
    demand.observe(["new"], now=10.0)
    assert demand.share("new") == pytest.approx(2 / 3)
    assert demand.share("old") == pytest.approx(1 / 3)


def test_rescaling_keeps_the_shares_and_forgets_adapters_gone_cold() -> None:
    demand = DemandTracker(half_life_s=1.0, floor=0.05)
    demand.observe(["gone"], now=0.0)
    steps = 0
    while steps < 40:  # 40 half-lives: the weights pass RESCALE_AT and are divided down
        steps += 1
        demand.observe(["hot", "warm"] if steps % 2 else ["hot"], now=float(steps))
    assert len(demand) == 2  # `gone` fell under the floor at a rescale
    assert demand.share("hot") == pytest.approx(1.0)
    assert 0.3 < demand.share("warm") < 0.7


def test_half_life_must_be_positive() -> None:
    with pytest.raises(ValueError):
        DemandTracker(half_life_s=0.0)


def views(holder_load: int) -> list[ReplicaView]:
    """Seven replicas at load 20 and one holding `a` at `holder_load`."""
    out = [ReplicaView(f"r{i}", load=20, capacity=48) for i in range(7)]
    return [*out, ReplicaView("holder", frozenset({"a"}), load=holder_load, capacity=48)]


def test_a_cold_set_stays_with_its_holder_up_to_twice_the_bound() -> None:
    # The others' mean is 20: the limit is 20 + max(4, 5) = 25; a cold set's holder keeps it
    # up to twice that margin, 20 + max(8, 10) = 30.
    cold, hot = 0.01, 0.5
    assert place(["a"], views(27), share=None).ranked[0] != "holder"  # no demand: as before
    assert place(["a"], views(27), share=hot).ranked[0] != "holder"  # a hot set spills
    decision = place(["a"], views(27), share=cold)
    assert decision.ranked[0] == "holder" and decision.outcome == "affinity"
    assert place(["a"], views(31), share=cold).ranked[0] != "holder"  # past twice: spills


def test_a_cold_set_held_only_in_a_host_tier_keeps_that_holder_too() -> None:
    replicas = [ReplicaView(f"r{i}", load=20, capacity=48) for i in range(7)]
    replicas.append(ReplicaView("host", host_set=frozenset({"a"}), load=27, capacity=48))
    assert place(["a"], replicas, share=0.01).ranked[0] == "host"
    assert place(["a"], replicas, share=None).ranked[0] != "host"


def test_a_full_holder_is_never_first_even_for_a_cold_set() -> None:
    replicas = views(48)
    assert place(["a"], replicas, share=0.0, load_bound=100).ranked[0] != "holder"


def test_the_simulated_router_counts_a_request_once_however_often_it_ranks() -> None:
    policy = Ours(["r0", "r1"], capacity=8)
    policy.on_report({rid: Snapshot(num_slots=16) for rid in policy.ids}, now=0.0)
    policy.on_arrival("a", now=0.0)
    for _ in range(5):  # a request waiting at the router is ranked again
        policy.rank("a", now=0.0)
    policy.on_arrival("b", now=0.0)
    assert policy.demand is not None
    assert policy.demand.share("a") == pytest.approx(0.5)
