"""The endpoint a user calls, side by side: MoLoRA `serve run` vs vLLM's own OpenAI server.

Same box, same SmolLM2-135M-Instruct, same 4 PEFT adapters (r=8, alpha 16, all 7 projections),
same streaming chat client over HTTP (short prompts, 64 tokens, `ignore_eos`, temperature 0),
same run. vLLM (`make vllm-env`) computes with its OpenMP threads bound to every core
(`VLLM_CPU_OMP_THREADS_BIND=0-N`); MoLoRA runs one model replica owning every core. Cells:
concurrency 1/8/32 × base, one adapter, 4 adapters (one per request), and for MoLoRA also a
learned top-2 composition over the 4 and a vocabulary route. Per cell: output tok/s, TTFT
p50/p99, inter-token latency p50/p99. Before timing, each server answers 4 prompts greedily
(one request at a time) on the base model and on every adapter: each adapter must change at
least one text (LoRA is really applied), and `greedy_agreement` counts the texts MoLoRA and vLLM
produced identically (the same model, adapters and fp32 greedy decoding should agree). Each
server's thread binding is recorded from its own log / replica stats as evidence. The offline
engine on the same workload and replica layout (`benchmarks.serve_offline`: no Ray, no HTTP) is
the yardstick for what the serving layer keeps ("kept" = endpoint ÷ offline).

    .venv/bin/python -m benchmarks.serve_vs_vllm [--dtypes float32 bfloat16] [--quick] [--rounds 2]

`--rounds N` runs vLLM, MoLoRA and the offline yardstick N times, the order reversed every other
round (ABC CBA ...: the box's speed drifts over minutes, and a fixed order hands the drift to whoever
runs last). The table pairs each side's best round per cell; every round is in the JSON under
`rounds`, and `per_round` gives the ratios within each round's own window.

Writes `benchmarks/results/serve_vs_vllm.json` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import torch
import yaml
from transformers import AutoModelForCausalLM

from benchmarks import serve_offline
from benchmarks.chat_stream import one, request_body, run_cell
from benchmarks.machine import machine_info
from benchmarks.report import RESULTS_DIR, write_json
from benchmarks.serve_rounds import (
    adapters_applied,
    agreement,
    best_of_rounds,
    per_round_ratios,
    round_order,
    summarize,
)
from benchmarks.server_process import (
    MOLORA_PORT,
    CpuMeter,
    bench_config,
    molora_binding,
    priorities,
    replica_layout,
    start_molora,
    start_vllm,
    stop,
    vllm_binding,
)
from benchmarks.vllm_env import VLLM_PYTHON
from benchmarks.workload import (
    ADAPTERS,
    CELLS,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    NEW_TOKENS,
    PROMPTS,
    TARGETS,
    modes,
)
from molora_runtime.lora.composition import CompositionConfig, save_composition
from molora_runtime.model.arch import load_arch
from molora_runtime.model.model_paths import resolve_model_path

RESULTS = RESULTS_DIR / "serve_vs_vllm.json"
VLLM_PORT = 18431


# ---- assets ---------------------------------------------------------------------------------


def make_assets(work: Path, model_dir: Path) -> Path:
    """4 random PEFT adapters and a learned top-2 composition, published to a local store."""
    store = work / "store"
    if (store / ".done").is_file():
        return store
    from peft import LoraConfig, get_peft_model  # the optional `train` extra

    for i, name in enumerate(ADAPTERS):
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS)
        peft_model = get_peft_model(base, cfg)
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.02)  # non-zero B: each adapter changes the output
        peft_model.save_pretrained(work / "adapters" / name)
    arch = load_arch(model_dir)
    torch.manual_seed(7)
    comp_cfg = CompositionConfig(
        base_model=str(model_dir),  # as the adapters record it (pushed with --base-config)
        adapters=[f"{n}@1" for n in ADAPTERS],
        top_k=2,
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
    )
    gates = torch.randn(arch.num_layers, len(ADAPTERS), arch.hidden_size)
    comp_dir = save_composition(work / "compositions" / "mix4", comp_cfg, gates)
    shutil.rmtree(store, ignore_errors=True)  # a run that stopped half-way published some
    cli = [sys.executable, "-m", "deployments.ops.cli"]
    for name in ADAPTERS:
        subprocess.run(
            [
                *cli,
                "adapters",
                "push",
                str(work / "adapters" / name),
                "--name",
                name,
                "--version",
                "1",
                "--store",
                str(store),
                "--base-config",
                str(model_dir),
            ],
            check=True,
            capture_output=True,
        )
    subprocess.run(
        [
            *cli,
            "compositions",
            "push",
            str(comp_dir),
            "--name",
            "mix4",
            "--version",
            "1",
            "--store",
            str(store),
        ],
        check=True,
        capture_output=True,
    )
    (store / ".done").write_text("ok\n")
    return store


# ---- servers --------------------------------------------------------------------------------


def prepare_assets(work_arg: str | None, prefix: str) -> tuple[Path, Path, Path, int]:
    """(model dir, work folder, adapter store, vocab-route split) of a benchmark run; the work
    folder is `work_arg` (kept between runs) or a new temporary one."""

    model_dir = resolve_model_path("smollm2-135m-instruct")
    work = Path(work_arg or tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    store = make_assets(work, model_dir)
    return model_dir, work, store, load_arch(model_dir).vocab_size // 3


def vllm_lora_args(work: Path) -> tuple[str, ...]:
    """vLLM's LoRA flags for the benchmark's 4 adapters (rank 8, all 4 at once)."""
    modules = [f"{n}={work / 'adapters' / n}" for n in ADAPTERS]
    return ("--enable-lora", "--max-loras", "4", "--max-lora-rank", "8", "--lora-modules", *modules)


def molora_config(store: Path, dtype: str, path: Path) -> Path:
    """serve_config.yaml with the benchmark's limits, on the shipped replica layout (replicas x
    CPUs covering every core; each replica has vLLM's limits: 32 sequences, 4 adapter slots)."""
    cfg = bench_config(
        max_num_seqs=MAX_NUM_SEQS,
        max_queue_len=256,
        dtype=dtype,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=1024,
    )
    args = cfg["applications"][0]["args"]
    args["engine"]["hot_set"] = {"num_slots": 4, "max_rank": 8}
    args["store"] = {"url": str(store)}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def measure_offline(
    store: Path, dtype: str, cells: list[tuple[int, int]], mode_names: list[str]
) -> list[dict[str, Any]]:
    """The offline engine (no Ray, no HTTP) on the shipped replica layout: the yardstick."""
    layout = replica_layout()
    replicas = int(layout["num_replicas"])
    threads = max(1, round(float(layout.get("num_cpus", 1))))
    return serve_offline.measure(store, dtype, cells, mode_names, replicas, threads)


