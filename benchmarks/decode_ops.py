"""CPU ops per decode step (torch profiler) and decode tok/s, this tree vs a baseline tree.

A SmolLM2-shaped random model (`benchmarks.decode_step.SMOLLM2_SHAPE`) decodes a batch whose
requests are routed over 4 adapters. One `--measure` process reports, for this interpreter's
`molora_runtime` (whatever PYTHONPATH points at): profiler events per decode step (every aten op,
nested ones included) and decode tok/s. The driver runs that process for this tree and for
`--baseline` (e.g. a `git archive` of the previous commit) alternately, `--rounds` times each,
because absolute timings on a shared box are noisy; it writes a JSON and prints a table.

    python -m benchmarks.decode_ops --baseline BEFORE_TREE [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def measure(batch: int, steps: int, rank: int, dtype: str) -> dict[str, Any]:
    """Ops per decode step and decode tok/s of the `molora_runtime` on sys.path."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.decode_step import SMOLLM2_SHAPE
    from molora_runtime.config import EngineConfig, HotSetConfig
    from molora_runtime.engine.engine import LLMEngine
    from molora_runtime.engine.llm import as_route
    from molora_runtime.engine.types import GenerationRequest, SamplingParams
    from molora_runtime.lora.source import DirectorySource
    from molora_runtime.model.tiny import make_native_tiny_model, make_random_adapter

    with tempfile.TemporaryDirectory() as tmp:
        model = make_native_tiny_model(Path(tmp) / "model", **SMOLLM2_SHAPE)
        names = [f"ad{i}" for i in range(4)]
        adapters = {
            n: make_random_adapter(Path(tmp) / n, model, rank=rank, seed=i)
            for i, n in enumerate(names)
        }
        config = EngineConfig(
            model=str(model),
            device="cpu",
            dtype=dtype,
            max_num_seqs=batch,
            max_model_len=256,
            max_num_batched_tokens=max(2048, 16 * batch),
            hot_set=HotSetConfig(num_slots=4, max_rank=rank, allow_base_mismatch=True),
        )
        engine = LLMEngine(config, DirectorySource(adapters))
        gen = torch.Generator().manual_seed(0)
        for i in range(batch):
            engine.add_request(
                GenerationRequest(
                    request_id=f"r{i}",
                    prompt_token_ids=torch.randint(100, 20000, (16,), generator=gen).tolist(),
                    route=as_route(names[i % len(names)]),
                    # long enough that nobody finishes before the measured steps are done
                    sampling=SamplingParams(max_tokens=200, ignore_eos=True),
                )
            )

        def decoding() -> bool:
            running = list(engine.running)
            return len(running) == batch and not any(s.in_prefill for s in running)

        for _ in range(1000):  # admission waits for background adapter loads
            if decoding():
                break
            engine.step()
            time.sleep(0.01)
        else:
            raise RuntimeError("the batch never reached a full decode step")
        for _ in range(3):  # warm-up decode steps
            engine.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step()
        assert decoding(), "the profiled step must be a full decode step"
        events = prof.key_averages()
        ops = sum(e.count for e in events)
        aten = sum(e.count for e in events if e.key.startswith("aten::"))
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        elapsed = time.perf_counter() - start
    return {
        "ops_per_step": ops,
        "aten_ops_per_step": aten,
        "tok_s": batch * steps / elapsed,
    }


def _run_tree(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "decode_ops.py"), "--measure"]
    cmd += ["--batch", str(args.batch), "--steps", str(args.steps), "--rank", str(args.rank)]
    cmd += ["--dtype", args.dtype]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="tree of the 'before' code")
    parser.add_argument("--tree", type=Path, default=ROOT, help="tree of the 'after' code")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps (<= 150)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--measure", action="store_true", help="one measurement, JSON on stdout")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/decode_ops_cpu.json")
    args = parser.parse_args()
    if args.measure:
        sys.path.insert(0, os.environ.get("PYTHONPATH", str(ROOT)))
        print(json.dumps(measure(args.batch, args.steps, args.rank, args.dtype)))
        return
    if args.baseline is None:
        parser.error("--baseline is required (or --measure)")
    trees = {"before": args.baseline, "after": args.tree}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in trees}
    for _ in range(args.rounds):
        for label, tree in trees.items():
            runs[label].append(_run_tree(tree, args))
        _report(runs, args)  # after every round: a long run interrupted still leaves a result


def _report(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    from benchmarks.report import write_json

    summary = {
        label: {
            "ops_per_step": statistics.median(r["ops_per_step"] for r in rs),
            "aten_ops_per_step": statistics.median(r["aten_ops_per_step"] for r in rs),
            "tok_s_median": statistics.median(r["tok_s"] for r in rs),
            "tok_s_runs": [round(r["tok_s"], 1) for r in rs],
        }
        for label, rs in runs.items()
        if rs
    }
    print(f"{'':<8}{'ops/step':>10}{'aten ops':>10}{'tok/s p50':>11}  tok/s runs")
    for label, s in summary.items():
        print(
            f"{label:<8}{s['ops_per_step']:>10}{s['aten_ops_per_step']:>10}"
            f"{s['tok_s_median']:>11.1f}  {s['tok_s_runs']}"
        )
    write_json(
        args.out,
        {
            "device": "cpu",
            "model": "SmolLM2-shaped random (benchmarks.decode_step.SMOLLM2_SHAPE)",
            "dtype": args.dtype,
            "batch": args.batch,
            "adapters_routed": 4,
            "rank": args.rank,
            "rounds_done": min(len(rs) for rs in runs.values()),
            "note": "rounds alternate before/after in separate processes; ops = torch profiler "
            "events of one decode step (nested aten ops included)",
            "summary": summary,
        },
    )


if __name__ == "__main__":
    main()
