"""Adapter tiers sized in bytes: LRU per tier, pinning, per-tier counters, residency view."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from deployments.config import ServeConfig
from molora_runtime.config import HotSetConfig
from molora_runtime.lora.host_tier import HostTier
from molora_runtime.lora.tiers import StageTimes, residency_counts, residency_view
from molora_runtime.sizes import parse_bytes
from tests.molora_runtime.rt_util import build_engine, random_prompts, request, run_to_completion


class _Weights:
    def __init__(self, n: int) -> None:
        self.n = n

    def nbytes(self) -> int:
        return self.n


@pytest.mark.parametrize(
    ("text", "expected"),
    [(0, 0), (1024, 1024), ("512MiB", 512 * 2**20), ("2 GB", 2 * 10**9), ("1.5KiB", 1536)],
)
def test_sizes_parse(text: object, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["12 potatoes", "-1", -5, "MiB", True, [1]])
def test_bad_sizes_are_named(bad: object) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_bytes(bad)


def test_config_accepts_units_and_names_bad_keys() -> None:
    cfg = ServeConfig.from_args(
        {"engine": {"hot_set": {"host_bytes": "64MiB"}}, "store": {"cache_bytes": "1GiB"}}
    )
    assert cfg.engine.hot_set.host_bytes == 64 * 2**20 and cfg.store.cache_bytes == 2**30
    with pytest.raises(ValueError) as err:
        ServeConfig.from_args(
            {"engine": {"hot_set": {"host_bytes": "lots"}}, "store": {"cache_bytes": "-3GB"}}
        )
    text = str(err.value)
    assert "args.engine.hot_set.host_bytes" in text and "'lots' is not a size" in text
    assert "args.store.cache_bytes" in text
    with pytest.raises(ValidationError, match="fetch_workers"):
        HotSetConfig(fetch_workers=0)


def test_host_tier_evicts_oldest_unpinned_first() -> None:
    tier = HostTier(lambda name: _Weights(40), budget_bytes=100)  # type: ignore[arg-type,return-value]
    tier.pin("p")
    for name in ("p", "a", "b"):
        tier.read_now(name)
    assert sorted(tier.resident()) == ["b", "p"]
    assert tier.counters.evictions == 1 and tier.nbytes == 80
    tier.get("b")
    tier.read_now("c")  # over budget again: b is the only unpinned older entry
    assert sorted(tier.resident()) == ["c", "p"]
    tier.shutdown()


def test_stage_histogram_is_cumulative_and_drains() -> None:
    times = StageTimes()
    times.observe("fetch", 0.002)
    times.observe("fetch", 3.0)
    times.observe("copy", 0.0001)
    report = times.report()
    fetch = report["fetch"]
    assert fetch.count == 2 and fetch.counts[-1] == 2
    assert fetch.counts[fetch.buckets.index(0.005)] == 1
    assert report["parse"].count == 0
    assert sorted(times.drain()) == [("copy", 0.0001), ("fetch", 0.002), ("fetch", 3.0)]
    assert times.drain() == []


def test_residency_prefers_the_best_tier() -> None:
    view = residency_view(slots=["a"], host=["a", "b"], loading=["c"], disk=["a", "b", "c", "d"])
    assert view == {"a": "slot", "b": "host", "c": "loading", "d": "disk"}
    assert residency_counts(view) == {"slot": 1, "host": 1, "loading": 1, "disk": 1}


def test_engine_reports_tiers_and_residency(tiny_llama: Path, tiny_adapters) -> None:
    engine = build_engine(tiny_llama, tiny_adapters, hot_set={"num_slots": 2, "pinned": ["a"]})
    prompts = random_prompts(3, 256, [5, 6, 7], seed=1)
    run_to_completion(engine, [request(f"r{i}", p, n, 3) for i, (p, n) in enumerate(
        zip(prompts, ["b", "c", "b"], strict=True))])  # fmt: skip
    hs = engine.hot_set
    report = hs.tier_report()
    slot, host = report.tiers["slot"], report.tiers["host"]
    assert slot.capacity_slots == 2 and slot.entries == 2
    assert slot.bytes == 2 * hs.slot_nbytes() and slot.capacity_bytes == slot.bytes
    assert slot.loads >= 3 and slot.evictions >= 1  # b, then c evicted b (a is pinned)
    assert host.loads == 3 and host.bytes == hs.host.nbytes > 0
    assert report.stages["parse"].count == 3 and report.stages["copy"].count == slot.loads
    view = hs.residency()
    assert view["a"] == "slot" and set(view) == {"a", "b", "c"}
    assert hs.tier_of(["a"]) == "slot" and hs.tier_of(["a", "zzz"]) == "store"
    engine.hot_set.host.shutdown()


def test_a_synchronous_read_joins_the_background_fetch_of_the_same_adapter() -> None:
    # An idle engine loads a request's adapter at once (read_now) while the prefetch of the
    # same adapter may still be parsing it: the files must be read and parsed once.
    gate, calls = threading.Event(), []

    def slow_read(name: str) -> _Weights:
        calls.append(name)
        gate.wait(5)
        if name == "bad":
            raise OSError("store unreachable")
        return _Weights(10)

    tier = HostTier(slow_read, budget_bytes=100)  # type: ignore[arg-type]
    assert not tier.ready("x") and not tier.ready("bad")  # both fetches start, blocked
    results: dict[str, object] = {}

    def reader(name: str) -> None:
        try:
            results[name] = tier.read_now(name)
        except OSError as exc:
            results[name] = exc

    threads = [threading.Thread(target=reader, args=(n,)) for n in ("x", "bad")]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(5)
    assert sorted(calls) == ["bad", "x"]  # one read each
    assert results["x"] is tier.get("x")
    assert isinstance(results["bad"], OSError)  # the fetch's own error, for the caller
    assert tier.counters.loads == 1 and tier.counters.failures == 1
    tier.shutdown()
