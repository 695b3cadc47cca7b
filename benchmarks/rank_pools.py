"""Rank pools against the padded hot-set: slot memory per adapter and offline tok/s of a
mixed-rank adapter set (8 adapters of rank 4 and 2 of rank 64, every target module).

Both engines are built in one process over the same model and adapters: the padded one holds
10 slots at rank 64, the pooled one `rank_pools` [{rank 4, 8 slots}, {rank 64, 2 slots}]. Each
workload runs in ABBA rounds (padded, pooled, pooled, padded, ...), so a neighbour's load on a
shared box slows both alike; tok/s is generated tokens over the wall time of the whole batch
(prefill and decode), greedy, `ignore_eos`. Whether both layouts generate the same tokens is
recorded too. Each layout runs with its own start-up backend choice (`auto`, what it serves
with) and, so the layout alone differs, with the same plain and packed stacked backends.

    python -m benchmarks.rank_pools [--model smollm2-135m-instruct] [--rounds 2] [--threads 1]

The default model is a random 4-layer model of SmolLM2-135M's layer shape (hidden 576, MLP
1,536, 9 heads, 3 KV heads, vocab 2,048): the LoRA work per layer is SmolLM2's, a round takes
seconds on a shared box; `--model smollm2-135m-instruct` runs the full 30 layers.
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
from molora_runtime.model.cpu_lora import PackedLoRA, StackedLoRA
from molora_runtime.model.model_paths import resolve_model_path
from molora_runtime.model.rank_pools import PooledBackend
from molora_runtime.model.tiny import make_native_tiny_model, make_random_adapter

RESULTS = Path(__file__).parent / "results" / "rank_pools.json"
SMOLLM2_SHAPE = "smollm2-shape-4-layers"
SMALL = [f"r4-{i}" for i in range(8)]
BIG = ["r64-0", "r64-1"]
# The random adapters declare no real base model; their shapes fit the model served.
LAYOUTS = {
    "padded": HotSetConfig(num_slots=10, max_rank=64, allow_base_mismatch=True),
    "pooled": HotSetConfig(
        rank_pools=[{"rank": 4, "slots": 8}, {"rank": 64, "slots": 2}], allow_base_mismatch=True
    ),
}


def make_adapters(model: Path, work: Path) -> dict[str, Path]:
    ranks = {**dict.fromkeys(SMALL, 4), **dict.fromkeys(BIG, 64)}
    return {
        name: make_random_adapter(work / name, model, rank=r, seed=i, scale=0.02)
        for i, (name, r) in enumerate(ranks.items())
    }


def workloads(vocab: int, prompt_len: int) -> dict[str, list[tuple[list[int], str]]]:
    """Per workload, (prompt ids, adapter) of each request."""
    gen = torch.Generator().manual_seed(0)

    def prompts(names: list[str]) -> list[tuple[list[int], str]]:
        return [(torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(), n) for n in names]

    return {
        "mixed (16 on r=4, 4 on r=64)": prompts((SMALL + BIG) * 2),
        "r=4 only (16 requests)": prompts(SMALL * 2),
    }


def run(engine: LLMEngine, reqs: list[tuple[list[int], str]], tag: str, new: int) -> dict:
    sampling = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i, (ids, adapter) in enumerate(reqs):
        rid = f"{tag}-{i}"
        tokens[rid] = []
        req = GenerationRequest(
            request_id=rid, route=as_route(adapter), sampling=sampling, prompt_token_ids=ids
        )
        engine.add_request(req)
    start = time.perf_counter()
    while engine.has_work():
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"{out.request_id}: {out.error}")
            tokens[out.request_id].extend(out.new_token_ids)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": [tokens[f"{tag}-{i}"] for i in range(len(reqs))]}


def backend_for(mode: str, chosen: Any, pooled: bool) -> Any:
    """The engine's own start-up choice (`auto`), or the same stacked backend for both."""
    if mode == "auto":
        return chosen
    inner = PackedLoRA() if mode == "stacked-packed" else StackedLoRA()
    return PooledBackend(inner) if pooled else inner


