"""The endpoint benchmark keeps each cell's best round per server, in first-round order."""

from __future__ import annotations

from benchmarks.serve_vs_vllm import best_of_rounds


def _cell(mode: str, c: int, tok_s: float) -> dict:
    return {"mode": mode, "concurrency": c, "tok_per_s": tok_s}


def test_each_cell_keeps_its_fastest_round() -> None:
    first = [_cell("base", 8, 38.6), _cell("mixed", 8, 30.4), _cell("base", 32, 78.7)]
    second = [_cell("base", 8, 44.0), _cell("mixed", 8, 29.0), _cell("base", 32, 80.1)]
    best = best_of_rounds([first, second])
    assert [(r["mode"], r["concurrency"], r["tok_per_s"]) for r in best] == [
        ("base", 8, 44.0),
        ("mixed", 8, 30.4),
        ("base", 32, 80.1),
    ]
    assert best[1] is first[1]  # the whole row of the kept round, latencies included


def test_one_round_is_itself() -> None:
    cells = [_cell("base", 1, 7.7), _cell("vocab", 1, 6.6)]
    assert best_of_rounds([cells]) == cells
