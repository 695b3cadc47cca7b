"""Offline decode, side by side: vLLM-cpu's `LLM` vs MoLoRA's `LLMEngine`, CPU time per token.

On a shared box the endpoint's tok/s measures the neighbours as much as the server: a process
that waits for a core loses wall time, not CPU time. Here each side generates the endpoint
workload's base-model chats (64 greedy tokens, `ignore_eos`) for a batch of b sequences in its
own process on one thread (vLLM bound to core 0, in-process engine), and reports the process's
CPU seconds per output token (what the step costs) beside wall tok/s and the seconds its threads
ran and waited for a core (`/proc/self/task/*/schedstat`: how busy the box was). MoLoRA runs
once per CPU decode-attention kind (`MOLORA_CPU_ATTENTION`: `auto` = measured choice, and
`gathered` = the PyTorch path alone), the sides in ABC CBA order over `--rounds`.

    python -m benchmarks.offline_vs_vllm [--dtypes bfloat16 float32] [--batches 8 32] [--rounds 2]

Writes `benchmarks/results/offline_vs_vllm.json` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.vllm_env import vllm_cpu_env
from benchmarks.workload import MAX_MODEL_LEN, MAX_NUM_SEQS, NEW_TOKENS, PROMPTS

ROOT = Path(__file__).resolve().parents[1]
REPEATS = 2  # timed generations per process, after one warm-up
SIDES = ("vllm", "molora:auto", "molora:gathered")


def schedstat() -> tuple[float, float]:
    """Seconds this process's threads have run on a CPU and waited runnable for one."""
    ran = waited = 0
    for path in glob.glob("/proc/self/task/*/schedstat"):
        try:
            fields = Path(path).read_text().split()
        except OSError:  # a thread that just ended
            continue
        ran, waited = ran + int(fields[0]), waited + int(fields[1])
    return ran / 1e9, waited / 1e9


