"""The serving stack's ceiling: how many tokens/s the path from engine to client carries when
the model costs almost nothing (as a fast accelerator makes it), MoLoRA vs vLLM.

A tiny random Llama is built at run time (hidden 64, 2 layers, 2 heads / 1 KV head, head_dim
32, fp32; the embedded SmolLM2's tokenizer, chat template and config otherwise) and served by
vLLM's OpenAI server (threads bound to every core, `--max-num-seqs 64`) and by MoLoRA
`serve run` on the shipped layout (`max_num_seqs 64`, Ray workers at nice 0; the replica on
`FREE_MODEL_REPLICA_CPUS`, as a GPU replica computes off its CPU threads). One streaming
chat client (128 tokens, `ignore_eos`, greedy) drives each at c=32/64/128. Per cell: tok/s,
TTFT p50/p99, ITL p50/p99 and CPU milliseconds per generated token summed over every process
of the server (from /proc), plus the client's own CPU; and the offline engine (`LLM`, no Ray,
no HTTP) on the same model at b=64, on both cores and on the replica's one. Rounds run vLLM,
MoLoRA, offline, then the reverse (ABBA).

    .venv/bin/python -m benchmarks.serve_ceiling [--quick] [--rounds 2] [--proxy-ingress]

`--quick`: c=64 only, one round. Writes `benchmarks/results/serve_ceiling.json`, prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks import server_process as servers
from benchmarks.chat_stream import Sample, one, pct
from benchmarks.machine import machine_info
from benchmarks.report import RESULTS_DIR, write_json
from benchmarks.vllm_env import VLLM_PYTHON, vllm_cpu_env
from molora_runtime import LLM, SamplingParams
from molora_runtime.model.model_paths import resolve_model_path

RESULTS = RESULTS_DIR / "serve_ceiling.json"
NEW_TOKENS = 128
MAX_NUM_SEQS = 64
MAX_MODEL_LEN = 1024
VLLM_PORT = 18432
OFFLINE_PROMPTS = 128
TOKENIZER_FILES = ("generation_config.json", "special_tokens_map.json", "chat_template.jinja")


def make_tiny(out: Path) -> Path:
    """The tiny random Llama: SmolLM2's config shrunk, its tokenizer and chat template."""
    src = Path(resolve_model_path("smollm2-135m-instruct"))
    cfg = AutoConfig.from_pretrained(src)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 64, 128, 2
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 2, 1, 32
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(out, safe_serialization=True)
    for f in src.iterdir():
        if "token" in f.name or f.name in TOKENIZER_FILES:
            shutil.copy(f, out / f.name)
    return out


# A model whose forward costs nothing needs no compute threads (on a GPU the device computes):
# its replica takes one core, as a GPU replica's does, and leaves the others to the token path.
FREE_MODEL_REPLICA_CPUS = 1


