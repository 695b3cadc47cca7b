"""The GEMM chooser's decision logic (`kernels.gemm_chooser`), driven by a fake clock whose
candidates cost exactly what each case says: the fastest over the weighted row counts wins,
decode rows outweigh a prefill chunk, ties and missing candidates are handled, and a noisy
sample does not decide alone. Its stored tables (`kernels.gemm_choice_cache`) are private and
per machine kind, and a damaged file is ignored, not trusted."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from kernels import gemm_choice_cache, gemm_chooser
from kernels.cpu_extension_build import CACHE_ENV


class FakeClock:
    """Time moves only when a candidate runs, by the cost the test gives it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def candidate(self, costs: dict[int, float]) -> gemm_chooser.Candidate:
        def make(m: int) -> gemm_chooser.Runner:
            def run() -> None:
                self.now += costs[m]

            return run

        return make


ROWS = (1, 8, 32, 64, 256)


def _measure(costs: dict[str, dict[int, float]], rows=ROWS) -> gemm_chooser.Table:
    clock = FakeClock()
    candidates = {name: clock.candidate(c) for name, c in costs.items()}
    return gemm_chooser.measure(candidates, rows, reps=3, timer=clock)


def test_measure_reports_each_candidates_cost_per_row_count() -> None:
    costs = {"a": {m: 1e-5 * m for m in ROWS}, "b": {m: 2e-5 for m in ROWS}}
    table = _measure(costs)
    for name, by_rows in costs.items():
        for m, cost in by_rows.items():
            assert table[name][m] == pytest.approx(cost)


def test_the_fastest_everywhere_wins() -> None:
    table = _measure({"slow": dict.fromkeys(ROWS, 3e-5), "fast": dict.fromkeys(ROWS, 1e-5)})
    assert gemm_chooser.pick(table) == "fast"
    assert gemm_chooser.scores(table)["fast"] == pytest.approx(1.0)
    assert gemm_chooser.scores(table)["slow"] == pytest.approx(3.0)


def test_decode_rows_outweigh_a_prefill_chunk() -> None:
    # `decode` is 1.5x faster at every decode row count, `prefill` 2x faster at the chunk only
    decode = {1: 1e-5, 8: 1e-5, 32: 1e-5, 64: 1e-5, 256: 2e-4}
    prefill = {1: 1.5e-5, 8: 1.5e-5, 32: 1.5e-5, 64: 1.5e-5, 256: 1e-4}
    table = _measure({"prefill": prefill, "decode": decode})
    assert gemm_chooser.pick(table) == "decode"
    # weighted the other way round, the chunk decides
    assert gemm_chooser.pick(table, weights={1: 0.1, 8: 0.1, 32: 0.1, 64: 0.1, 256: 10}) == (
        "prefill"
    )


def test_only_allowed_candidates_are_picked_and_ties_keep_the_listed_order() -> None:
    table = _measure({"x": dict.fromkeys(ROWS, 1e-5), "y": dict.fromkeys(ROWS, 1e-5)})
    assert gemm_chooser.pick(table) == "x"
    assert gemm_chooser.pick(table, allowed=["y"]) == "y"
    with pytest.raises(ValueError, match="no candidate"):
        gemm_chooser.pick(table, allowed=["z"])


def test_a_candidate_missing_a_row_count_is_not_compared() -> None:
    table = {"full": {1: 2e-5, 8: 2e-5}, "partial": {1: 1e-5}}
    assert gemm_chooser.pick(table) == "full"


def test_one_slow_sample_does_not_decide() -> None:
    clock = FakeClock()
    calls = {"steady": 0, "jittery": 0}

    def make(name: str, cost: float, spike_at: int) -> gemm_chooser.Candidate:
        def runner(m: int) -> gemm_chooser.Runner:
            def run() -> None:
                calls[name] += 1
                clock.now += cost * (100 if calls[name] == spike_at else 1)

            return run

        return runner

    # `jittery` is faster but one of its samples is hit by a 100x stall
    cands = {"steady": make("steady", 2e-5, -1), "jittery": make("jittery", 1e-5, 25)}
    table = gemm_chooser.measure(cands, (1,), reps=5, timer=clock)
    assert gemm_chooser.pick(table) == "jittery"


def test_the_table_says_what_won_and_by_how_much() -> None:
    table = _measure({"a": dict.fromkeys(ROWS, 1e-5), "b": dict.fromkeys(ROWS, 2e-5)})
    text = gemm_chooser.format_table("shape", table, "a")
    assert text.splitlines()[0] == "shape: a"
    assert "* a" in text and "  b" in text and "20.0" in text and "2.00" in text


def test_tables_are_stored_privately_per_machine_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "c"))
    table = {"a": {1: 1e-5, 8: 2e-5}}
    gemm_choice_cache.store("float32:4x4", table)
    assert gemm_choice_cache.load("float32:4x4") == table
    assert gemm_choice_cache.load("float32:8x8") is None
    (path,) = (tmp_path / "c").glob("gemm-choices-*.json")
    assert path.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "c").stat().st_mode & 0o777 == 0o700
    stored = json.loads(path.read_text())["machine"]
    assert stored["torch_version"] == torch.__version__ and stored["cpu_model"]
    threads = torch.get_num_threads()
    try:  # another thread count is another machine kind: its own file, nothing shared
        torch.set_num_threads(threads + 1)
        assert gemm_choice_cache.load("float32:4x4") is None
    finally:
        torch.set_num_threads(threads)


def test_a_damaged_table_file_is_ignored_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "c"))
    path = gemm_choice_cache.path_for(gemm_choice_cache.machine())
    path.parent.mkdir(mode=0o700)
    path.write_text('{"machine": "not a dict", "tables": [1, 2')
    with caplog.at_level(logging.WARNING, logger=gemm_choice_cache.__name__):
        assert gemm_choice_cache.load("float32:4x4") is None
    assert "unreadable" in caplog.text
    gemm_choice_cache.store("float32:4x4", {"a": {1: 1e-5}})  # replaced by a good one
    assert gemm_choice_cache.load("float32:4x4") == {"a": {1: 1e-5}}
