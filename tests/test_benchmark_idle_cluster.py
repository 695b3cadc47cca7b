"""The idle-cluster benchmark's summary: medians per condition and the median per-round ratio."""

from __future__ import annotations

from benchmarks.idle_cluster_cost import summarize


def _round(k: int, idle: list[float], frozen: list[float]) -> dict:
    keys = ["c=1", "c=8", "c=32"]
    return {
        "round": k,
        "idle": dict(zip(keys, idle, strict=True)),
        "frozen": dict(zip(keys, frozen, strict=True)),
    }


def test_summary_pairs_each_round_with_itself() -> None:
    rounds = [
        _round(0, [12.0, 60.0, 100.0], [16.0, 80.0, 120.0]),
        _round(1, [15.0, 70.0, 110.0], [15.0, 70.0, 110.0]),
        _round(2, [13.0, 66.0, 90.0], [14.0, 88.0, 100.0]),
    ]
    rows, table = summarize(rounds)
    assert [r["concurrency"] for r in rows] == [1, 8, 32]
    assert rows[0]["idle_tok_per_s"] == 13.0 and rows[0]["frozen_tok_per_s"] == 15.0
    assert rows[0]["idle_over_frozen"] == round(13.0 / 14.0, 3)  # median of 0.75, 1.0, 0.93
    assert rows[1]["idle_over_frozen"] == 0.75
    assert rows[2]["idle_over_frozen"] == 0.9
    assert table[2].startswith("| 1 | 15.0 | 13.0 | 0.93 |")
