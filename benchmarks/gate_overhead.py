"""What a learned top-k route costs against one adapter alone, on the offline engine.

The default store's `molora` composition (top-k over the 4 reasoning adapters) against
`arithmetic` alone: 32 prompts x 64 greedy tokens, all 32 in flight, one engine, both modes
run side by side in ABBA rounds so a busy neighbour slows both alike. Also runs the
composition at top-1 (the hard-routing fast path). `--profile` prints the torch profiler's
top operators of one learned round instead.

    python -m benchmarks.gate_overhead [--rounds 3] [--dtype float32] [--threads 2] [--profile]

Prints a table and writes `benchmarks/results/gate_overhead.json`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from adapter_store.source import AdapterStoreSource
from benchmarks.report import write_json
from molora_runtime.config import EngineConfig, HotSetConfig
from molora_runtime.engine.engine import LLMEngine
from molora_runtime.engine.llm import as_route
from molora_runtime.engine.types import GenerationRequest, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "gate_overhead.json"
STORE = ROOT / "deployments" / "default_store"
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
CPU_SECONDS: list[float] = []  # process CPU time of each round (the box may be busy)
MODES: dict[str, Any] = {
    "single": "arithmetic",
    "learned": {"kind": "learned", "composition": "molora"},
    "learned_top1": {"kind": "learned", "composition": "molora", "top_k": 1},
}


def run_round(engine: LLMEngine, mode: str, n: int, new_tokens: int, tag: str) -> tuple[int, float]:
    """Tokens and seconds of `n` requests of `mode`, all in flight at once."""
    sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    route = as_route(MODES[mode])
    for i in range(n):
        req = GenerationRequest(
            request_id=f"{tag}-{mode}-{i}",
            route=route,
            sampling=sampling,
            messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        )
        engine.add_request(req, engine.validate_request(req))
    tokens, start, cpu = 0, time.perf_counter(), time.process_time()
    while engine.has_work():
        for out in engine.step():
            tokens += len(out.new_token_ids)
    CPU_SECONDS.append(time.process_time() - cpu)
    return tokens, time.perf_counter() - start


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
    return LLMEngine(config, AdapterStoreSource(store_url=str(STORE)))


def profile(engine: LLMEngine, mode: str, n: int, new_tokens: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        run_round(engine, mode, n, new_tokens, "profile")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--modes", nargs="+", default=["learned", "learned_top1"])
    ap.add_argument("--profile", choices=sorted(MODES), help="profile one round of this mode")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = make_engine(args.dtype, args.batch)
    for mode in MODES:  # warm up every route and the start-up timing of the GEMM paths
        run_round(engine, mode, 4, 8, "warm")
    if args.profile:
        profile(engine, args.profile, args.batch, args.tokens)
        return
    tps: dict[str, list[float]] = {m: [] for m in ["single", *args.modes]}
    cpu_tps: dict[str, list[float]] = {m: [] for m in tps}
    for r in range(args.rounds):
        for mode in ["single", *args.modes]:  # A B ... then reversed: ABBA per round pair
            order = ["single", *args.modes]
            mode = mode if r % 2 == 0 else order[::-1][order.index(mode)]
            tokens, seconds = run_round(engine, mode, args.batch, args.tokens, f"r{r}")
            tps[mode].append(tokens / seconds)
            cpu_tps[mode].append(tokens / CPU_SECONDS[-1])
    rows = []
    single = statistics.median(tps["single"])
    cpu_single = statistics.median(cpu_tps["single"])
    for mode, values in tps.items():
        ratios = [v / s for v, s in zip(values, tps["single"], strict=True)]
        rows.append({
            "tok_per_cpu_s": [round(v, 1) for v in cpu_tps[mode]],
            "cpu_ratio_to_single": round(statistics.median(cpu_tps[mode]) / cpu_single, 3),
            "mode": mode, "tok_per_s": [round(v, 1) for v in values],
            "median_tok_per_s": round(statistics.median(values), 1),
            "ratio_to_single": round(statistics.median(values) / single, 3),
            "ratio_per_round": [round(x, 3) for x in ratios],
        })  # fmt: skip
    print(f"{'mode':<14}{'median tok/s':>14}{'x single':>10}{'x single (CPU s)':>18}  rounds")
    for row in rows:
        print(f"{row['mode']:<14}{row['median_tok_per_s']:>14}{row['ratio_to_single']:>10}"
              f"{row['cpu_ratio_to_single']:>18}  {row['tok_per_s']}")  # fmt: skip
    write_json(RESULTS, {
        "benchmark": "gate_overhead", "dtype": args.dtype, "threads": args.threads,
        "batch": args.batch, "new_tokens": args.tokens, "rounds": args.rounds,
        "composition": "molora", "single": "arithmetic", "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
