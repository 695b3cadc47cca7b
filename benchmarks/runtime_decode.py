"""Decode throughput per route kind, and one per-token pass vs K per-sequence passes.

Runs on SmolLM2-135M-Instruct (the embedded model) with 4 random rank-16 adapters on every target
module. Every number in a table is measured in this one run, side by side, so ratios compare like
with like. Prints a table and writes `benchmarks/results/runtime_decode.json`.

    .venv/bin/python -m benchmarks.runtime_decode [--quick]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from benchmarks.report import RESULTS_DIR, write_json
from molora_runtime.config import LORA_TARGET_MODULES, EngineConfig, HotSetConfig
from molora_runtime.engine.engine import LLMEngine
from molora_runtime.engine.llm import as_route
from molora_runtime.engine.types import GenerationRequest, SamplingParams
from molora_runtime.lora.composition import CompositionConfig, save_composition
from molora_runtime.lora.routing import RouteSegment, build_lora_context
from molora_runtime.lora.source import DirectorySource
from molora_runtime.model.arch import load_arch
from molora_runtime.model.attention_meta import step_attention
from molora_runtime.model.model_paths import resolve_model_path

RESULTS = RESULTS_DIR / "runtime_decode.json"
NAMES = ["math", "code", "style", "facts"]


def make_adapters(model_dir: Path, work: Path, rank: int) -> dict[str, Path]:
    from peft import LoraConfig, get_peft_model  # the optional `train` extra

    out = {}
    for i, name in enumerate(NAMES):
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(model_dir)
        cfg = LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            target_modules=list(LORA_TARGET_MODULES),
            init_lora_weights=False,
        )
        peft_model = get_peft_model(base, cfg)
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.data.mul_(0.01)  # keep outputs sane; speed does not depend on values
        peft_model.save_pretrained(work / name)
        out[name] = work / name
    return out


def make_composition(work: Path, num_layers: int, hidden: int, top_k: int) -> Path:
    torch.manual_seed(7)
    cfg = CompositionConfig(
        base_model="smollm2-135m-instruct",
        adapters=NAMES,
        top_k=top_k,
        num_layers=num_layers,
        hidden_size=hidden,
    )
    return save_composition(
        work / f"moe-top{top_k}", cfg, torch.randn(num_layers, len(NAMES), hidden)
    )


def route_cases(vocab_size: int) -> dict[str, Any]:
    quarter = vocab_size // 4
    return {
        "base": lambda i: None,
        "one adapter": lambda i: "math",
        "4 adapters, one per request": lambda i: NAMES[i % 4],
        "4-adapter mix per request": lambda i: "math:0.25+code:0.25+style:0.25+facts:0.25",
        "vocab route (4 ranges)": lambda i: {
            "kind": "vocab",
            "ranges": [
                {"start": k * quarter, "end": (k + 1) * quarter, "adapter": NAMES[k]}
                for k in range(4)
            ],
        },
        "learned top-1": lambda i: {"kind": "learned", "composition": "moe-top1"},
        "learned top-2": lambda i: {"kind": "learned", "composition": "moe-top2"},
    }


def decode_step_times(
    engine: LLMEngine, route_fn: Any, batch: int, steps: int, prompt_len: int
) -> list[float]:
    """Per-step seconds of `steps` decode steps of `batch` requests on one route kind."""
    gen = torch.Generator().manual_seed(0)
    for i in range(batch):
        ids = torch.randint(100, 20000, (prompt_len,), generator=gen).tolist()
        engine.add_request(
            GenerationRequest(
                request_id=f"r{i}",
                prompt_token_ids=ids,
                route=as_route(route_fn(i)),
                sampling=SamplingParams(max_tokens=steps + 4, ignore_eos=True),
            )
        )
    while any(s.in_prefill for s in engine.running) or engine.waiting or engine._incoming:
        engine.step()
    engine.step()  # first decode step (warm-up)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for s in list(engine.running):
        engine.abort(s.request_id)
    while engine.has_work():
        engine.step()
    return times


def per_token_vs_per_sequence(engine: LLMEngine, tokens: int, repeats: int) -> dict[str, float]:
    """One pass with each quarter of the sequence routed to its own adapter vs 4 full passes."""
    dev = engine.device
    ids = torch.randint(100, 20000, (tokens,), generator=torch.Generator().manual_seed(1)).to(dev)
    quarter = tokens // 4
    names = NAMES
    engine.hot_set.ensure(names)

    def run(segments: list[RouteSegment]) -> float:
        bs = engine.kv.block_size
        table = list(range(-(-tokens // bs)))  # the idle engine's first blocks
        slots = [(table[p // bs], p % bs) for p in range(tokens)]
        meta = step_attention(
            slots, list(range(tokens)), [], [(0, tokens, 0, table)], engine.kv, dev
        )
        ctx = build_lora_context(segments, engine.hot_set, engine.width, dev)
        start = time.perf_counter()
        with torch.inference_mode():
            engine.model(ids, meta, engine.kv, ctx, torch.tensor([tokens - 1], device=dev))
        return time.perf_counter() - start

    per_token_segments = [
        RouteSegment(as_route(names[k]), ids[k * quarter : (k + 1) * quarter]) for k in range(4)
    ]
    t_token, t_seq = [], []
    for _ in range(repeats):
        t_token.append(run(per_token_segments))
        t_seq.append(sum(run([RouteSegment(as_route(n), ids)]) for n in names))
    tok, seq = statistics.median(t_token), statistics.median(t_seq)
    return {"tokens": tokens, "per_token_s": tok, "four_per_sequence_s": seq, "ratio": seq / tok}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and batch sizes")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per case")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model_dir = resolve_model_path("smollm2-135m-instruct")
    batches = [1, 8] if args.quick else [1, 8, 32]
    steps = 4 if args.quick else 8
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        adapters = make_adapters(model_dir, work, args.rank)
        config = EngineConfig(
            model=str(model_dir),
            dtype="float32",
            max_num_seqs=max(batches),
            max_model_len=512 if not args.quick else 256,
            max_num_batched_tokens=4096,
            hot_set=HotSetConfig(num_slots=4, max_rank=args.rank),
        )
        arch = load_arch(model_dir)
        comps = {
            f"moe-top{k}": make_composition(work, arch.num_layers, arch.hidden_size, k)
            for k in (1, 2)
        }
        # Compositions are served names from the start: the engine checks routes against them.
        engine = LLMEngine(config, DirectorySource(adapters, comps))
        # Cases are interleaved round by round and each keeps the median step time, so a
        # neighbour's load on this shared machine spreads over all cases instead of one.
        cases = route_cases(engine.arch.vocab_size)
        times: dict[tuple[str, int], list[float]] = {(c, b): [] for c in cases for b in batches}
        for _ in range(args.rounds):
            for b in batches:
                for label, fn in cases.items():
                    times[(label, b)] += decode_step_times(engine, fn, b, steps, prompt_len=32)
        rows = []
        for label in cases:
            row: dict[str, Any] = {"route": label}
            for b in batches:
                median = statistics.median(times[(label, b)])
                row[f"batch{b}_step_ms"] = median * 1e3
                row[f"batch{b}_tok_s"] = b / median
            rows.append(row)
        base = rows[0]
        for row in rows:
            for b in batches:
                row[f"batch{b}_vs_base"] = row[f"batch{b}_tok_s"] / base[f"batch{b}_tok_s"]
        # The 4-domain prefill needs a cache row as long as the sequence.
        seq_len = 256 if args.quick else 512
        ratio = per_token_vs_per_sequence(engine, seq_len, repeats=5)

    header = "route".ljust(30) + "".join(
        f"{'b=' + str(b) + ' tok/s':>14}{'×base':>8}" for b in batches
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        cells = "".join(
            f"{row[f'batch{b}_tok_s']:>14.1f}{row[f'batch{b}_vs_base']:>8.2f}" for b in batches
        )
        print(row["route"].ljust(30) + cells)
    print(
        f"\nper-token pass over a 4-domain {ratio['tokens']}-token sequence: {ratio['per_token_s'] * 1e3:.1f} ms;"
        f" 4 per-sequence passes: {ratio['four_per_sequence_s'] * 1e3:.1f} ms; ratio {ratio['ratio']:.2f}×"
    )
    write_json(
        RESULTS,
        {
            "model": "smollm2-135m-instruct",
            "device": "cpu",
            "dtype": "float32",
            "rank": args.rank,
            "threads": torch.get_num_threads(),
            "rounds": args.rounds,
            "steps_per_round": steps,
            "statistic": "median decode-step time over interleaved rounds",
            "machine": platform.machine(),
            "decode": rows,
            "per_token_vs_per_sequence": ratio,
        },
    )


if __name__ == "__main__":
    main()
