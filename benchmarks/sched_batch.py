"""The cluster under SCHED_BATCH or SCHED_OTHER, on one running server, alternated in pairs.

`chrt --batch 0 make serve` starts the Ray cluster under `SCHED_BATCH` and the model replica moves
itself back to `SCHED_OTHER` (`deployments/replica/scheduling.py`). This benchmark starts one `serve run` of the endpoint
benchmark's config (fp32, one replica on every core), then flips every process of the server's
session except the model replica between the two policies (`chrt -a -p`) and drives the same
streaming base-model cells after each flip, the order reversed every other pair, so both sides
meet the same box. It prints each pair and writes the JSON.

    python -m benchmarks.sched_batch [--pairs 3] [--work DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
from typing import Any

from benchmarks import serve_vs_vllm as svv
from benchmarks.report import write_json

CELLS = [(8, 32), (32, 64)]  # (concurrency, requests)
POLICIES = {"other": "--other", "batch": "--batch"}


def set_cluster_policy(proc: subprocess.Popen, policy: str) -> int:
    """Every thread of every session process but the model replica to `policy`; how many."""
    moved = 0
    for p in svv.session_processes(proc, alive_only=True):
        if "ModelReplica" in p.label:
            continue
        done = subprocess.run(["chrt", POLICIES[policy], "-a", "-p", "0", str(p.pid)], check=False)
        moved += done.returncode == 0
    return moved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--work", default=None, help="keep adapters/store here between runs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    _, work, store, vocab_split = svv.prepare_assets(args.work, "sched-batch-")
    config = svv.molora_config(store, "float32", work / "molora_sched.yaml")
    proc = svv.start_molora(config, work / "molora_sched.log")
    models = svv.modes(vocab_split)["base"]
    rows: list[dict[str, Any]] = []
    try:
        asyncio.run(svv.run_cell(svv.MOLORA_PORT, models, 8, 8))  # warm-up
        for pair in range(args.pairs):
            order = ["other", "batch"] if pair % 2 == 0 else ["batch", "other"]
            for policy in order:
                processes = set_cluster_policy(proc, policy)
                for conc, n in CELLS:
                    cell = asyncio.run(svv.run_cell(svv.MOLORA_PORT, models, conc, n))
                    row = {"pair": pair, "cluster_policy": policy, "processes": processes}
                    row |= {k: cell[k] for k in ("concurrency", "tok_per_s", "itl_p99_ms")}
                    rows.append(row)
                    print(
                        f"pair {pair} {policy:<5} c={conc:<3} {cell['tok_per_s']:7.1f} tok/s  "
                        f"ITL p99 {cell['itl_p99_ms']:.0f} ms",
                        flush=True,
                    )
    finally:
        svv.stop(proc)
    summary = {}
    for conc, _ in CELLS:
        by = {
            pol: [
                r["tok_per_s"]
                for r in rows
                if r["concurrency"] == conc and r["cluster_policy"] == pol
            ]
            for pol in POLICIES
        }
        ratios = [b / o for b, o in zip(by["batch"], by["other"], strict=True)]
        summary[f"c{conc}"] = {
            "median_tok_per_s": {pol: statistics.median(v) for pol, v in by.items()},
            "batch_over_other_by_pair": [round(r, 2) for r in ratios],
        }
        print(f"c={conc}: batch / other by pair {summary[f'c{conc}']['batch_over_other_by_pair']}")
    if args.out:
        write_json(
            args.out, {"machine": svv.machine(), "cells": CELLS, "summary": summary, "rows": rows}
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