def timed(generate: Any) -> dict[str, float]:
    """One call of `generate() -> tokens`: CPU ms per token, tok/s, run and wait seconds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0, (ran0, waited0) = usage.ru_utime + usage.ru_stime, schedstat()
    start = time.perf_counter()
    tokens = generate()
    wall = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime - cpu0
    ran, waited = schedstat()
    return {"tokens": tokens, "cpu_ms_per_token": round(cpu / tokens * 1e3, 3),
            "tok_per_s": round(tokens / wall, 1), "ran_s": round(ran - ran0, 2),
            "waited_s": round(waited - waited0, 2)}  # fmt: skip


def chats(batch: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(batch)]


def vllm_worker(model: str, dtype: str, batch: int) -> list[dict[str, float]]:
    """Runs inside vLLM's interpreter (`VLLM_PYTHON`)."""
    from vllm import LLM, SamplingParams  # only the vLLM interpreter has it

    llm = LLM(model=model, dtype=dtype, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
              enforce_eager=True)  # fmt: skip
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    messages = chats(batch)

    def generate() -> int:
        outs = llm.chat(messages, sampling, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    generate()
    return [timed(generate) for _ in range(REPEATS)]


def molora_worker(store: str, dtype: str, batch: int) -> list[dict[str, float]]:
    # the engine's imports stay out of this module's top: vLLM's interpreter imports it too
    import torch

    from benchmarks.serve_offline import run_share
    from deployments.catalog.store import open_source
    from deployments.config import StoreConfig
    from molora_runtime.config import EngineConfig, HotSetConfig
    from molora_runtime.engine.engine import LLMEngine

    torch.set_num_threads(1)
    config = EngineConfig(model="smollm2-135m-instruct", device="cpu", dtype=dtype,
                          max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
                          max_num_batched_tokens=1024, max_queue_len=256,
                          hot_set=HotSetConfig(num_slots=4, max_rank=8))  # fmt: skip
    engine = LLMEngine(config, open_source(StoreConfig(url=store)))
    run_share(engine, "base", batch, batch, 0)
    return [timed(lambda: run_share(engine, "base", batch, batch, 0)[0]) for _ in range(REPEATS)]


def run_side(
    side: str, dtype: str, batch: int, model: str, store: str, vllm_python: str
) -> list[dict[str, float]]:
    """One side in a fresh process on one thread; its timed generations."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if side == "vllm":
        python = vllm_python
        env = {**vllm_cpu_env(), **env, "VLLM_CPU_OMP_THREADS_BIND": "0",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # fmt: skip
    else:
        python = sys.executable
        env["MOLORA_CPU_ATTENTION"] = side.split(":")[1]
    cmd = [python, "-m", "benchmarks.offline_vs_vllm", "--worker", side, "--dtype", dtype,
           "--batch", str(batch), "--model", model, "--store", store]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("[")]
    if out.returncode or not lines:
        raise RuntimeError(f"{side} worker failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(lines[-1])


def summarize(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Per side: median CPU ms/token and best tok/s over every timed generation."""
    out: dict[str, Any] = {}
    for side, samples in runs.items():
        out[side] = {
            "cpu_ms_per_token": statistics.median(s["cpu_ms_per_token"] for s in samples),
            "tok_per_s": max(s["tok_per_s"] for s in samples),
            "waited_s_per_run": round(statistics.median(s["waited_s"] for s in samples), 2),
        }
    vllm = out.get("vllm", {}).get("cpu_ms_per_token")
    for side in out:
        if vllm and side != "vllm":
            out[side]["vllm_cpu_per_token_ratio"] = round(vllm / out[side]["cpu_ms_per_token"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--batches", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", default=None, help="keep adapters/store here between runs")
    ap.add_argument("--out", default=None)
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="", help=argparse.SUPPRESS)
    ap.add_argument("--store", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        work = vllm_worker if args.worker == "vllm" else molora_worker
        target = args.model if args.worker == "vllm" else args.store
        print(json.dumps(work(target, args.dtype, args.batch)), flush=True)
        return
    drive(args)


def drive(args: argparse.Namespace) -> None:
    """Every (dtype, batch) cell: the sides in ABC CBA order per round; one JSON, one table."""
    # the project's imports stay out of the worker, which also runs in vLLM's interpreter
    from benchmarks.machine import machine_info
    from benchmarks.report import RESULTS_DIR, write_json
    from benchmarks.serve_vs_vllm import prepare_assets

    model_dir, _, store, _ = prepare_assets(args.work, "offline-vs-vllm-")
    load = {"before": os.getloadavg()}
    cells: dict[str, Any] = {}
    lines = ["| dtype | b | side | CPU ms/token | x vLLM (CPU/token) | best tok/s | waited s/run |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for dtype in args.dtypes:
        for batch in args.batches:
            runs: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
            for round_no in range(args.rounds):
                order = SIDES if round_no % 2 == 0 else tuple(reversed(SIDES))
                for side in order:
                    runs[side] += run_side(
                        side, dtype, batch, str(model_dir), str(store), args.vllm_python
                    )
            summary = summarize(runs)
            cells[f"{dtype}:b={batch}"] = {"summary": summary, "runs": runs}
            for side, row in summary.items():
                ratio = row.get("vllm_cpu_per_token_ratio", "-")
                lines.append(f"| {dtype} | {batch} | {side} | {row['cpu_ms_per_token']:.2f} | "
                             f"{ratio} | {row['tok_per_s']} | {row['waited_s_per_run']} |")  # fmt: skip
            print(lines[-3:], flush=True)
    load["after"] = os.getloadavg()
    print("\n".join(lines))
    out = args.out or RESULTS_DIR / "offline_vs_vllm.json"
    write_json(out, {"benchmark": "offline_vs_vllm", "machine_info": machine_info(),
                     "threads": 1, "repeats_per_process": REPEATS, "rounds": args.rounds,
                     "load_average": load, "cells": cells, "table": lines})  # fmt: skip


if __name__ == "__main__":
    main()
