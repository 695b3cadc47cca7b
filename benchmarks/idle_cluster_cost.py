"""What an idle `serve run` costs the engine beside it on the same cores.

The offline engine (`benchmarks.serve_offline`: the shipped replica layout, no Ray, no HTTP) is
timed on the endpoint benchmark's workload twice per round: once beside a MoLoRA `serve run`
that serves nothing, and once with that server's whole session frozen (SIGSTOP: a process that
cannot run takes no CPU and wakes nothing, yet keeps its memory, so nothing else changes). The
two alternate, in reversed order every other round. The gap is a floor under what the endpoint
can keep of the offline engine ("kept" in `serve_vs_vllm`): Ray's control plane (Serve
controller, HTTP proxy, router, GCS, raylet, dashboard) wakes up thousands of times a second, and
on a box where the engine's OpenMP team owns every core each wake-up pre-empts one of its
threads, which the others then wait for at the next barrier.

    .venv/bin/python -m benchmarks.idle_cluster_cost [--rounds 3] [--work DIR]

Writes `benchmarks/results/idle_cluster_cost.json` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.report import write_json
from benchmarks.serve_vs_vllm import (
    MOLORA_PORT,
    machine,
    make_assets,
    measure_offline,
    molora_config,
    replica_layout,
    session_processes,
    start_molora,
    stop,
    wait_up,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "idle_cluster_cost.json"
CELLS = [(1, 4), (8, 16), (32, 64)]


@contextlib.contextmanager
def frozen(proc: subprocess.Popen):
    """SIGSTOP the server's session for the block, SIGCONT after (even on error)."""
    pids = [p.pid for p in session_processes(proc, alive_only=True)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    try:
        yield len(pids)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def healthy(proc: subprocess.Popen) -> bool:
    """The thawed server still answers: freezing Ray whole must not have broken it."""
    try:
        wait_up(f"http://127.0.0.1:{MOLORA_PORT}/health", proc, timeout_s=60)
    except RuntimeError:
        return False
    return True


def offline_base(store: Path, dtype: str) -> dict[str, float]:
    """{"c=N": tok/s} of the offline engine on the base model."""
    rows = measure_offline(store, dtype, CELLS, ["base"])
    return {f"c={r['concurrency']}": r["tok_per_s"] for r in rows}


def summarize(rounds: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Per cell: the median tok/s under each condition and the median per-round ratio."""
    rows = []
    lines = [
        "| c | offline tok/s, server frozen | offline tok/s, server idle | idle ÷ frozen |",
        "|---|---|---|---|",
    ]
    for conc, _ in CELLS:
        key = f"c={conc}"
        frozen_tps = [r["frozen"][key] for r in rounds]
        idle_tps = [r["idle"][key] for r in rounds]
        ratio = statistics.median(i / f for i, f in zip(idle_tps, frozen_tps, strict=True))
        row = {
            "concurrency": conc,
            "frozen_tok_per_s": statistics.median(frozen_tps),
            "idle_tok_per_s": statistics.median(idle_tps),
            "idle_over_frozen": round(ratio, 3),
        }
        rows.append(row)
        lines.append(
            f"| {conc} | {row['frozen_tok_per_s']} | {row['idle_tok_per_s']} | {ratio:.2f} |"
        )
    return rows, lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--work", default=None, help="keep adapters/store here between runs")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()

    from molora_runtime.model.registry import resolve_model_path

    work = Path(args.work or tempfile.mkdtemp(prefix="idle-cluster-"))
    work.mkdir(parents=True, exist_ok=True)
    store = make_assets(work, resolve_model_path("smollm2-135m-instruct"))
    config = molora_config(store, args.dtype, work / f"molora_{args.dtype}.yaml")
    proc = start_molora(config, work / "molora_idle.log")
    rounds: list[dict[str, Any]] = []
    try:
        time.sleep(10)  # let start-up settle: the server is idle from here on
        for k in range(args.rounds):
            result: dict[str, Any] = {"round": k}
            order = ("idle", "frozen") if k % 2 == 0 else ("frozen", "idle")
            for condition in order:
                if condition == "frozen":
                    with frozen(proc) as n:
                        tps = offline_base(store, args.dtype)
                    result["frozen_processes"] = n
                    result["healthy_after_thaw"] = healthy(proc)
                else:
                    tps = offline_base(store, args.dtype)
                result[condition] = tps
            rounds.append(result)
            print(result, flush=True)
    finally:
        stop(proc)
    rows, table = summarize(rounds)
    print("\n".join(table))
    write_json(
        Path(args.out),
        {
            "benchmark": "idle_cluster_cost",
            "machine": machine(),
            "workload": {
                "engine": "offline, shipped replica layout",
                "layout": replica_layout(),
                "dtype": args.dtype,
                "mode": "base",
                "cells": [{"concurrency": c, "requests": n} for c, n in CELLS],
                "server": "MoLoRA serve run, idle (no requests) vs its session SIGSTOPped",
            },
            "rounds": rounds,
            "cells": rows,
            "table": table,
        },
    )


if __name__ == "__main__":
    main()
