"""Many adapters at the endpoint, side by side: MoLoRA `serve run` vs vLLM's OpenAI server.

The same folder of N PEFT adapters (SmolLM2-135M-Instruct, LoRA on q_proj/v_proj, rank 8, or
ranks 8/16/64 mixed with `--ranks 8 16 64`: then MoLoRA's slots are rank pools in the bytes of
vLLM's slots padded to rank 64) is what both servers serve: vLLM (`make vllm-env`, threads bound
to every core) registers every folder with `--lora-modules` (`--max-loras 8 --max-cpu-loras 64`,
`--max-loras` to change); MoLoRA runs as `make serve` runs it (the router serves HTTP; hot-set
slots `auto`, on CPU two per sequence of a step, `--slots` to change) with the folder as a
`peft:` store. One streaming client sends the same seeded trace to both: `--requests` chat
requests of 64 tokens, greedy, `ignore_eos`, at concurrency `--concurrency`, each naming an
adapter drawn Zipf(`--zipf`) over the N; every MoLoRA run starts with an empty adapter disk
cache (the store is read afresh, as vLLM reads it). Per cell: tok/s, TTFT p50/p99, ITL p99,
CPU ms per output token of every server process, and for MoLoRA the adapter loads per request
by tier (slot, host, disk, store) from its admin stats. `--store-n 10000` adds a MoLoRA run on a
store of 10,000 folders to each cell, the requests still drawing from the first N: what the
store's size alone costs. Rounds run in reversed order every other round; the table pairs each
side's best round.

    .venv/bin/python -m benchmarks.many_adapters [--n 8 1000] [--dtypes float32] [--rounds 1]

Writes `benchmarks/results/many_adapters.json` and `docs/figures/many_adapters.png`, and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
import yaml
from safetensors.torch import save_file

from benchmarks.chat_stream import run_cell
from benchmarks.machine import machine_info
from benchmarks.report import RESULTS_DIR, write_json
from benchmarks.server_process import (
    MOLORA_PORT,
    CpuMeter,
    bench_config,
    start_molora,
    start_vllm,
    stop,
    vllm_binding,
)
from benchmarks.vllm_env import VLLM_PYTHON
from molora_runtime.model.arch import load_arch
from molora_runtime.model.model_paths import resolve_model_path

RESULTS = RESULTS_DIR / "many_adapters.json"
FIGURE = Path(__file__).resolve().parents[1] / "docs" / "figures" / "many_adapters.png"
VLLM_PORT = 18433
TARGETS = ("q_proj", "v_proj")
SLOTS = 8
CPU_LORAS = 64
MAX_NUM_SEQS = 32
MAX_MODEL_LEN = 1024
TIERS = ("slot", "host", "disk")
EXPORT_PERIOD_S = 11.0  # Ray's metrics report period (10 s) and a second of slack
TIER_SERIES = re.compile(
    r'^molora_tier_(?P<what>hits|loads)_total\{[^}]*tier="(?P<tier>\w+)"[^}]*\} (?P<value>\S+)'
)


# ---- assets ---------------------------------------------------------------------------------


def adapter_names(n: int) -> list[str]:
    return [f"ad{i:05d}" for i in range(n)]


def write_adapter(folder: Path, model_dir: Path, rank: int, seed: int) -> None:
    """One PEFT LoRA folder with seeded weights that change the model's greedy text."""
    arch = load_arch(model_dir)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for module in TARGETS:
            d_in, d_out = arch.linear_shape(module)
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * 0.05
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.05
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_store(work: Path, model_dir: Path, n: int, ranks: list[int]) -> Path:
    """`work/store-<n>-r<ranks>/`: n PEFT folders (rank `ranks[i % len(ranks)]`), made once."""
    store = work / f"store-{n}-r{'-'.join(map(str, ranks))}"
    done = store / ".done"
    if done.is_file():
        return store
    for i, name in enumerate(adapter_names(n)):
        if not (store / name / "adapter_config.json").is_file():
            write_adapter(store / name, model_dir, ranks[i % len(ranks)], seed=1000 + i)
    done.write_text("ok\n")
    return store


