"""What a replica reports of its rank pools for the cluster's placement: per pool its free and
evictable slots (pinned and held adapters are not evictable), and the ranks it has read."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.molora_runtime.rt_util import make_peft_adapter

POOLS = [{"rank": 32, "slots": 1}, {"rank": 4, "slots": 2}]


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pool-report-adapters")
    big = make_peft_adapter(tiny_llama, root / "big", r=32, alpha=16, seed=9, std=0.05)
    return {**tiny_adapters, "big": big}


def test_pool_report_counts_free_and_evictable_slots(tiny_engine_factory, adapters) -> None:
    engine = tiny_engine_factory(adapters=adapters, hot_set={"rank_pools": POOLS, "pinned": ["a"]})
    hot = engine.hot_set
    assert engine.stats().rank_pools == [(4, 2, 1, 0), (32, 1, 1, 0)]  # a: pinned
    hot.ensure(["big"])
    hot.acquire(["big"])
    stats = engine.stats()
    assert stats.rank_pools == [(4, 2, 1, 0), (32, 1, 0, 0)]  # big: held by a request
    assert stats.adapter_ranks == {"a": 4, "big": 32}
    hot.release(["big"])
    assert engine.stats().rank_pools == [(4, 2, 1, 0), (32, 1, 0, 1)]


def test_the_padded_layout_reports_no_pools(tiny_engine_factory, adapters) -> None:
    engine = tiny_engine_factory(adapters=adapters, hot_set={"num_slots": 2, "max_rank": 32})
    engine.hot_set.ensure(["big"])
    stats = engine.stats()
    assert stats.rank_pools == [] and stats.adapter_ranks == {"big": 32}
