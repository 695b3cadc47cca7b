"""Pick the fastest of several equivalent GEMM implementations by timing them on this machine.

Which CPU GEMM wins depends on the CPU (AVX2 only, AVX512-BF16, AMX), the weight's shape and
dtype and the number of rows: no rule written on one machine holds on another. So the candidates
are timed here, on the shape at hand, at the row counts serving runs (decode batches and a
prefill chunk), interleaved so the box's drift hits them alike, and the winner is the one with the
lowest weighted mean of its time relative to the fastest at each row count (decode rows weigh
more). The functions are generic: a candidate is a name and a way to run one GEMM of `m` rows;
any caller (base weights, the LM head, LoRA shrink/expand) can use them, and tests drive them
with a fake timer.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

Runner = Callable[[], object]
# A candidate: given a row count, a zero-argument callable that runs one GEMM of that many rows.
Candidate = Callable[[int], Runner]
Table = dict[str, dict[int, float]]  # candidate -> rows -> median seconds of one GEMM
Timer = Callable[[], float]

DECODE_ROWS = (1, 8, 32, 64)
PREFILL_ROWS = 256
# Decode steps run every token, a prefill chunk once per prompt chunk: decode rows weigh more.
ROW_WEIGHTS: dict[int, float] = {1: 1.0, 8: 2.0, 32: 2.0, 64: 1.0, PREFILL_ROWS: 0.5}
SAMPLE_SECONDS = 2e-4  # each timed sample repeats the GEMM until it lasts about this long


def measure(
    candidates: Mapping[str, Candidate],
    rows: Sequence[int],
    *,
    reps: int = 5,
    timer: Timer = time.perf_counter,
) -> Table:
    """Median seconds of one GEMM per candidate and row count, candidates interleaved within
    each repetition after one untimed warm-up call each."""
    table: Table = {name: {} for name in candidates}
    for m in rows:
        runners = {name: make(m) for name, make in candidates.items()}
        repeats: dict[str, int] = {}
        for name, run in runners.items():  # warm-up, and how many calls make one sample
            start = timer()
            run()
            once = max(timer() - start, 1e-9)
            repeats[name] = max(1, min(1000, math.ceil(SAMPLE_SECONDS / once)))
        samples: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(reps):
            for name, run in runners.items():
                start = timer()
                for _ in range(repeats[name]):
                    run()
                samples[name].append((timer() - start) / repeats[name])
        for name, values in samples.items():
            table[name][m] = statistics.median(values)
    return table


def scores(table: Table, weights: Mapping[int, float] | None = None) -> dict[str, float]:
    """Each candidate's weighted mean of (its time / the fastest time) over the row counts: 1.0
    for one that is fastest everywhere. Row counts missing from `weights` weigh 1."""
    weights = ROW_WEIGHTS if weights is None else weights
    rows = sorted({m for times in table.values() for m in times})
    best = {m: min(times[m] for times in table.values() if m in times) for m in rows}
    out = {}
    for name, times in table.items():
        if set(times) != set(rows):
            continue  # a candidate not timed at every row count cannot be compared
        total = sum(weights.get(m, 1.0) for m in rows)
        out[name] = sum(weights.get(m, 1.0) * times[m] / max(best[m], 1e-12) for m in rows) / total
    return out


def pick(
    table: Table,
    allowed: Iterable[str] | None = None,
    weights: Mapping[int, float] | None = None,
) -> str:
    """The candidate of `table` (among `allowed`) with the lowest score; ties go to the one
    listed first. Raises ValueError when none is left."""
    allowed_set = set(table) if allowed is None else set(allowed)
    ranked = {name: s for name, s in scores(table, weights).items() if name in allowed_set}
    if not ranked:
        raise ValueError(f"no candidate to pick among {sorted(allowed_set)} in {sorted(table)}")
    return min(ranked, key=lambda name: (ranked[name], list(table).index(name)))


def format_table(title: str, table: Table, winner: str) -> str:
    """A few lines an operator reads: microseconds per GEMM per row count, the winner marked."""
    rows = sorted({m for times in table.values() for m in times})
    score = scores(table)
    lines = [f"{title}: {winner}"]
    lines.append("  " + f"{'rows':<10}" + "".join(f"{m:>10}" for m in rows) + f"{'score':>8}")
    for name, times in table.items():
        mark = "*" if name == winner else " "
        cells = "".join(f"{times[m] * 1e6:>10.1f}" if m in times else f"{'-':>10}" for m in rows)
        lines.append(f"{mark} {name:<10}{cells}{score.get(name, math.nan):>8.2f}")
    return "\n".join(lines)
