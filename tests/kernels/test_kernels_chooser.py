"""The one chooser (`kernels.chooser`) that the GEMM, attention and LoRA decisions share, driven
by a fake clock whose candidates cost exactly what each case says: the fastest over the weighted
sizes wins, decode rows outweigh a prefill chunk, ties and missing candidates are handled, and a
noisy sample does not decide alone. A `Chooser` measures a shape once, stores its table, reads
it back in a new process and honours its override variable. The stored tables
(`kernels.choice_cache`) are private and per machine kind, and a damaged file is ignored, not
trusted."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from kernels import choice_cache, chooser
from kernels.cpu_extension_build import CACHE_ENV


class FakeClock:
    """Time moves only when a candidate runs, by the cost the test gives it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def candidate(self, costs: dict[int, float]) -> chooser.Candidate:
        def make(m: int) -> chooser.Runner:
            def run() -> None:
                self.now += costs[m]

            return run

        return make


ROWS = (1, 8, 32, 64, 256)


def _measure(costs: dict[str, dict[int, float]], rows=ROWS) -> chooser.Table:
    clock = FakeClock()
    candidates = {name: clock.candidate(c) for name, c in costs.items()}
    return chooser.measure(candidates, rows, reps=3, timer=clock)


def test_measure_reports_each_candidates_cost_per_row_count() -> None:
    costs = {"a": {m: 1e-5 * m for m in ROWS}, "b": {m: 2e-5 for m in ROWS}}
    table = _measure(costs)
    for name, by_rows in costs.items():
        for m, cost in by_rows.items():
            assert table[name][m] == pytest.approx(cost)


def test_the_fastest_everywhere_wins() -> None:
    table = _measure({"slow": dict.fromkeys(ROWS, 3e-5), "fast": dict.fromkeys(ROWS, 1e-5)})
    assert chooser.pick(table) == "fast"
    assert chooser.scores(table)["fast"] == pytest.approx(1.0)
    assert chooser.scores(table)["slow"] == pytest.approx(3.0)


def test_decode_rows_outweigh_a_prefill_chunk() -> None:
    # `decode` is 1.5x faster at every decode row count, `prefill` 2x faster at the chunk only
    decode = {1: 1e-5, 8: 1e-5, 32: 1e-5, 64: 1e-5, 256: 2e-4}
    prefill = {1: 1.5e-5, 8: 1.5e-5, 32: 1.5e-5, 64: 1.5e-5, 256: 1e-4}
    table = _measure({"prefill": prefill, "decode": decode})
    assert chooser.pick(table) == "decode"
    # weighted the other way round, the chunk decides
    assert chooser.pick(table, weights={1: 0.1, 8: 0.1, 32: 0.1, 64: 0.1, 256: 10}) == ("prefill")


def test_only_allowed_candidates_are_picked_and_ties_keep_the_listed_order() -> None:
    table = _measure({"x": dict.fromkeys(ROWS, 1e-5), "y": dict.fromkeys(ROWS, 1e-5)})
    assert chooser.pick(table) == "x"
    assert chooser.pick(table, allowed=["y"]) == "y"
    with pytest.raises(ValueError, match="no candidate"):
        chooser.pick(table, allowed=["z"])


def test_a_candidate_missing_a_row_count_is_not_compared() -> None:
    table = {"full": {1: 2e-5, 8: 2e-5}, "partial": {1: 1e-5}}
    assert chooser.pick(table) == "full"


def test_one_slow_sample_does_not_decide() -> None:
    clock = FakeClock()
    calls = {"steady": 0, "jittery": 0}

    def make(name: str, cost: float, spike_at: int) -> chooser.Candidate:
        def runner(m: int) -> chooser.Runner:
            def run() -> None:
                calls[name] += 1
                clock.now += cost * (100 if calls[name] == spike_at else 1)

            return run

        return runner

    # `jittery` is faster but one of its samples is hit by a 100x stall
    cands = {"steady": make("steady", 2e-5, -1), "jittery": make("jittery", 1e-5, 25)}
    table = chooser.measure(cands, (1,), reps=5, timer=clock)
    assert chooser.pick(table) == "jittery"


def test_the_table_says_what_won_and_by_how_much() -> None:
    table = _measure({"a": dict.fromkeys(ROWS, 1e-5), "b": dict.fromkeys(ROWS, 2e-5)})
    text = chooser.format_table("shape", table, "a")
    assert text.splitlines()[0] == "shape: a"
    assert "* a" in text and "  b" in text and "20.0" in text and "2.00" in text


def test_tables_are_stored_privately_per_machine_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "c"))
    table = {"a": {1: 1e-5, 8: 2e-5}}
    choice_cache.store("float32:4x4", table)
    assert choice_cache.load("float32:4x4") == table
    assert choice_cache.load("float32:8x8") is None
    (path,) = (tmp_path / "c").glob(f"{choice_cache.FILE_PREFIX}*.json")
    assert path.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "c").stat().st_mode & 0o777 == 0o700
    stored = json.loads(path.read_text())["machine"]
    assert stored["torch_version"] == torch.__version__ and stored["cpu_model"]
    threads = torch.get_num_threads()
    try:  # another thread count is another machine kind: its own file, nothing shared
        torch.set_num_threads(threads + 1)
        assert choice_cache.load("float32:4x4") is None
    finally:
        torch.set_num_threads(threads)


