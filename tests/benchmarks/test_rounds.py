"""The endpoint benchmark: best round per cell, rounds in reversed order, per-round ratios, the
greedy agreement of the two servers, and a stopped server leaves nothing behind."""

from __future__ import annotations

import subprocess
import time

from benchmarks.serve_rounds import (
    adapters_applied,
    agreement,
    best_of_rounds,
    per_round_ratios,
    round_order,
)
from benchmarks.server_process import session_processes, stop


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


def test_rounds_reverse_their_order_so_drift_favours_no_one() -> None:
    assert round_order(0, False, False) == ["vllm", "molora", "offline"]
    assert round_order(1, False, False) == ["offline", "molora", "vllm"]
    assert round_order(1, True, True) == ["molora"]


def test_per_round_ratios_pair_cells_within_their_own_round() -> None:
    run = {
        "molora": {"rounds": [[_cell("base", 8, 40.0)], [_cell("base", 8, 60.0)]]},
        "vllm": {"rounds": [[_cell("base", 8, 50.0)], [_cell("base", 8, 50.0)]]},
        "offline": {"rounds": [[_cell("base", 8, 80.0)]]},
    }
    assert per_round_ratios(run) == [
        {"round": 0, "mode": "base", "concurrency": 8, "vs_vllm": 0.8, "kept": 0.5},
        {"round": 1, "mode": "base", "concurrency": 8, "vs_vllm": 1.2},
    ]


def test_stop_leaves_nothing_of_the_session_behind() -> None:
    """A child that shrugs off SIGINT and SIGTERM (as Ray's workers may for a while) is gone
    when stop() returns, so the next server cannot meet the last one's port holder."""
    proc = subprocess.Popen(
        ["sh", "-c", "(trap '' INT TERM; sleep 60) & exec sleep 60"], start_new_session=True
    )
    deadline = time.monotonic() + 10
    while len(session_processes(proc, alive_only=True)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(session_processes(proc, alive_only=True)) == 2
    stop(proc, grace_s=1, linger_s=1)
    assert proc.returncode is not None
    deadline = time.monotonic() + 5  # a SIGKILLed process ends when next scheduled
    while session_processes(proc, alive_only=True) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert session_processes(proc, alive_only=True) == []


def test_greedy_agreement_counts_identical_texts_and_never_errors() -> None:
    ours = {"base": ["x", "y"], "a": ["ERROR 503", "z"]}
    theirs = {"base": ["x", "Y"], "a": ["ERROR 503"]}
    run = {"molora": {"sanity": {"texts": ours}}, "vllm": {"sanity": {"texts": theirs}}}
    assert agreement(run) == {"identical": 1, "of": 4, "which": ["base/0"]}
    assert agreement({"molora": run["molora"], "vllm": {"skipped": "no vLLM"}}) is None


def test_an_adapter_counts_as_applied_only_when_it_changed_a_text_without_an_error() -> None:
    texts = {"base": ["x", "y"], "a": ["x", "Y"], "b": ["x", "y"], "c": ["ERROR 404", "y"]}
    texts["d"] = ["z", "z"]
    assert adapters_applied(texts) == ["a", "d"]
    assert adapters_applied({**texts, "base": ["ERROR 503", "y"]}) == []
