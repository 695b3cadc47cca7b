"""What a learned top-k route costs against one adapter alone, on the offline engine.

The default store's `molora` composition (top-k over the 4 reasoning adapters) against
`arithmetic` alone, b=32 sequences decoding together: one engine per mode in one process, all
with the batch in flight, their decode steps interleaved (A B C, then C B A, ...) so a busy
neighbour slows every mode alike. Each step's wall and process-CPU time is kept; a mode's
tok/s is its decode tokens over its summed step time. Modes: `single`, `learned` (top-2),
`learned_top1` (the hard-routing fast path) and `learned_general` (top-2 with the
one-composition plan withheld: the general per-token gate path).
`--profile MODE` prints the torch profiler's top operators of one run of MODE instead.

    python -m benchmarks.gate_overhead [--steps 48] [--dtype float32] [--threads 2]

Prints a table and writes `benchmarks/results/gate_overhead.json`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from adapter_store.source import AdapterStoreSource
from benchmarks.report import BUNDLED_STORE, write_json
from molora_runtime.config import EngineConfig, HotSetConfig
from molora_runtime.engine.engine import LLMEngine
from molora_runtime.engine.llm import as_route
from molora_runtime.engine.runner import model_runner
from molora_runtime.engine.types import GenerationRequest, SamplingParams
from molora_runtime.lora.routing import build_lora_context

RESULTS = Path(__file__).parent / "results" / "gate_overhead.json"
PROMPTS = [
    "What is 17 times 23?",
    "Sort these numbers in ascending order: 69, 97, 2",
    "Reverse this list of words: energy, little, it",
    "How many letters are in the word banana?",
    "Add 345 and 989.",
    "Sort these words: pear, apple, fig",
    "Count the vowels in 'serving'.",
    "Reverse the digits of 90817.",
]
MODES: dict[str, Any] = {
    "single": "arithmetic",
    "learned": {"kind": "learned", "composition": "molora"},
    "learned_top1": {"kind": "learned", "composition": "molora", "top_k": 1},
}


def add_batch(engine: LLMEngine, mode: str, n: int, new_tokens: int, tag: str) -> None:
    sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    route = as_route(MODES[mode.removesuffix("_general")])
    for i in range(n):
        req = GenerationRequest(
            request_id=f"{tag}-{mode}-{i}",
            route=route,
            sampling=sampling,
            messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        )
        engine.add_request(req, engine.validate_request(req))


def _without_plan(*args: Any, **kwargs: Any) -> Any:
    """`build_lora_context` with the one-composition plan withheld (the general gate path)."""
    ctx = build_lora_context(*args, **kwargs)
    if ctx is not None:
        ctx.learned_plan = None
    return ctx


def step(engine: LLMEngine, general: bool) -> tuple[int, float, float]:
    """One engine step: (tokens, wall seconds, process CPU seconds)."""
    model_runner.build_lora_context = _without_plan if general else build_lora_context
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        tokens = sum(len(out.new_token_ids) for out in engine.step())
        return tokens, time.perf_counter() - wall, time.process_time() - cpu
    finally:
        model_runner.build_lora_context = build_lora_context


def make_engine(dtype: str, batch: int) -> LLMEngine:
    config = EngineConfig(
        model="smollm2-135m-instruct",
        device="cpu",
        dtype=dtype,
        max_num_seqs=batch,
        max_model_len=512,
        max_num_batched_tokens=1024,
        hot_set=HotSetConfig(num_slots=4, max_rank=16),
    )
    return LLMEngine(config, AdapterStoreSource(store_url=str(BUNDLED_STORE)))


def drain(engine: LLMEngine, general: bool) -> None:
    while engine.has_work():
        step(engine, general)


def profile(engine: LLMEngine, mode: str, batch: int, steps: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    add_batch(engine, mode, batch, steps + 1, "profile")
    step(engine, mode.endswith("_general"))  # the prefill
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        drain(engine, mode.endswith("_general"))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=48, help="decode steps timed per mode")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument(
        "--modes", nargs="+", default=["single", "learned", "learned_top1", "learned_general"]
    )
    ap.add_argument("--profile", help="profile one run of this mode instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.profile:
        engine = make_engine(args.dtype, args.batch)
        add_batch(engine, args.profile, 4, 4, "warm")
        drain(engine, args.profile.endswith("_general"))
        profile(engine, args.profile, args.batch, args.steps)
        return
    engines = {mode: make_engine(args.dtype, args.batch) for mode in args.modes}
    for mode, engine in engines.items():  # warm up: routes, start-up GEMM timing, slots
        add_batch(engine, mode, 4, 4, "warm")
        drain(engine, mode.endswith("_general"))
        add_batch(engine, mode, args.batch, args.steps + 1, "run")
        step(engine, mode.endswith("_general"))  # the batch's prefill, not timed
    samples: dict[str, list[tuple[int, float, float]]] = {m: [] for m in args.modes}
    order = list(args.modes)
    for i in range(args.steps):
        for mode in order if i % 2 == 0 else order[::-1]:
            samples[mode].append(step(engines[mode], mode.endswith("_general")))
    rows = []
    base = _rates(samples[order[0]])
    for mode in order:
        tok_s, tok_cpu_s, ratio_steps = _rates(samples[mode])
        rows.append({
            "mode": mode, "steps": len(samples[mode]), "tok_per_s": round(tok_s, 1),
            "tok_per_cpu_s": round(tok_cpu_s, 1),
            "ratio_to_single": round(tok_s / base[0], 3),
            "cpu_ratio_to_single": round(tok_cpu_s / base[1], 3),
            "median_step_ms": round(ratio_steps * 1e3, 2),
            "paired_median_ratio": round(_paired(samples[mode], samples[order[0]]), 3),
        })  # fmt: skip
    print(f"{'mode':<17}{'tok/s':>9}{'x single':>10}{'tok/CPU-s':>11}{'x single':>10}"
          f"{'median step ms':>16}{'paired x single':>17}")  # fmt: skip
    for r in rows:
        print(f"{r['mode']:<17}{r['tok_per_s']:>9}{r['ratio_to_single']:>10}"
              f"{r['tok_per_cpu_s']:>11}{r['cpu_ratio_to_single']:>10}{r['median_step_ms']:>16}"
              f"{r['paired_median_ratio']:>17}")  # fmt: skip
    write_json(RESULTS, {
        "benchmark": "gate_overhead", "dtype": args.dtype, "threads": args.threads,
        "batch": args.batch, "decode_steps": args.steps, "composition": "molora",
        "single": "arithmetic", "interleaving": "ABC then CBA per step", "rows": rows,
        "load_average_1_5_15_min": [round(v, 2) for v in os.getloadavg()],
        "read": "paired_median_ratio where the load average exceeds the threads",
    })  # fmt: skip


def _paired(mode: list[tuple[int, float, float]], single: list[tuple[int, float, float]]) -> float:
    """Median over step pairs (a mode's step and the single step next to it) of the tok/s
    ratio: robust to a load spike that hits a few steps."""
    ratios = [(t / w) / (ts / ws) for (t, w, _), (ts, ws, _) in zip(mode, single, strict=True)]
    return statistics.median(ratios)


def _rates(samples: list[tuple[int, float, float]]) -> tuple[float, float, float]:
    """(tokens per wall second, tokens per CPU second, median step wall seconds)."""
    tokens = sum(t for t, _, _ in samples)
    wall = sum(w for _, w, _ in samples)
    cpu = sum(c for _, _, c in samples)
    return tokens / wall, tokens / cpu, statistics.median(w for _, w, _ in samples)


if __name__ == "__main__":
    main()
