"""`benchmarks.placement_sim` drives the real placement code and five baselines over simulated
replicas on a fake clock: the quick run prints the table, writes one JSON, serves every request
and spreads the flash-crowd adapter over more than one replica (no timing asserted). The
baselines and the bounded-load rule get small checks of their own; the hot-sets evict with the
product's own class (`slot_eviction: product`), and `lru` is the rule before it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import placement_sim
from benchmarks.placement_policies import POLICIES, LlmD, MinCostFlow, Ours, Snapshot
from deployments.placement.affinity import ReplicaView, load_limits, place
from molora_runtime.lora.pinned_lfu import PinnedLFU, slot_order
from molora_runtime.lora.pinned_lru import PinnedLRU

PHASES = {"steady", "flash", "recovery", "shift"}


def test_quick_run_prints_the_table_writes_the_json_and_holds_the_invariants(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "placement_sim.json"
    assert placement_sim.main(["--quick", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| policy | slot loads/min | store fetches/min | slot hit |" in text
    assert "every request served: yes" in text
    result = json.loads(out.read_text())
    assert set(result["results"]) == set(POLICIES)
    for res in result["results"].values():
        assert res["served"] == res["requests"] > 0
        assert set(res["phases"]) == PHASES
        measured = res["measured"]
        assert measured["slot_loads_per_min"] > 0 and 0 <= measured["slot_hit"] <= 1
        assert measured["ttft_p50_ms"] <= measured["ttft_p99_ms"]
    ours = result["results"]["ours"]
    assert ours["flash"]["replicas"] > 1  # the flash crowd's adapter is not confined to one
    assert all(hot["replicas"] > 1 for hot in ours["hot_adapters"])
    assert set(ours["policy_info"]["outcomes"]) <= {"affinity", "host", "spill", "new"}
    targets = result["targets"]
    assert targets["all_served"] and targets["no_hot_adapter_confined"]
    assert "loads_target_met" in targets and "best_other_by_slot_loads" in targets
    assert result["step_model"]["source"]["file"] == "benchmarks/results/runtime_decode.json"
    assert result["tier_costs"]["source"]["file"] == "benchmarks/results/store_pull.json"
    bounds = result["cache_bounds"]
    assert bounds["belady_per_min"] <= bounds["pooled_lru_per_min"]
    # No online cache expects fewer misses than the trace's own top-128 share leaves.
    assert bounds["irm_online_per_min"] < bounds["pooled_hot_set_order_per_min"]
    assert bounds["irm_online_per_min"] < bounds["pooled_lru_per_min"]
    for res in result["results"].values():
        assert 0 < res["slots_held_mean"] <= 128 and 0 < res["distinct_resident_mean"] <= 128
    assert result["machine_info"]["cpus"]


def test_ours_remembers_its_own_placements_for_placement_memory_s() -> None:
    # Before any report, the router's own recent placement is what makes the second request
    # an affinity hit, as in AdapterAffinityRouter; once forgotten the adapter is new again.
    policy = Ours(["r0", "r1", "r2"], capacity=8, placement_memory_s=5.0)
    home = policy.rank("a", now=0.0)[0]
    assert policy.rank("a", now=1.0)[0] == home
    assert policy.outcomes == {"new": 1, "affinity": 1}
    policy.rank("a", now=7.0)
    assert policy.outcomes["new"] == 2


def test_a_drained_replica_does_not_push_every_holder_past_the_bound() -> None:
    # Six replicas at 20, one just drained to 0, the adapter's holder at 21: against the least
    # loaded (0 + 4) the holder would spill and load it elsewhere; against the others' average
    # (17.1 + 4.3) it keeps the request.
    views = [ReplicaView(f"r{i}", load=20) for i in range(6)]
    views += [ReplicaView("idle", load=0), ReplicaView("holder", frozenset({"a"}), load=21)]
    assert load_limits(views, 4, 0.25)["holder"] == pytest.approx(120 / 7 * 1.25)
    decision = place(["a"], views, load_bound=4, load_bound_ratio=0.25)
    assert decision.ranked[0] == "holder" and decision.outcome == "affinity"
    # Far past the others' average it still spills.
    views[-1] = ReplicaView("holder", frozenset({"a"}), load=30)
    assert place(["a"], views, load_bound=4, load_bound_ratio=0.25).ranked[0] != "holder"


def test_min_cost_flow_plans_an_adapter_hotter_than_a_replica_on_several() -> None:
    ids = [f"r{i}" for i in range(4)]
    policy = MinCostFlow(ids, capacity=48, replica_req_per_s=1.0, window_s=10.0)
    for i in range(30):  # 3 requests/s against 1 request/s per replica
        policy.on_arrival("hot", i / 3)
    for i in range(4):
        policy.on_arrival(f"cold{i}", 5.0)
    policy.on_report({rid: Snapshot(num_slots=16) for rid in ids}, now=10.0)
    assert len(policy.assigned["hot"]) >= 3
    assert policy.rank("hot", now=10.0)[0] in policy.assigned["hot"]


def test_llm_d_prefers_residency_and_then_the_shorter_queue() -> None:
    policy = LlmD(["r0", "r1", "r2"], capacity=48)
    full = frozenset(f"x{i}" for i in range(16))
    policy.on_report(
        {
            "r0": Snapshot(hot_set=full, num_slots=16, waiting=3),
            "r1": Snapshot(hot_set=full | {"a"}, num_slots=16, waiting=2),
            "r2": Snapshot(hot_set=full, num_slots=16, waiting=0),
        },
        now=0.0,
    )
    assert policy.rank("a", now=0.0) == ["r1", "r2", "r0"]


def test_simulated_hot_sets_evict_with_the_product_class_or_lru() -> None:
    product = placement_sim.slot_eviction("product", 16)
    assert isinstance(product, PinnedLFU) and product.window == slot_order(16).window
    lru = placement_sim.slot_eviction("lru", 16)
    assert type(lru) is PinnedLRU