def zipf_trace(n: int, requests: int, s: float, seed: int) -> list[str]:
    """`requests` adapter names drawn Zipf(s) over the n (popularity order seeded, not by name)."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n + 1) ** s
    order = rng.permutation(n)
    names = adapter_names(n)
    picks = rng.choice(n, size=requests, p=weights / weights.sum())
    return [names[order[k]] for k in picks]


# ---- servers --------------------------------------------------------------------------------


def hot_set(ranks: list[int], slots: int | str, max_loras: int) -> dict[str, Any]:
    """MoLoRA's hot-set: `slots` (`auto`: as `make serve` sizes it) for one rank; for mixed
    ranks, rank pools in the bytes vLLM's `max_loras` slots take padded to the largest rank (the
    same number of slots per rank)."""
    if len(set(ranks)) == 1:
        return {"num_slots": slots, "max_rank": ranks[0]}
    per_rank = max_loras * max(ranks) // sum(set(ranks))
    return {"rank_pools": [{"rank": r, "slots": per_rank} for r in sorted(set(ranks))]}


def molora_config(store: Path, dtype: str, hot: dict[str, Any], path: Path) -> Path:
    """serve_config.yaml as `make serve` runs it, on the benchmark's limits and the peft store."""
    cfg = bench_config(max_num_seqs=MAX_NUM_SEQS, max_queue_len=512, dtype=dtype,
                       max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=1024)  # fmt: skip
    args = cfg["applications"][0]["args"]
    args["engine"]["hot_set"] = hot
    args["store"] = {"url": f"peft:{store}", "cache_dir": str(path.parent / "molora-cache")}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def empty_disk_cache(cache: Path) -> None:
    """No adapter file on the replica's disk, as on a node that never served one (vLLM reads the
    folders afresh too); the folders' derived catalog facts (`.peft-derived`) are kept, so a
    10,000-folder store does not re-derive at every start. Else the first run of a store fetched
    every adapter and later ones none: the rounds were not alike."""
    if cache.is_dir():
        for entry in cache.iterdir():
            if entry.is_dir() and entry.name != ".peft-derived":
                shutil.rmtree(entry)
            elif entry.is_file():
                entry.unlink()


def vllm_args(store: Path, names: list[str], max_rank: int, max_loras: int) -> tuple[str, ...]:
    modules = [f"{n}={store / n}" for n in names]
    cpu_loras = max(CPU_LORAS, max_loras)
    return ("--enable-lora", "--max-loras", str(max_loras), "--max-cpu-loras", str(cpu_loras),
            "--max-lora-rank", str(max_rank), "--lora-modules", *modules)  # fmt: skip


def tier_counts(port: int) -> dict[str, dict[str, int]] | None:
    """MoLoRA's per-tier hit and load counters, summed over replicas from `/metrics` (open with
    auth off, as `make serve` runs); None if they cannot be read."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    counts: dict[str, dict[str, int]] = {t: {"hits": 0, "loads": 0} for t in TIERS}
    seen = False
    for line in text.splitlines():
        match = TIER_SERIES.match(line)
        if match and match["tier"] in counts:
            counts[match["tier"]][match["what"]] += int(float(match["value"]))
            seen = True
    return counts if seen else None


def settled_tier_counts(port: int) -> dict[str, dict[str, int]] | None:
    """The tier counters once they stop moving: Ray's exporter publishes them every
    `EXPORT_PERIOD_S`, and the API port may answer with its previous scrape, so one read right
    after a run can still show the counts from before it."""
    deadline = time.monotonic() + 6 * EXPORT_PERIOD_S
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        counts = tier_counts(port)
        if counts != last:
            last, since = counts, time.monotonic()
        elif counts is not None and time.monotonic() - since > EXPORT_PERIOD_S:
            return counts
        time.sleep(1.0)
    return last


def loads_per_request(
    before: dict[str, dict[str, int]] | None, after: dict[str, dict[str, int]] | None, n: int
) -> dict[str, float] | None:
    """Per request of the cell: slot hits, and loads into slots, host memory and disk (a disk
    load is a fetch from the store)."""
    if not before or not after:
        return None
    delta = {t: {k: after[t].get(k, 0) - before[t].get(k, 0) for k in ("hits", "loads")}
             for t in TIERS if t in before and t in after}  # fmt: skip
    out = {"slot_hit": delta.get("slot", {}).get("hits", 0) / n}
    for tier in TIERS:
        out[f"{tier}_loads"] = delta.get(tier, {}).get("loads", 0) / n
    out["store_fetches"] = out.pop("disk_loads")
    return {k: round(v, 3) for k, v in out.items()}


def cpu_ms_per_token(server_s: dict[str, float], tokens: int) -> dict[str, float]:
    """Each server process's CPU ms per output token (process labels lose their pid)."""
    out: dict[str, float] = {}
    for label, seconds in server_s.items():
        name = label.rsplit(" ", 1)[0]
        out[name] = round(out.get(name, 0.0) + 1000 * seconds / max(tokens, 1), 2)
    return out


