"""The offline engine on the endpoint benchmark's workload and replica layout (the yardstick for
what the serving layer keeps).

`benchmarks.serve_vs_vllm` calls this once per dtype: one process per model replica of the
shipped layout (`num_replicas` x `num_cpus` torch threads each), every process serving its
share of each cell's requests (`share_of`: `c / replicas` in flight), through `LLMEngine`
directly (no Ray, no HTTP). Same prompts, chat template, adapters, 64 greedy tokens with
`ignore_eos`.
A cell's tok/s is all tokens over the slowest process's time.

    python -m benchmarks.serve_offline --store DIR --dtype bfloat16 --cells 8:32 32:64 \
        --modes base single mixed [--replicas 2 --threads 1]

Prints one JSON object: {"cells": [{mode, concurrency, requests, tok_per_s, ...}, ...]}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.workload import MAX_MODEL_LEN, MAX_NUM_SEQS, NEW_TOKENS, PROMPTS, modes
from deployments.catalog.store import open_source
from deployments.config import StoreConfig
from molora_runtime.config import EngineConfig, HotSetConfig
from molora_runtime.engine.engine import LLMEngine
from molora_runtime.engine.llm import as_route
from molora_runtime.engine.types import GenerationRequest, SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def _requests(mode: str, n: int, offset: int) -> list[tuple[list[dict[str, str]], Any]]:
    models = modes(1)[mode]  # the vocab split is unused by the modes run here
    picked = []
    for i in range(offset, offset + n):
        model, _ = models[i % len(models)]
        route = None if model == "base" else model
        picked.append(([{"role": "user", "content": PROMPTS[i % 8]}], route))
    return picked


def run_share(engine: Any, mode: str, conc: int, n: int, offset: int) -> tuple[int, float]:
    """Tokens and seconds of `n` requests with at most `conc` in flight."""
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    pending = []
    for i, (messages, route) in enumerate(_requests(mode, n, offset)):
        req = GenerationRequest(
            request_id=f"{mode}-{conc}-{offset + i}",
            route=as_route(route),
            sampling=sampling,
            messages=messages,
        )
        pending.append(req)
    tokens = in_flight = 0
    start = time.perf_counter()
    queue = iter(pending)
    nxt = next(queue, None)
    while nxt is not None or in_flight:
        while nxt is not None and in_flight < conc:
            engine.add_request(nxt, engine.validate_request(nxt))  # tokenized as a server does
            in_flight += 1
            nxt = next(queue, None)
        for out in engine.step():
            tokens += len(out.new_token_ids)
            in_flight -= bool(out.finished)
    return tokens, time.perf_counter() - start


def share_of(conc: int, n: int, replicas: int, rank: int) -> tuple[int, int, int]:
    """Replica `rank`'s (concurrency, requests, first request index) of a cell: the cell's
    `conc` in-flight requests spread over the replicas, each serving requests in proportion to
    its concurrency. Below one request per replica some replicas get none: at c=1 one process
    serves every request, as one replica does at the endpoint (not c=1 in each process)."""
    concs = [conc // replicas + (k < conc % replicas) for k in range(replicas)]
    counts = [n * c // conc for c in concs]
    counts[0] += n - sum(counts)
    return concs[rank], counts[rank], sum(counts[:rank])


def worker(args: argparse.Namespace) -> None:
    """One replica's share: print one JSON line per cell."""
    torch.set_num_threads(args.threads)
    config = EngineConfig(
        model="smollm2-135m-instruct",
        device="cpu",
        dtype=args.dtype,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=1024,
        max_queue_len=256,
        hot_set=HotSetConfig(num_slots=4, max_rank=8),
    )
    engine = LLMEngine(config, open_source(StoreConfig(url=args.store)))
    run_share(engine, "mixed", 4, 4 * args.replicas, 0)  # warm up every adapter
    for cell in args.cells:
        conc, n = (int(x) for x in cell.split(":"))
        share_c, share_n, offset = share_of(conc, n, args.replicas, args.rank)
        for mode in args.modes:
            tokens, seconds = (
                run_share(engine, mode, share_c, share_n, offset) if share_c else (0, 0.0)
            )
            print(json.dumps({"mode": mode, "concurrency": conc, "requests": share_n,
                              "tokens": tokens, "seconds": seconds}), flush=True)  # fmt: skip


def measure(
    store: Path, dtype: str, cells: list[tuple[int, int]], mode_names: list[str],
    replicas: int, threads: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """Run the replica processes side by side; combine their cells."""
    cmd = [sys.executable, "-m", "benchmarks.serve_offline", "--worker", "--store", str(store),
           "--dtype", dtype, "--modes", *mode_names, "--replicas", str(replicas),
           "--threads", str(threads), "--cells", *[f"{c}:{n}" for c, n in cells]]  # fmt: skip
    procs = [
        subprocess.Popen([*cmd, "--rank", str(k)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        for k in range(replicas)
    ]
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"offline worker failed: {[p.returncode for p in procs]}")
    per_rank = [[json.loads(line) for line in out.splitlines() if line.startswith("{")]
                for out in outputs]  # fmt: skip
    rows = []
    for parts in zip(*per_rank, strict=True):
        tokens = sum(p["tokens"] for p in parts)
        seconds = max(p["seconds"] for p in parts)  # a replica with no share took 0 s
        rows.append({
            "mode": parts[0]["mode"], "concurrency": parts[0]["concurrency"],
            "requests": sum(p["requests"] for p in parts), "completion_tokens": tokens,
            "seconds": round(seconds, 2), "tok_per_s": round(tokens / seconds, 1),
        })  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cells", nargs="+", default=["8:32", "32:64"], help="concurrency:requests")
    ap.add_argument("--modes", nargs="+", default=["base", "single", "mixed"])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    cells = [tuple(int(x) for x in c.split(":")) for c in args.cells]
    rows = measure(Path(args.store), args.dtype, cells, args.modes, args.replicas, args.threads)  # type: ignore[arg-type]
    print(json.dumps({"cells": rows}, indent=1))


if __name__ == "__main__":
    main()
