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
from molora_runtime.lora.composition import CompositionConfig, save_composition
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


def _shape(spec: str) -> tuple[str, dict[str, int]]:
    """`NAME` or `NAME:LAYERS` (a few layers of a big shape keep a run short)."""
    name, _, layers = spec.partition(":")
    if name not in SHAPES:
        raise argparse.ArgumentTypeError(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    shape = {**SHAPES[name]}
    if layers:
        shape["num_layers"] = int(layers)
    return spec, shape


def _engine_cases(
    tmp: Path, shape: dict[str, int], rank: int
) -> tuple[Path, DirectorySource, dict[str, list[Any]]]:
    """The model, 8 random adapters and a learned top-2 composition over the first 4."""
    model = make_native_tiny_model(tmp / "model", **shape)
    names = [f"ad{i}" for i in range(8)]
    adapters = {
        n: make_random_adapter(tmp / n, model, rank=rank, seed=i) for i, n in enumerate(names)
    }
    torch.manual_seed(0)
    moe = save_composition(
        tmp / "moe",
        CompositionConfig(
            base_model="model",
            adapters=names[:4],
            top_k=2,
            num_layers=shape["num_layers"],
            hidden_size=shape["hidden_size"],
        ),
        torch.randn(shape["num_layers"], 4, shape["hidden_size"]),
    )
    cases = {
        "base": [None],
        "4 adapters, steady": names[:4],
        "learned top-2 over the 4": [{"kind": "learned", "composition": "moe"}],
        "8 adapters over 4 slots (churn)": names,
    }
    return model, DirectorySource(adapters, {"moe": moe}), cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", default="32", help="batch sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument(
        "--shape",
        type=_shape,
        action="append",
        help=f"NAME[:LAYERS], repeatable; names: {sorted(SHAPES)} (default smollm2)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_step.json"))
    args = parser.parse_args()
    device = torch.device(args.device)
    modes = [False, True] if device.type == "cuda" else [False]
    batches = [int(b) for b in args.batch.split(",")]
    shapes = args.shape or [_shape("smollm2")]
    rows: list[dict[str, Any]] = []
    print(
        f"{'shape':<14}{'batch':>6} {'mode':<12}{'case':<34}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'tok/s':>10}{'×base':>8}"
    )
    for spec, shape in shapes:
        with tempfile.TemporaryDirectory() as tmp:
            model, source, cases = _engine_cases(Path(tmp), shape, args.rank)
            for batch in batches:
                for graphs in modes:
                    config = EngineConfig(
                        model=str(model),
                        device=device.type,
                        dtype="bfloat16" if device.type == "cuda" else "float32",
                        max_num_seqs=batch,
                        max_model_len=256,
                        max_num_batched_tokens=max(2048, 16 * batch),
                        enable_cuda_graph=graphs,
                        cuda_graph_max_batch=batch,
                        hot_set=HotSetConfig(
                            num_slots=4, max_rank=args.rank, allow_base_mismatch=True
                        ),
                    )
                    engine = LLMEngine(config, source)
                    mode = "cuda-graph" if graphs else "eager"
                    for label, routes in cases.items():
                        stats = measure(engine, routes, batch, args.steps, max_tokens=12)
                        row = {"shape": spec, "batch": batch, "mode": mode, "case": label, **stats}
                        rows.append(row)
                        _print_row(row, rows)
                        _write(args, device, shapes, rows)  # a run cut short keeps its rows
                    del engine


def _base_step(row: dict[str, Any], rows: list[dict[str, Any]]) -> float:
    key = (row["shape"], row["batch"], row["mode"])
    return next(r["p50_ms"] for r in rows if (r["shape"], r["batch"], r["mode"]) == key)


def _print_row(row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    row["vs_base_step"] = row["p50_ms"] / _base_step(row, rows)
    print(
        f"{row['shape']:<14}{row['batch']:>6} {row['mode']:<12}{row['case']:<34}"
        f"{row['p50_ms']:>9.2f}{row['p99_ms']:>9.2f}{row['tok_s']:>10.0f}"
        f"{row['vs_base_step']:>8.2f}",
        flush=True,
    )


def _write(
    args: argparse.Namespace,
    device: torch.device,
    shapes: list[tuple[str, dict[str, int]]],
    rows: list[dict[str, Any]],
) -> None:
    write_json(
        args.out,
        {
            "device": str(device),
            "device_name": torch.cuda.get_device_name() if device.type == "cuda" else None,
            "torch": torch.__version__,
            "shapes": dict(shapes),
            "rank": args.rank,
            "rows": rows,
            "targets": step_targets(rows),
        },
    )


def step_targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per shape and batch: the graph step with 4 adapters routed <= 1.1x the base step, and
    the learned top-2 step against one adapter's (the mixture's cost on this device)."""
    out: dict[str, Any] = {}
    for r in rows:
        if r["mode"] != "cuda-graph" or r["case"] == "base":
            continue
        key = f"{r['shape']} b={r['batch']}"
        if r["case"] == "4 adapters, steady":
            out[f"{key}: 4 adapters vs base"] = round(r["vs_base_step"], 3)
            out[f"{key}: target 1.1 met"] = r["vs_base_step"] <= 1.1
        elif r["case"] == "learned top-2 over the 4":
            out[f"{key}: learned top-2 vs base"] = round(r["vs_base_step"], 3)
    return out


if __name__ == "__main__":
    main()