def drive(port: int, trace: list[str], conc: int, proc: Any, molora: bool) -> dict[str, Any]:
    """Warm up on the trace's first adapters, then run the trace once, timed."""
    warm = [(name, None) for name in dict.fromkeys(trace[:SLOTS])]
    asyncio.run(run_cell(port, warm, min(conc, len(warm)), len(warm)))
    before = settled_tier_counts(port) if molora else None
    with CpuMeter(proc) as cpu:
        row = asyncio.run(run_cell(port, [(name, None) for name in trace], conc, len(trace)))
    if molora:
        row["loads_per_request"] = loads_per_request(before, settled_tier_counts(port), len(trace))
    row["cpu_ms_per_token"] = cpu_ms_per_token(cpu.server_s, row["completion_tokens"])
    row["client_cpu_s"] = cpu.client_s
    return row


# ---- main -----------------------------------------------------------------------------------


def run_server(server: str, store: Path, names: list[str], trace: list[str], dtype: str,
               ranks: list[int], slots: int | str, max_loras: int, conc: int, work: Path,
               vllm_python: Path) -> dict[str, Any]:  # fmt: skip
    """One server's cell: start on the store, time the trace, stop."""
    started = time.monotonic()
    log = work / f"{server.replace('@', '_store')}_{len(names)}_{dtype}.log"
    if server == "vllm":
        proc = start_vllm(vllm_python, resolve_model_path("smollm2-135m-instruct"), log,
                          VLLM_PORT, dtype=dtype, max_model_len=MAX_MODEL_LEN,
                          max_num_seqs=MAX_NUM_SEQS, extra=vllm_args(store, names, max(ranks), max_loras))  # fmt: skip
        port = VLLM_PORT
    else:
        hot = hot_set(ranks, slots, max_loras)
        config = molora_config(store, dtype, hot, work / f"molora_{dtype}.yaml")
        empty_disk_cache(work / "molora-cache")
        proc = start_molora(config, log)
        port = MOLORA_PORT
    try:
        row = drive(port, trace, conc, proc, server != "vllm")
    finally:
        stop(proc)
    row["startup_and_run_s"] = round(time.monotonic() - started, 1)
    if server == "vllm":
        row["thread_binding"] = vllm_binding(log)
    return row


def summarize(cells: list[dict[str, Any]]) -> list[str]:
    head = ("| N | ranks | dtype | server | tok/s | TTFT p50 / p99 (s) | ITL p99 (ms) | "
            "slot hit | store fetch / req | ratio |")  # fmt: skip
    table = [head, "|" + "---|" * 10]
    for cell in cells:
        best = cell["best"]
        n = cell["n"]
        vllm_tps = (best.get("vllm") or {}).get("tok_per_s")
        own_tps = (best.get("molora") or {}).get("tok_per_s")
        for server in cell["store_folders"]:
            row = best.get(server)
            if row is None:
                skipped = cell.get("skipped", {}).get(server)
                if skipped:
                    table.append(f"| {n} | {cell['ranks']} | {cell['dtype']} | "
                                 f"{server} | skipped: {skipped} | | | | | |")  # fmt: skip
                continue
            loads = row.get("loads_per_request") or {}
            ratio = ""
            if server == "molora" and vllm_tps:
                ratio = f"**{row['tok_per_s'] / vllm_tps:.2f}** ÷ vLLM"
            elif server.startswith("molora@") and own_tps:
                ratio = f"**{row['tok_per_s'] / own_tps:.2f}** ÷ {n} folders"
            if server.startswith("molora@"):
                server = f"molora, {cell['store_folders'][server]} folders in the store"
            ttft = f"{_s(row['ttft_p50_ms'])} / {_s(row['ttft_p99_ms'])}"
            table.append(
                f"| {n} | {cell['ranks']} | {cell['dtype']} | {server} | "
                f"{row['tok_per_s']} | {ttft} | {row['itl_p99_ms']} | "
                f"{loads.get('slot_hit', '')} | {loads.get('store_fetches', '')} | {ratio} |"
            )
    return table


def _slots(text: str) -> int | str:
    return text if text == "auto" else int(text)


def _s(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.2f}"