# ---- client ---------------------------------------------------------------------------------


SANITY_PROMPTS = 4  # greedy texts per model in the sanity check (sequential: deterministic)


async def sanity(port: int) -> dict[str, Any]:
    """Greedy texts of the first prompts on the base model and on each adapter. An adapter whose
    texts all equal the base model's is not shown to be applied: these small random adapters
    leave some prompts' greedy text unchanged, so one prompt is not enough evidence."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    texts: dict[str, list[str]] = {}
    async with httpx.AsyncClient(timeout=300) as client:
        for model in ["base", *ADAPTERS]:
            texts[model] = []
            for prompt in PROMPTS[:SANITY_PROMPTS]:
                s = await one(client, url, request_body(model, prompt, None))
                texts[model].append(s.text if s.error is None else f"ERROR {s.error}")
    return {"adapters_applied": adapters_applied(texts), "of": len(ADAPTERS), "texts": texts}


def drive(
    port: int,
    mode_names: list[str],
    cells: list[tuple[int, int]],
    vocab_split: int,
    proc: subprocess.Popen | None = None,
):
    all_modes = modes(vocab_split)
    rows = []
    asyncio.run(run_cell(port, all_modes["mixed"], 8, 8))  # warm up every adapter
    for conc, n in cells:
        for mode in mode_names:
            with CpuMeter(proc) as cpu:
                row = asyncio.run(run_cell(port, all_modes[mode], conc, n))
            row["mode"] = mode
            row["cpu_s"] = {"client": cpu.client_s, "server": cpu.server_s}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# ---- main -----------------------------------------------------------------------------------


def phase(
    run: dict[str, Any], server: str, proc: subprocess.Popen, port: int, mode_names: list[str],
    cells: list[tuple[int, int]], vocab_split: int, first_round: bool,
) -> None:  # fmt: skip
    """One server's round: its cells (after the sanity texts on its first round), then stop it."""
    try:
        if first_round:
            run[server] = {"sanity": asyncio.run(sanity(port)), "rounds": []}
        run[server]["rounds"].append(drive(port, mode_names, cells, vocab_split, proc))
        run[server]["priorities"] = priorities(proc)
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--quick", action="store_true", help="c=8 and c=32 only")
    ap.add_argument("--vllm-python", default=str(VLLM_PYTHON))
    ap.add_argument("--work", default=None, help="keep adapters/store here between runs")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument(
        "--skip-offline", action="store_true", help="no offline-engine yardstick (serve_offline)"
    )
    ap.add_argument("--modes", nargs="+", default=None, help="only these modes (a quick A/B)")
    ap.add_argument("--concurrency", nargs="+", type=int, default=None, help="only these c")
    ap.add_argument("--out", default=str(RESULTS), help="where the JSON goes")
    ap.add_argument(
        "--rounds", type=int, default=1,
        help="run vLLM, MoLoRA and offline this many times, order reversed every other round "
        "(ABC CBA ...); best of N per cell, and per-round ratios in the JSON",
    )  # fmt: skip
    args = ap.parse_args()

    model_dir, work, store, vocab_split = prepare_assets(args.work, "serve-vs-vllm-")
    cells = CELLS["quick" if args.quick else "full"]
    if args.concurrency:
        cells = [cell for cell in CELLS["full"] if cell[0] in args.concurrency]
    only = set(args.modes or modes(vocab_split))
    vllm_python = Path(args.vllm_python)
    runs: dict[str, Any] = {}
    for dtype in args.dtypes:
        run: dict[str, Any] = {}
        # The modes every side (vLLM, MoLoRA, offline) runs; ours adds the MoLoRA-only routes.
        shared_modes = [m for m in ("base", "single", "mixed") if m in only]
        our_modes = [m for m in modes(vocab_split) if m in only]
        for round_no in range(args.rounds):
            for server in round_order(round_no, args.skip_vllm, args.skip_offline):
                if server == "vllm" and not vllm_python.is_file():
                    run["vllm"] = {"skipped": f"{vllm_python} not found: run `make vllm-env`"}
                elif server == "vllm":
                    log = work / f"vllm_{dtype}.log"
                    proc = start_vllm(vllm_python, model_dir, log, VLLM_PORT, dtype=dtype,
                                      max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                                      extra=vllm_lora_args(work))  # fmt: skip
                    phase(run, "vllm", proc, VLLM_PORT, shared_modes, cells, vocab_split,
                          round_no == 0)  # fmt: skip
                    run["vllm"]["thread_binding"] = vllm_binding(log)
                elif server == "molora":
                    log = work / f"molora_{dtype}.log"
                    config = molora_config(store, dtype, work / f"molora_{dtype}.yaml")
                    proc = start_molora(config, log)
                    phase(run, "molora", proc, MOLORA_PORT, our_modes, cells, vocab_split,
                          round_no == 0)  # fmt: skip
                    run["molora"]["thread_binding"] = molora_binding(log)
                else:
                    offline = run.setdefault("offline", {"layout": replica_layout(), "rounds": []})
                    offline["rounds"].append(measure_offline(store, dtype, cells, shared_modes))
        for server in ("vllm", "molora", "offline"):
            if "rounds" in run.get(server, {}):
                run[server]["cells"] = best_of_rounds(run[server]["rounds"])
        run["per_round"] = per_round_ratios(run)
        run["greedy_agreement"] = agreement(run)
        runs[dtype] = run
    table = summarize(runs)
    print("\n".join(table))
    for dtype, run in runs.items():
        for server in ("vllm", "molora"):
            check = run.get(server, {}).get("sanity")
            if check:
                print(f"{dtype} {server}: adapters that change a greedy text: "
                      f"{check['adapters_applied']} of {check['of']}")  # fmt: skip
        if run["greedy_agreement"]:
            a = run["greedy_agreement"]
            print(f"{dtype}: greedy texts identical to vLLM's: {a['identical']} of {a['of']}")
        for r in run["per_round"]:
            print(f"{dtype} round {r['round']} {r['mode']} c={r['concurrency']}: "
                  f"vs vLLM {r.get('vs_vllm', '-')}, kept {r.get('kept', '-')}")  # fmt: skip
    write_json(
        Path(args.out),
        {
            "benchmark": "serve_vs_vllm",
            "machine": machine_info(),
            "workload": {
                "model": "SmolLM2-135M-Instruct",
                "adapters": "4 PEFT LoRAs r=8 alpha=16 on all 7 projections",
                "prompts": len(PROMPTS),
                "max_tokens": NEW_TOKENS,
                "sampling": "greedy, ignore_eos, streaming chat",
                "max_num_seqs": MAX_NUM_SEQS,
                "max_model_len": MAX_MODEL_LEN,
                "molora_replicas": replica_layout(),
            },
            "runs": runs,
            "table": table,
        },
    )


if __name__ == "__main__":
    main()
