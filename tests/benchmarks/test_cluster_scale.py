"""The cluster-at-scale phase reads the cluster's answers as the simulator reports its own (slot
hit, loads and store fetches per minute of the measured phases, the flash adapter's replicas),
calibrates the simulator from them, and the cluster table shows whichever phases were run."""

from __future__ import annotations

from benchmarks.cluster import table
from benchmarks.cluster_scale import (
    calibration,
    predicted,
    scale_table,
    traffic_config,
    windows,
)
from benchmarks.load_client import Sample
from benchmarks.placement_sim import MEASURED_PHASES
from benchmarks.placement_traffic import Arrival, make_traffic

TRAFFIC = make_traffic(traffic_config(quick=True), 4.0)


def _sample(arrival: Arrival, tier: str, ttft: float, ok: bool = True) -> Sample:
    flash = arrival.phase == "flash"
    replica = f"r{int(arrival.t) % 2}" if flash else "r2"
    error = None if ok else "503: busy"
    gaps = [0.02, 0.03]
    return Sample(arrival.adapter, ok, ttft, gaps, tier=tier, replica=replica, error=error)


def _run(tiers: list[str], ttft: float) -> list[tuple[Arrival, Sample]]:
    return [(a, _sample(a, tiers[i % len(tiers)], ttft)) for i, a in enumerate(TRAFFIC.arrivals)]


def test_windows_count_tiers_per_minute_of_the_measured_phases() -> None:
    samples = _run(["slot", "slot", "host", "store"], 0.5)
    samples[-1] = (samples[-1][0], _sample(samples[-1][0], "slot", 0.5, ok=False))
    out = windows(TRAFFIC, samples)
    measured = [p for p in TRAFFIC.phases if p.name in MEASURED_PHASES]
    minutes = sum(p.minutes for p in measured)
    got = [s for a, s in samples if a.phase in MEASURED_PHASES and s.ok]
    assert out["measured"]["requests"] == len(got) + 1
    assert out["measured"]["failed"] == 1 and out["errors"] == ["503: busy"]
    stores = sum(s.tier == "store" for s in got)
    misses = sum(s.tier != "slot" for s in got)
    assert out["measured"]["store_fetches_per_min"] == round(stores / minutes, 1)
    assert out["measured"]["slot_loads_per_min"] == round(misses / minutes, 1)
    assert 0.4 < out["measured"]["slot_hit"] < 0.6
    assert set(out["phases"]) == set(MEASURED_PHASES)
    assert out["flash"]["adapter"] == TRAFFIC.flash_adapter and out["flash"]["replicas"] == 2


def test_calibration_reads_the_step_and_the_fetch_off_the_runs() -> None:
    cold, warm = _run(["store", "slot"], 1.5), _run(["slot"], 0.5)
    cal = calibration(cold, warm)
    assert cal["step_ms"] == 25.0  # median of the warm run's gaps
    assert cal["store_fetch_s"] == 1.0  # cold store-tier TTFT less the warm median


def test_the_simulator_runs_the_same_trace_in_the_clusters_shape() -> None:
    sim = predicted(
        traffic_config(quick=True), {"step_ms": 20.0, "store_fetch_s": 0.2, "from": "t"}
    )
    assert sim["measured"]["requests"] == sum(a.phase in MEASURED_PHASES for a in TRAFFIC.arrivals)
    assert 0.0 <= sim["measured"]["slot_hit"] <= 1.0
    assert sim["flash"]["adapter"] == TRAFFIC.flash_adapter


def test_the_table_shows_the_phases_that_ran() -> None:
    cold = windows(TRAFFIC, _run(["store", "slot"], 1.5))
    warm = windows(TRAFFIC, _run(["slot"], 0.5))
    sim = {"measured": {**cold["measured"], "slot_hit": 0.7}, "flash": {"replicas": 3}}
    scale = {"cold": cold, "warm": warm, "simulated": sim, "cold_over_warm_ttft_p99": 3.0}
    rows = dict(scale_table(scale))
    assert rows["scale: slot hit (cluster / simulator)"] == "0.5 / 0.7"
    assert rows["scale: TTFT p99 cold / warm (s)"] == "1.50 / 0.50 (3.0x)"
    text = table({"scale": scale})
    assert "scale: flash adapter replicas" in text and "placement" not in text