def plot(cells: list[dict[str, Any]], path: Path) -> None:
    """tok/s against N per server and dtype (log-x), as a PNG beside the JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[str, list[tuple[int, float]]] = {}
    for cell in cells:
        for server, row in cell["best"].items():
            if row:
                key = f"{server} {cell['dtype']} r={cell['ranks']}"
                series.setdefault(key, []).append((cell["n"], row["tok_per_s"]))
    for key, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=key)
    ax.set_xscale("log")
    ax.set_xlabel("adapters in the store (N)")
    ax.set_ylabel("output tok/s (c=32)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", nargs="+", type=int, default=[8, 100, 1000, 10000])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[8], help="e.g. 8 16 64 (mixed)")
    ap.add_argument("--store-n", nargs="*", type=int, default=[],
                    help="MoLoRA also runs on stores of these many folders (those above N) while "
                    "requests still draw from the first N, in the same rounds: what a store's "
                    "size alone costs")  # fmt: skip
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--slots", type=_slots, default="auto",
                    help="MoLoRA's hot_set.num_slots (default auto, as make serve sizes it)")  # fmt: skip
    ap.add_argument("--max-loras", type=int, default=SLOTS, help="vLLM's --max-loras")
    ap.add_argument("--vllm-max-n", type=int, default=1000,
                    help="vLLM registers every adapter on its command line; above this N it "
                    "is skipped with that reason")  # fmt: skip
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--vllm-python", default=str(VLLM_PYTHON))
    ap.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "molora-many-adapters",
        help="the adapter folders are made once and kept here (default: in the temp dir)",
    )
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)

    model_dir = resolve_model_path("smollm2-135m-instruct")
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    vllm_python = Path(args.vllm_python)
    cells = []
    for n in args.n:
        stores = {"vllm": n, "molora": n, **{f"molora@{s}": s for s in args.store_n if s > n}}
        paths = {s: make_store(work, model_dir, s, args.ranks) for s in set(stores.values())}
        names = adapter_names(n)
        trace = zipf_trace(n, args.requests, args.zipf, args.seed)
        for dtype in args.dtypes:
            cell: dict[str, Any] = {"n": n, "store_folders": stores,
                                    "ranks": "/".join(map(str, args.ranks)),
                                    "dtype": dtype, "distinct_in_trace": len(set(trace)),
                                    "rounds": [], "skipped": {}}  # fmt: skip
            if args.skip_vllm:
                cell["skipped"]["vllm"] = "--skip-vllm"
            elif not vllm_python.is_file():
                cell["skipped"]["vllm"] = f"{vllm_python} not found: run `make vllm-env`"
            elif n > args.vllm_max_n:
                cell["skipped"]["vllm"] = f"N > --vllm-max-n {args.vllm_max_n}"
            for round_no in range(args.rounds):
                order = [s for s in stores if s not in cell["skipped"]]
                order = order[::-1] if round_no % 2 else order  # rounds in reversed order
                rows: dict[str, Any] = {}
                for server in order:
                    rows[server] = run_server(server, paths[stores[server]], names, trace, dtype,
                                              args.ranks, args.slots, args.max_loras,
                                              args.concurrency, work, vllm_python)  # fmt: skip
                    print(json.dumps({"n": n, "dtype": dtype, "server": server, **rows[server]}),
                          flush=True)  # fmt: skip
                cell["rounds"].append({"order": order, **rows})
            cell["best"] = {
                server: max((r[server] for r in cell["rounds"] if server in r),
                            key=lambda row: row["tok_per_s"], default=None)
                for server in stores
            }  # fmt: skip
            cells.append(cell)
    table = summarize(cells)
    print("\n".join(table))
    out = Path(args.out)
    write_json(
        out,
        {
            "benchmark": "many_adapters",
            "machine": machine_info(),
            "workload": {
                "model": "SmolLM2-135M-Instruct",
                "adapters": f"PEFT LoRA on {'/'.join(TARGETS)}, ranks {args.ranks}",
                "requests": args.requests,
                "concurrency": args.concurrency,
                "max_tokens": 64,
                "sampling": "greedy, ignore_eos, streaming chat",
                "trace": f"Zipf({args.zipf}) over N, seed {args.seed}",
                "vllm": f"--max-loras {args.max_loras} --max-cpu-loras "
                f"{max(CPU_LORAS, args.max_loras)}, every adapter in --lora-modules",
                "molora": "serve run as make serve runs it, hot set "
                f"{hot_set(args.ranks, args.slots, args.max_loras)}, peft: store, "
                "every run from an empty adapter disk cache",
            },
            "cells": cells,
            "table": table,
        },
    )
    try:
        plot(cells, FIGURE if out == RESULTS else out.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed: no plot")


if __name__ == "__main__":
    main()
