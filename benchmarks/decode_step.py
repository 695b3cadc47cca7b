"""Engine decode-step latency: CUDA graphs vs eager, and under adapter churn vs steady state.

A SmolLM2-135M-shaped model (random weights written natively, so the GPU box needs neither the
hub nor transformers) serves a batch of decoding requests. Reported per case: step latency
p50/p99 (ms), tokens/s, and the ratio to the base-model step of the same mode.

    python -m benchmarks.decode_step [--device cuda] [--batch 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import write_json
from molora_runtime.config import EngineConfig, HotSetConfig
from molora_runtime.engine.engine import LLMEngine
from molora_runtime.engine.llm import as_route
from molora_runtime.engine.types import GenerationRequest, SamplingParams
from molora_runtime.lora.source import DirectorySource
from molora_runtime.model.tiny import make_native_tiny_model, make_random_adapter

SMOLLM2_SHAPE = {"hidden_size": 576, "num_layers": 30, "vocab_size": 49152}
# Llama-3-8B's widths (GQA 32/8 heads, 14336 FFN, 128k vocab); `--layers` keeps it a few layers.
LLAMA3_8B_SHAPE = {
    "hidden_size": 4096,
    "num_layers": 32,
    "vocab_size": 128256,
    "num_heads": 32,
    "num_kv_heads": 8,
    "intermediate_size": 14336,
}
SHAPES = {"smollm2": SMOLLM2_SHAPE, "llama3-8b": LLAMA3_8B_SHAPE}


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(
    engine: LLMEngine, routes: list[Any], batch: int, steps: int, max_tokens: int
) -> dict[str, float]:
    """Keep `batch` requests decoding; each finishes after `max_tokens` and is replaced by the
    next route in `routes` (so a long route list over few slots forces loads between steps)."""
    counter = 0
    gen = torch.Generator().manual_seed(0)

    def add() -> None:
        nonlocal counter
        engine.add_request(
            GenerationRequest(
                request_id=f"r{counter}",
                prompt_token_ids=torch.randint(100, 20000, (16,), generator=gen).tolist(),
                route=as_route(routes[counter % len(routes)]),
                sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            )
        )
        counter += 1

    for _ in range(batch):
        add()
    latencies: list[float] = []
    tokens = 0
    warmup = 3
    while len(latencies) < steps:
        decoding = sum(1 for s in engine.running if not s.in_prefill)
        is_decode = decoding == len(engine.running) == batch and not engine.waiting
        _sync(engine.device)
        start = time.perf_counter()
        outs = engine.step()
        _sync(engine.device)
        elapsed = time.perf_counter() - start
        finished = sum(1 for o in outs if o.finished)
        if is_decode:
            if warmup:
                warmup -= 1
            else:
                latencies.append(elapsed)
                tokens += batch
        for _ in range(finished):
            add()
    for s in list(engine.running) + list(engine.waiting):
        engine.abort(s.request_id)
    while engine.has_work():
        engine.step()
    return {
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": _percentile(latencies, 0.99) * 1e3,
        "tok_s": tokens / sum(latencies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--layers", type=int, default=None, help="override the shape's layers")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_step.json"))
    args = parser.parse_args()
    device = torch.device(args.device)
    modes = [False, True] if device.type == "cuda" else [False]
    shape = {**SHAPES[args.shape]}
    if args.layers is not None:
        shape["num_layers"] = args.layers
    with tempfile.TemporaryDirectory() as tmp:
        model = make_native_tiny_model(Path(tmp) / "model", **shape)
        names = [f"ad{i}" for i in range(8)]
        adapters = {
            n: make_random_adapter(Path(tmp) / n, model, rank=args.rank, seed=i)
            for i, n in enumerate(names)
        }
        cases = {
            "base": [None],
            "4 adapters, steady": names[:4],
            "8 adapters over 4 slots (churn)": names,
        }
        rows = []
        for graphs in modes:
            config = EngineConfig(
                model=str(model),
                device=device.type,
                dtype="bfloat16" if device.type == "cuda" else "float32",
                max_num_seqs=args.batch,
                max_model_len=256,
                max_num_batched_tokens=max(2048, 16 * args.batch),
                enable_cuda_graph=graphs,
                cuda_graph_max_batch=args.batch,
                hot_set=HotSetConfig(num_slots=4, max_rank=args.rank, allow_base_mismatch=True),
            )
            engine = LLMEngine(config, DirectorySource(adapters))
            for label, routes in cases.items():
                stats = measure(engine, routes, args.batch, args.steps, max_tokens=12)
                rows.append({"mode": "cuda-graph" if graphs else "eager", "case": label, **stats})
            del engine
    base = {r["mode"]: r["p50_ms"] for r in rows if r["case"] == "base"}
    for r in rows:
        r["vs_base_step"] = r["p50_ms"] / base[r["mode"]]
    print(f"{'mode':<12}{'case':<34}{'p50 ms':>9}{'p99 ms':>9}{'tok/s':>10}{'×base':>8}")
    for r in rows:
        print(
            f"{r['mode']:<12}{r['case']:<34}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}"
            f"{r['tok_s']:>10.0f}{r['vs_base_step']:>8.2f}"
        )
    write_json(
        args.out,
        {
            "device": str(device),
            "shape": args.shape,
            "model": shape,
            "batch": args.batch,
            "rank": args.rank,
            "rows": rows,
            "targets": step_targets(rows),
        },
    )


def step_targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's target as measured: graph step with 4 adapters routed <= 1.1x the base step."""
    steady = [r for r in rows if r["mode"] == "cuda-graph" and r["case"] == "4 adapters, steady"]
    ratio = steady[0]["vs_base_step"] if steady else None
    return {
        "graph_4_adapters_vs_base": ratio,
        "graph_4_adapters_target_1.1_met": ratio is not None and ratio <= 1.1,
    }


if __name__ == "__main__":
    main()
