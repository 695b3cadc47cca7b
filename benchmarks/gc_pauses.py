"""What a full garbage collection costs a model replica's process, with and without freezing
its start-up heap (what Ray Serve does once a replica's constructor has returned,
`RAY_SERVE_FREEZE_GC_ON_STARTUP`), measured in one process.

The process imports what a replica imports (Ray, FastAPI, the deployments) and builds an engine
on a SmolLM2-shaped random model with 4 adapters, then serves decode steps so that serving's
own objects exist too. It times `gc.collect()` (a generation-2 collection, which holds the GIL:
no decode step and no stream moves meanwhile) `--repeats` times, freezes, serves again and
times it again. Prints a table and writes `benchmarks/results/gc_pauses.json`.

    python -m benchmarks.gc_pauses [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _full_collections(repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1000)
    return times


def measure(repeats: int, steps: int) -> dict[str, Any]:
    for module in (
        "deployments.api.ingress",
        "deployments.replica.deployment",
    ):  # a replica's imports
        importlib.import_module(module)
    from benchmarks.decode_step import SMOLLM2_SHAPE
    from benchmarks.decode_step import measure as serve_decode_steps  # keeps a batch decoding
    from molora_runtime.config import EngineConfig, HotSetConfig
    from molora_runtime.engine.engine import LLMEngine
    from molora_runtime.lora.source import DirectorySource
    from molora_runtime.model.tiny import make_native_tiny_model, make_random_adapter

    with tempfile.TemporaryDirectory() as tmp:
        model = make_native_tiny_model(Path(tmp) / "model", **SMOLLM2_SHAPE)
        names = [f"ad{i}" for i in range(4)]
        adapters = {
            n: make_random_adapter(Path(tmp) / n, model, rank=8, seed=i)
            for i, n in enumerate(names)
        }
        config = EngineConfig(
            model=str(model),
            device="cpu",
            dtype="float32",
            max_num_seqs=32,
            max_model_len=1024,
            hot_set=HotSetConfig(num_slots=4, max_rank=8, allow_base_mismatch=True),
        )
        engine = LLMEngine(config, DirectorySource(adapters))
        serve_decode_steps(engine, names, batch=8, steps=steps, max_tokens=steps)
        before_objects = len(gc.get_objects())
        before = _full_collections(repeats)
        gc.collect()  # as Ray Serve does after the constructor
        gc.freeze()
        frozen = gc.get_freeze_count()
        serve_decode_steps(engine, names, batch=8, steps=steps, max_tokens=steps)
        after_objects = len(gc.get_objects())
        after = _full_collections(repeats)
        gc.unfreeze()
    return {
        "tracked_objects": {"not frozen": before_objects, "frozen": after_objects},
        "frozen_objects": frozen,
        "full_collection_ms": {"not frozen": before, "frozen": after},
        "median_ms": {
            "not frozen": statistics.median(before),
            "frozen": statistics.median(after),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32, help="decode steps served each time")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/gc_pauses.json")
    args = parser.parse_args()
    from benchmarks.report import write_json

    result = measure(args.repeats, args.steps)
    print("| heap | objects a full collection walks | full collection ms (median) |")
    print("|---|---|---|")
    for label in ("not frozen", "frozen"):
        objects = result["tracked_objects"][label]
        print(f"| {label} | {objects} | {result['median_ms'][label]:.2f} |")
    write_json(
        args.out,
        {
            "what": "one generation-2 gc.collect() in a process with a replica's imports and "
            "engine (SmolLM2-shaped random model, 4 adapters), before and after "
            "gc.collect(); gc.freeze() (Ray Serve's RAY_SERVE_FREEZE_GC_ON_STARTUP)",
            "repeats": args.repeats,
            **result,
        },
    )


if __name__ == "__main__":
    main()