def measure(
    engines: dict[str, LLMEngine], reqs: list[tuple[list[int], str]], label: str,
    args: argparse.Namespace, identical: dict[str, str],
) -> list[dict[str, Any]]:  # fmt: skip
    """ABBA rounds of one workload over both engines: one row per layout."""
    times: dict[str, list[float]] = {n: [] for n in engines}
    outs: dict[str, list[list[int]]] = {}
    for name, engine in engines.items():  # untimed: a packed backend packs its slot range
        run(engine, reqs, f"{label}-warm-{name}", 2)
    order = [n for _ in range(args.rounds) for n in ("padded", "pooled", "pooled", "padded")]
    for k, name in enumerate(order):
        r = run(engines[name], reqs, f"{label}-{k}", args.new_tokens)
        times[name].append(r["seconds"])
        outs.setdefault(name, r["tokens"])
    same = sum(a == b for a, b in zip(outs["padded"], outs["pooled"], strict=True))
    identical[label] = f"{same}/{len(reqs)}"
    n_tokens = len(reqs) * args.new_tokens
    rows = []
    for name, engine in engines.items():
        med = statistics.median(times[name])
        rows.append({
            "workload": label, "layout": name, "requests": len(reqs),
            "tok_per_s_median": round(n_tokens / med, 1),
            "tok_per_s_each_run": [round(n_tokens / t, 1) for t in times[name]],
            "backend": engine.hot_set.backend.name,
        })  # fmt: skip
    return rows


def memory(engine: LLMEngine) -> dict[str, Any]:
    slots = engine.hot_set.slots
    per_pool = {f"r={p.rank}": slots.slot_nbytes(p.first) for p in slots.pools}
    set_bytes = sum(slots.slot_nbytes(s) for s in (engine.hot_set.slot_of(n) for n in SMALL + BIG))
    return {
        "slot_bytes_by_pool": per_pool,
        "hot_set_bytes": slots.capacity_nbytes(),
        "bytes_of_the_10_adapters": set_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=SMOLLM2_SHAPE)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds per workload")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument(
        "--backends", nargs="+", default=["auto", "stacked", "stacked-packed"],
        choices=["auto", "stacked", "stacked-packed"],
        help="auto: each engine's start-up choice; else the same CPU backend for both",
    )  # fmt: skip
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == SMOLLM2_SHAPE:
            model = make_native_tiny_model(
                Path(tmp) / "model", vocab_size=2048, hidden_size=576, num_layers=4,
                num_heads=9, num_kv_heads=3, intermediate_size=1536,
            )  # fmt: skip
        else:
            model = resolve_model_path(args.model)
        adapters = make_adapters(model, Path(tmp))
        engines = {}
        for name, hot in LAYOUTS.items():
            config = EngineConfig(
                model=str(model), device="cpu", dtype=args.dtype, max_num_seqs=32,
                max_model_len=256, max_num_batched_tokens=1024, hot_set=hot,
                enable_prefix_caching=False,
            )  # fmt: skip
            engines[name] = LLMEngine(config, DirectorySource(adapters))
        vocab = engines["padded"].model.arch.vocab_size
        work = workloads(vocab, args.prompt_len)
        for name, engine in engines.items():  # warm-up: every adapter loaded, start-up done
            run(engine, next(iter(work.values())), f"warm-{name}", 4)
        chosen = {name: engine.hot_set.backend for name, engine in engines.items()}
        rows, identical = [], {}
        for mode in args.backends:
            for name, engine in engines.items():
                engine.hot_set.backend = backend_for(mode, chosen[name], name == "pooled")
            for wname, reqs in work.items():
                label = f"{wname}, backend {mode}"
                rows += measure(engines, reqs, label, args, identical)
        mem = {name: memory(engine) for name, engine in engines.items()}
    print(f"{'workload':58} {'layout':8} {'tok/s (median)':>15}  runs")
    for r in rows:
        print(f"{r['workload']:58} {r['layout']:8} {r['tok_per_s_median']:>15}  "
              f"{r['tok_per_s_each_run']}")  # fmt: skip
    print(f"\n{'layout':8} {'slot bytes by pool':40} {'hot-set bytes':>14} {'10 adapters':>12}")
    for name, m in mem.items():
        print(f"{name:8} {m['slot_bytes_by_pool']!s:40} {m['hot_set_bytes']:>14,} "
              f"{m['bytes_of_the_10_adapters']:>12,}")  # fmt: skip
    print(f"\nsame greedy tokens (padded vs pooled): {identical}")
    write_json(args.out, {
        "benchmark": "rank_pools",
        "model": args.model, "dtype": args.dtype, "threads": args.threads,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "method": f"both layouts in one process, ABBA rounds x{args.rounds} per workload "
                  "(padded, pooled, pooled, padded), median; shared 2-core box under load by "
                  "other engineers: absolute numbers are noisy, the ratio is the point",
        "adapters": {"rank 4": SMALL, "rank 64": BIG},
        "layouts": {n: h.model_dump(include={"num_slots", "max_rank", "rank_pools"})
                    for n, h in LAYOUTS.items()},
        "throughput": rows, "memory": mem, "same_greedy_tokens": identical,
    })  # fmt: skip


if __name__ == "__main__":
    main()
