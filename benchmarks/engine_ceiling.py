"""The offline engine's ceiling: tokens/s when the model costs almost nothing.

A tiny random Llama (hidden 64, 2 layers, 2 heads / 1 KV head, head_dim 32, SmolLM2's config and
tokenizer otherwise, fp32) is built at run time, so what the run measures is the engine's per-step
Python (scheduling, step inputs, sampling, detokenizing, outputs), not the model. `LLM.generate`
runs 128 chat prompts x 128 greedy tokens (`ignore_eos`) at each batch size, in rounds whose cell
order is reversed every other round (ABBA), and the best and median of each cell are reported,
with the process CPU time per generated token (steadier than tok/s on a shared box) and the load
average at the time.

    python -m benchmarks.engine_ceiling [--rounds 4] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.machine import machine_info
from benchmarks.report import write_json
from molora_runtime import LLM, SamplingParams
from molora_runtime.model.model_paths import resolve_model_path

BATCHES = (32, 64)
PROMPTS = 128
NEW_TOKENS = 128
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def make_tiny(folder: Path) -> Path:
    """SmolLM2's config shrunk to hidden 64 / 2 layers / 2 heads / 1 KV head, random weights."""
    src = resolve_model_path("smollm2-135m-instruct")
    cfg = AutoConfig.from_pretrained(src)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 64, 128, 2
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 2, 1, 32
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, folder / name)
    return folder


def run_cell(llm: LLM, batch: int) -> dict[str, Any]:
    """One `generate` over every prompt at `max_num_seqs`-bounded batch `batch`."""
    engine = llm.engine
    engine.config.max_num_seqs = batch
    engine.scheduler.max_num_seqs = batch
    msgs = [[{"role": "user", "content": f"Say something {i}"}] for i in range(PROMPTS)]
    sp = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    t0, c0 = time.perf_counter(), time.process_time()
    out = llm.generate(msgs, sp)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(o.token_ids) for o in out)
    return {
        "batch": batch,
        "tokens": tokens,
        "seconds": round(dt, 3),
        "tok_per_s": tokens / dt,
        "cpu_ms_per_token": round(cpu / tokens * 1e3, 4),
        "load_avg_1m": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/engine_ceiling.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="engine-ceiling-"))
    try:
        model = make_tiny(work / "tiny")
        llm = LLM(
            model=str(model),
            dtype="float32",
            device="cpu",
            max_num_seqs=max(BATCHES),
            max_model_len=1024,
            max_num_batched_tokens=2048,
        )
        llm.generate([[{"role": "user", "content": "warm up"}]] * 4, SamplingParams(max_tokens=8))
        rows: list[dict[str, Any]] = []
        for r in range(args.rounds):
            order = BATCHES if r % 2 == 0 else tuple(reversed(BATCHES))
            for b in order:
                rows.append({"round": r, **run_cell(llm, b)})
                print(f"round {r} b={b}: {rows[-1]['tok_per_s']:,.0f} tok/s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cells = []
    print(f"\n{'batch':>6} {'best tok/s':>11} {'median tok/s':>13} {'CPU ms/token':>13}")
    for b in BATCHES:
        mine = [row for row in rows if row["batch"] == b]
        rates = [row["tok_per_s"] for row in mine]
        cpu = statistics.median(row["cpu_ms_per_token"] for row in mine)
        cell = {
            "batch": b,
            "best": round(max(rates)),
            "median": round(statistics.median(rates)),
            "cpu_ms_per_token": cpu,
        }
        cells.append(cell)
        print(f"{b:>6} {cell['best']:>11,} {cell['median']:>13,} {cpu:>13.3f}")
    result = {
        "benchmark": "engine_ceiling",
        "model": "tiny random Llama (hidden 64, 2 layers, 2 heads / 1 KV head), SmolLM2 tokenizer",
        "workload": {"prompts": PROMPTS, "new_tokens": NEW_TOKENS, "greedy": True},
        "threads": args.threads,
        "cells": cells,
        "rounds": rows,
        "machine_info": machine_info(),
    }
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