def test_a_damaged_table_file_is_ignored_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "c"))
    path = choice_cache.path_for(choice_cache.machine())
    path.parent.mkdir(mode=0o700)
    path.write_text('{"machine": "not a dict", "tables": [1, 2')
    with caplog.at_level(logging.WARNING, logger=choice_cache.__name__):
        assert choice_cache.load("float32:4x4") is None
    assert "unreadable" in caplog.text
    choice_cache.store("float32:4x4", {"a": {1: 1e-5}})  # replaced by a good one
    assert choice_cache.load("float32:4x4") == {"a": {1: 1e-5}}


class Counting:
    """A measuring function that records what it was asked to time and returns fixed costs."""

    def __init__(self, costs: dict[str, float]) -> None:
        self.costs, self.calls = costs, []

    def __call__(self, kinds) -> chooser.Table:
        self.calls.append(list(kinds))
        return {k: {1: self.costs[k]} for k in kinds}


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "c"))
    monkeypatch.delenv("MOLORA_TEST_KIND", raising=False)
    return tmp_path / "c"


def test_a_chooser_measures_once_stores_and_a_new_process_reads_the_store(
    private_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    measure = Counting({"a": 2e-5, "b": 1e-5})
    pick = chooser.Chooser("Test op", "MOLORA_TEST_KIND", ("a", "b"))
    with caplog.at_level(logging.INFO, logger=chooser.__name__):
        assert pick.choose("shape", ["a", "b"], measure) == "b"
        assert pick.choose("shape", ["a", "b"], measure) == "b"  # the process's own pick
    assert measure.calls == [["a", "b"]]
    assert "Test op for shape (measured" in caplog.text
    assert choice_cache.load("shape") == {"a": {1: 2e-5}, "b": {1: 1e-5}}
    fresh = chooser.Chooser("Test op", "MOLORA_TEST_KIND", ("a", "b"))  # a new process
    choice_cache.store("shape", {"a": {1: 1e-6}, "b": {1: 1e-5}})  # rigged: the store decides
    assert fresh.choose("shape", ["a", "b"], measure) == "a"
    assert measure.calls == [["a", "b"]]


def test_a_store_without_a_candidate_that_now_runs_is_measured_again(private_cache: Path) -> None:
    choice_cache.store("shape", {"a": {1: 1e-6}})
    measure = Counting({"a": 2e-5, "b": 1e-5})
    assert (
        chooser.Chooser("T", "MOLORA_TEST_KIND", ("a", "b")).choose("shape", ["a", "b"], measure)
        == "b"
    )
    assert measure.calls == [["a", "b"]]


def test_narrowing_picks_among_the_kept_kinds_and_logs_the_dropped(
    private_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    measure = Counting({"a": 2e-5, "b": 1e-5})
    pick = chooser.Chooser("T", "MOLORA_TEST_KIND", ("a", "b"))
    with caplog.at_level(logging.INFO, logger=chooser.__name__):
        got = pick.choose("shape", ["a", "b"], measure, narrow=lambda k: ["a"], narrowed="why")
    assert got == "a" and measure.calls == [["a"]] and "why: b" in caplog.text


def test_a_lone_runnable_kind_is_taken_without_measuring(private_cache: Path) -> None:
    measure = Counting({"a": 1.0})
    assert chooser.Chooser("T", "MOLORA_TEST_KIND", ("a", "b")).choose("s", ["a"], measure) == "a"
    assert measure.calls == [] and choice_cache.load("s") is None


def test_the_override_is_honoured_where_it_runs_and_refused_when_misspelled(
    private_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    measure = Counting({"a": 1e-5, "b": 2e-5})
    pick = chooser.Chooser("T", "MOLORA_TEST_KIND", ("a", "b"))
    monkeypatch.setenv("MOLORA_TEST_KIND", "B")
    assert pick.choose("shape", ["a", "b"], measure) == "b" and measure.calls == []
    with caplog.at_level(logging.WARNING, logger=chooser.__name__):  # cannot run: measured
        assert pick.choose("other", ["a", "c"], Counting({"a": 1.0, "c": 2.0})) == "a"
    assert "MOLORA_TEST_KIND=b cannot run other here" in caplog.text
    monkeypatch.setenv("MOLORA_TEST_KIND", "fastest")
    with pytest.raises(ValueError, match="MOLORA_TEST_KIND='fastest'"):
        pick.choose("shape", ["a", "b"], measure)
    monkeypatch.setenv("MOLORA_TEST_KIND", "auto")
    assert pick.choose("shape", ["a", "b"], measure) == "a"  # measured under `auto`
