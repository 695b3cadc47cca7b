"""Pick the fastest of several equivalent implementations by timing them on this machine.

Which CPU kernel wins depends on the CPU (AVX2 only, AVX512-BF16, AMX), the operand's shape and
dtype and the batch: no rule written on one machine holds on another. So every decision of this
kind (the base GEMMs, decode attention, the LoRA delta) goes through one `Chooser`:

1. the pick made earlier in this process for the same shape key and override;
2. an operator's override, one environment variable per decision (`auto` by default; a
   misspelled value is refused, one that cannot run here is warned about and measured);
3. this machine's stored table (`kernels.choice_cache`: keyed by CPU model, flags, torch
   version and threads, then by shape key), as long as it covers every candidate;
4. else the caller's measuring function, whose table is stored.

The winner is the candidate with the lowest weighted mean of its time relative to the fastest at
each size (decode rows weigh more). A chooser knows names and tables only: what a candidate runs
and how it is timed is its caller's (`measure` below times `Candidate`s interleaved, which the
GEMM and attention callers use; tests drive it with a fake timer).
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from kernels import choice_cache
from kernels.choice_cache import Table

log = logging.getLogger(__name__)

Runner = Callable[[], object]
# A candidate: given a size (rows, batch), a zero-argument callable that runs one call that big.
Candidate = Callable[[int], Runner]
Timer = Callable[[], float]
# The caller's measuring function: the table of the named candidates.
Measure = Callable[[Sequence[str]], Table]

DECODE_ROWS = (1, 8, 32, 64)
PREFILL_ROWS = 256
# Decode steps run every token, a prefill chunk once per prompt chunk: decode rows weigh more.
ROW_WEIGHTS: dict[int, float] = {1: 1.0, 8: 2.0, 32: 2.0, 64: 1.0, PREFILL_ROWS: 0.5}
SAMPLE_SECONDS = 2e-4  # each timed sample repeats the call until it lasts about this long


def measure(
    candidates: Mapping[str, Candidate],
    sizes: Sequence[int],
    *,
    reps: int = 5,
    timer: Timer = time.perf_counter,
) -> Table:
    """Median seconds of one call per candidate and size, candidates interleaved within each
    repetition (so the box's drift hits them alike) after one untimed warm-up call each."""
    table: Table = {name: {} for name in candidates}
    for m in sizes:
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
    """Each candidate's weighted mean of (its time / the fastest time) over the sizes: 1.0 for
    one that is fastest everywhere. Sizes missing from `weights` weigh 1."""
    weights = ROW_WEIGHTS if weights is None else weights
    rows = sorted({m for times in table.values() for m in times})
    best = {m: min(times[m] for times in table.values() if m in times) for m in rows}
    out = {}
    for name, times in table.items():
        if set(times) != set(rows):
            continue  # a candidate not timed at every size cannot be compared
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


def format_table(title: str, table: Table, winner: str, size: str = "rows") -> str:
    """A few lines an operator reads: microseconds per call by size, the winner marked."""
    rows = sorted({m for times in table.values() for m in times})
    score = scores(table)
    lines = [f"{title}: {winner}"]
    lines.append("  " + f"{size:<10}" + "".join(f"{m:>10}" for m in rows) + f"{'score':>8}")
    for name, times in table.items():
        mark = "*" if name == winner else " "
        cells = "".join(f"{times[m] * 1e6:>10.1f}" if m in times else f"{'-':>10}" for m in rows)
        lines.append(f"{mark} {name:<10}{cells}{score.get(name, math.nan):>8.2f}")
    return "\n".join(lines)


class Chooser:
    """One decision (say, the CPU GEMM kind): its override variable `env` naming one of
    `kinds`, its picks per shape key in this process, and its log lines (`title`, what a
    table's times and sizes are, `unit` and `size`, written to `logger`)."""

    def __init__(
        self, title: str, env: str, kinds: Sequence[str], unit: str = "us per call by size",
        size: str = "rows", logger: logging.Logger = log,
    ) -> None:  # fmt: skip
        self.title, self.env, self.kinds = title, env, tuple(kinds)
        self.unit, self.size = unit, size
        self.log = logger  # the caller's, so an operator finds each decision under its module
        # (memo key, the override's raw value) -> pick, decided once per process
        self._chosen: dict[tuple[str, str | None], str] = {}
        self._lock = threading.Lock()

    def forced(self) -> str | None:
        """The kind `env` forces, or None for `auto`; any value outside `kinds` is refused."""
        value = os.environ.get(self.env, "auto").strip().lower()
        if value == "auto":
            return None
        if value not in self.kinds:
            raise ValueError(
                f"{self.env}={value!r}: expected auto or one of {', '.join(self.kinds)}"
            )
        return value

    def choose(
        self,
        key: str,
        runnable: Sequence[str],
        measure: Measure,
        *,
        narrow: Callable[[list[str]], list[str]] | None = None,
        narrowed: str = "left out",
        memo_key: str | None = None,
        weights: Mapping[int, float] | None = None,
    ) -> str:
        """The kind shape `key` runs on among `runnable` (in preference order for ties): picked
        earlier in this process under the same override (by `memo_key`, default `key`; a pick
        holds until `forget`, so a caller on a hot path pays one lookup), forced, from this
        machine's stored table, or measured now by `measure` (and stored); logged once when
        measured or read. `narrow` restricts the candidates further where a property, not
        speed, decides (the kinds it drops are logged after `narrowed`)."""
        memo = (key if memo_key is None else memo_key, os.environ.get(self.env))
        chosen = self._chosen.get(memo)
        if chosen is not None:
            return chosen
        runnable = list(runnable)
        forced = self.forced()
        if forced is not None and forced in runnable:
            self._chosen[memo] = forced
            return forced
        if forced is not None:
            self.log.warning(
                "%s=%s cannot run %s here; choosing by measurement", self.env, forced, key
            )
        if len(runnable) == 1:  # nothing to measure
            self._chosen[memo] = runnable[0]
            return runnable[0]
        with self._lock:
            chosen = self._chosen.get(memo)
            if chosen is not None:
                return chosen
            kinds = runnable if narrow is None else narrow(runnable)
            table = choice_cache.load(key)
            source = "stored"
            if table is None or not set(kinds) <= set(table):
                table = measure(kinds)
                choice_cache.store(key, table)
                source = "measured"
            winner = pick(table, allowed=kinds, weights=weights)
            self._chosen[memo] = winner
        dropped = [kind for kind in runnable if kind not in kinds]
        note = f"; {narrowed}: {', '.join(dropped)}" if dropped else ""
        title = f"{self.title} for {key} ({source}, {self.unit}{note})"
        self.log.info("%s", format_table(title, table, winner, self.size))
        return winner

    def forget(self) -> None:
        """Drop this process's picks (tests, or an override changed in the environment)."""
        with self._lock:
            self._chosen.clear()