def molora_config(tiny: Path, path: Path, direct: bool = True) -> Path:
    """serve_config.yaml's layout serving the tiny model as `base`, 64 sequences per replica on
    `FREE_MODEL_REPLICA_CPUS`; the router serves HTTP itself (direct ingress, shipped) or, with
    `direct=False`, through Serve's proxy."""
    cfg = servers.bench_config(
        max_num_seqs=MAX_NUM_SEQS,
        max_queue_len=512,
        direct=direct,
        num_cpus=FREE_MODEL_REPLICA_CPUS,
        model=str(tiny),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=2048,
    )
    cfg["applications"][0]["args"]["expose"].update(routes={}, adapters=[], compositions=[])
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def body(i: int) -> dict[str, Any]:
    return {
        "model": "base",
        "messages": [{"role": "user", "content": f"Say something {i}"}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def drive(port: int, conc: int, n: int) -> tuple[list[Sample], float]:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    limits = httpx.Limits(max_connections=conc + 4, max_keepalive_connections=conc + 4)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        sem = asyncio.Semaphore(conc)

        async def task(i: int) -> Sample:
            async with sem:
                return await one(client, url, body(i))

        start = time.perf_counter()
        samples = await asyncio.gather(*(task(i) for i in range(n)))
        return list(samples), time.perf_counter() - start


def cell(proc: subprocess.Popen, port: int, conc: int) -> dict[str, Any]:
    asyncio.run(drive(port, conc, conc // 4))  # warm-up
    with servers.CpuMeter(proc) as meter:
        samples, seconds = asyncio.run(drive(port, conc, 2 * conc))
    tokens = sum(s.tokens for s in samples)
    server_s = sum(meter.server_s.values())
    return {
        "concurrency": conc,
        "requests": 2 * conc,
        "errors": [s.error for s in samples if s.error][:3],
        "completion_tokens": tokens,
        "seconds": round(seconds, 2),
        "tok_per_s": round(tokens / seconds, 1),
        "ttft_p50_ms": pct([s.ttft for s in samples if s.ttft is not None], 0.5),
        "ttft_p99_ms": pct([s.ttft for s in samples if s.ttft is not None], 0.99),
        "itl_p50_ms": pct([x for s in samples for x in s.itl], 0.5),
        "itl_p99_ms": pct([x for s in samples for x in s.itl], 0.99),
        "server_cpu_ms_per_token": round(1000 * server_s / tokens, 3) if tokens else None,
        "client_cpu_ms_per_token": round(1000 * meter.client_s / tokens, 3) if tokens else None,
        "server_cpu_s_by_process": meter.server_s,
    }


def serve_cells(name: str, proc: subprocess.Popen, port: int, cells: list[int]) -> dict:
    rows = [cell(proc, port, c) for c in cells]
    for r in rows:
        print(f"  {name} c={r['concurrency']}: {r['tok_per_s']} tok/s, "
              f"{r['server_cpu_ms_per_token']} CPU ms/token", flush=True)  # fmt: skip
    return {"cells": rows, "nice": servers.priorities(proc)}


def run_vllm(python: Path, tiny: Path, work: Path, cells: list[int]) -> dict[str, Any]:
    log = work / "vllm.log"
    proc = servers.start_vllm(python, tiny, log, VLLM_PORT, dtype="float32",
                      max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS)  # fmt: skip
    try:
        out = serve_cells("vllm", proc, VLLM_PORT, cells)
    finally:
        servers.stop(proc)
    return {**out, "binding": servers.vllm_binding(log)}


def run_molora(tiny: Path, work: Path, cells: list[int], direct: bool = True) -> dict[str, Any]:
    name = "molora" if direct else "molora_proxy"
    log = work / f"{name}.log"
    config = molora_config(tiny, work / f"{name}.yaml", direct)
    # A cluster of its own: `serve run` would otherwise join any Ray cluster on the box.
    proc = servers.start_molora(config, log, {"RAY_ADDRESS": "local"}, direct=direct)
    try:
        out = serve_cells(name, proc, servers.MOLORA_PORT, cells)
    finally:
        servers.stop(proc)
    return {
        **out,
        "binding": servers.molora_binding(log),
        "port": servers.MOLORA_PORT,
        "direct_ingress": direct,
    }


def run_offline(tiny: Path) -> dict[str, Any]:
    """The engine alone (no Ray, no HTTP): 128 chat prompts at b=64, 128 tokens each, on the
    shipped replica's threads (both cores), and as `replica_threads` on the free model's
    replica's `FREE_MODEL_REPLICA_CPUS` threads, the compute the endpoint's replica has."""
    shipped = max(1, round(float(servers.replica_layout().get("num_cpus", 1))))
    llm = LLM(model=str(tiny), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
              max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=2048)  # fmt: skip
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [[{"role": "user", "content": f"Say something {i}"}] for i in range(OFFLINE_PROMPTS)]
    llm.generate(prompts[:8], sp)
    rows = {}
    for threads in (shipped, FREE_MODEL_REPLICA_CPUS):
        torch.set_num_threads(threads)
        cpu, start = time.process_time(), time.perf_counter()
        outs = llm.generate(prompts, sp)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        tokens = sum(len(o.token_ids) for o in outs)
        rows[threads] = {"batch": MAX_NUM_SEQS, "prompts": OFFLINE_PROMPTS, "threads": threads,
                         "completion_tokens": tokens, "seconds": round(seconds, 2),
                         "tok_per_s": round(tokens / seconds, 1),
                         "cpu_ms_per_token": round(1000 * cpu / tokens, 3)}  # fmt: skip
        print(f"  offline b={MAX_NUM_SEQS}, {threads} threads: {rows[threads]['tok_per_s']} tok/s",
              flush=True)  # fmt: skip
    del llm
    gc.collect()
    return {**rows[shipped], "replica_threads": rows[FREE_MODEL_REPLICA_CPUS]}


def round_order(round_no: int, proxy: bool = False) -> list[str]:
    order = ["vllm", "molora", *(["molora_proxy"] if proxy else []), "offline"]
    return order if round_no % 2 == 0 else order[::-1]


def summarize(rounds: list[dict[str, Any]], cells: list[int]) -> list[str]:
    lines = ["| round | c | vLLM tok/s | MoLoRA tok/s | ratio | CPU ms/tok vLLM | MoLoRA | "
             "MoLoRA TTFT p50/p99 | ITL p50/p99 | kept of offline | of offline, replica's threads |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for i, rnd in enumerate(rounds):
        offline = rnd["offline"]["tok_per_s"]
        same = rnd["offline"]["replica_threads"]["tok_per_s"]
        for j, c in enumerate(cells):
            v, m = rnd["vllm"]["cells"][j], rnd["molora"]["cells"][j]
            lines.append(
                f"| {i} | {c} | {v['tok_per_s']} | {m['tok_per_s']} | "
                f"{m['tok_per_s'] / v['tok_per_s']:.2f} | {v['server_cpu_ms_per_token']} | "
                f"{m['server_cpu_ms_per_token']} | {m['ttft_p50_ms']}/{m['ttft_p99_ms']} | "
                f"{m['itl_p50_ms']}/{m['itl_p99_ms']} | {m['tok_per_s'] / offline:.2f} | "
                f"{m['tok_per_s'] / same:.2f} |"
            )
        for j, c in enumerate(cells if "molora_proxy" in rnd else []):
            v, m = rnd["vllm"]["cells"][j], rnd["molora_proxy"]["cells"][j]
            lines.append(
                f"| {i} via Serve's proxy | {c} | {v['tok_per_s']} | {m['tok_per_s']} | "
                f"{m['tok_per_s'] / v['tok_per_s']:.2f} | {v['server_cpu_ms_per_token']} | "
                f"{m['server_cpu_ms_per_token']} | {m['ttft_p50_ms']}/{m['ttft_p99_ms']} | "
                f"{m['itl_p50_ms']}/{m['itl_p99_ms']} | {m['tok_per_s'] / offline:.2f} | "
                f"{m['tok_per_s'] / same:.2f} |"
            )
        lines.append(f"| {i} | offline b=64 | | {offline} ({same} on the replica's threads) | "
                     f"vs vLLM c=64: {offline / rnd['vllm']['cells'][cells.index(64)]['tok_per_s']:.2f}"
                     " | | | | | | |")  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="c=64 only, one round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--vllm-python", default=str(VLLM_PYTHON))
    parser.add_argument("--work", default=None, help="keep the tiny model and logs here")
    parser.add_argument("--cells", default=None, help="concurrencies, e.g. 32,64 (must hold 64)")
    parser.add_argument("--out", default=str(RESULTS), help="where the JSON goes")
    parser.add_argument("--proxy-ingress", action="store_true",
                        help="also MoLoRA through Serve's HTTP proxy (direct ingress off)")  # fmt: skip
    args = parser.parse_args()
    cells = [64] if args.quick else [32, 64, 128]
    if args.cells:
        cells = sorted({int(c) for c in args.cells.split(",")} | {64})
    rounds_n = 1 if args.quick else args.rounds
    work = Path(args.work or tempfile.mkdtemp(prefix="serve-ceiling-"))
    tiny = work / "tiny"
    if not (tiny / "config.json").exists():
        tiny.mkdir(parents=True, exist_ok=True)
        make_tiny(tiny)
    rounds = []
    for r in range(rounds_n):
        rnd: dict[str, Any] = {"order": round_order(r, args.proxy_ingress)}
        for side in rnd["order"]:
            print(f"round {r}: {side}", flush=True)
            if side == "vllm":
                rnd[side] = run_vllm(Path(args.vllm_python), tiny, work, cells)
            elif side.startswith("molora"):
                rnd[side] = run_molora(tiny, work, cells, side == "molora")
            else:
                rnd[side] = run_offline(tiny)
        rounds.append(rnd)
    table = summarize(rounds, cells)
    print("\n".join(table))
    write_json(Path(args.out), {
        "machine": machine_info(),
        "workload": {"model": "tiny random Llama (hidden 64, 2 layers, 2/1 heads, head_dim 32, "
                     "SmolLM2 tokenizer), fp32", "new_tokens": NEW_TOKENS, "ignore_eos": True,
                     "temperature": 0.0, "cells": cells, "requests_per_cell": "2 x c",
                     "max_num_seqs": MAX_NUM_SEQS},
        "molora_layout": {**servers.replica_layout(), "num_cpus": FREE_MODEL_REPLICA_CPUS},
        "vllm_env": {k: v for k, v in vllm_cpu_env().items() if k.startswith(("VLLM_", "OMP_"))},
        "quick": args.quick,
        "note": "one 2-core box, nothing else running; rounds in reversed order",
        "rounds": rounds,
        "table": table,
    })  # fmt: skip


if __name__ == "__main__":
    main()
