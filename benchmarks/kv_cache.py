"""Paged KV cache and prefix caching: concurrency at a fixed budget, TTFT on a shared prefix,
and decode speed against the previous (static-row) engine, measured side by side in one run.

(a) One KV budget (16,384 tokens: 8 static rows of max_model_len=2048), a length mix of prompts
    50-1,500 tokens and outputs 16-256: peak concurrent sequences and output tok/s. "static rows"
    runs this engine capped at budget // (max_model_len x bytes per token) sequences, which is
    what the old engine's static rows allowed; "paged" admits by free blocks. Run for
    max_model_len 2048 (the tightest a static server could set for this mix) and 4096 (a
    context a server would configure; SmolLM2's own is 8192): static rows halve, paged do not.
(b) A shared 1,024-token system prompt over 4 adapters and a learned route, requests one after
    another: time to first token with the prefix cache on (p50 over hits) and off.
(c) Decode tok/s at batch 1/8/32 of the old engine (a checkout given by --baseline, run in a
    subprocess from its own code) and this one, alternated in the same run.

    python -m benchmarks.kv_cache [--baseline /path/to/old/checkout] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
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
from molora_runtime.model.attention_meta import KVCache
from molora_runtime.model.tiny import make_native_tiny_model, make_random_adapter
from molora_runtime.routes import LearnedRoute
from tests.molora_runtime.rt_util import make_composition

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_SHAPE = {"hidden_size": 576, "num_layers": 30, "vocab_size": 49152}


def _engine(model: Path, adapters: dict[str, Path], comps: dict[str, Path], **kw: Any):

    config = EngineConfig(
        model=str(model),
        device="cpu",
        dtype="float32",
        enable_cuda_graph=False,
        hot_set=HotSetConfig(num_slots=8, max_rank=8, allow_base_mismatch=True),
        **kw,
    )
    return LLMEngine(config, DirectorySource(adapters, comps))


def _request(rid: str, prompt: list[int], route: Any, max_tokens: int):

    return GenerationRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        route=as_route(route),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, clamp_to_context=False),
    )


def _check(outputs: list[Any]) -> list[Any]:
    """A benchmark whose requests fail measures nothing: stop at the first error."""
    for out in outputs:
        if out.error:
            raise RuntimeError(f"request {out.request_id} failed: {out.error}")
    return outputs


# ----- (a) concurrency at one budget ------------------------------------------------------------
def concurrency(tmp: Path, n: int) -> list[dict[str, Any]]:
    """Both `max_model_len` settings over one budget (see the module docstring)."""
    return [row for max_len in (2048, 4096) for row in _concurrency(tmp, n, max_len)]


def _concurrency(tmp: Path, n: int, max_len: int) -> list[dict[str, Any]]:

    model = make_native_tiny_model(tmp / f"small-{max_len}", vocab_size=512)
    rng = random.Random(0)
    mix = [(rng.randint(50, 1500), rng.randint(16, 256)) for _ in range(n)]
    probe = _engine(model, {}, {}, max_num_seqs=1, max_model_len=max_len)
    arch = probe.arch
    per_token = KVCache.bytes_per_token(
        arch.num_layers, arch.num_kv_heads, arch.head_dim, torch.float32
    )
    budget = 16384 * per_token
    static_rows = budget // (max_len * per_token)
    out = []
    for label, seqs in (("static rows", static_rows), ("paged", 256)):
        engine = _engine(
            model,
            {},
            {},
            max_num_seqs=seqs,
            max_model_len=max_len,
            kv_cache_bytes=budget,
            max_num_batched_tokens=2048,
            max_queue_len=4 * n,
            enable_prefix_caching=False,
        )
        for i, (p, o) in enumerate(mix):
            prompt = [rng.randrange(512) for _ in range(p)]
            engine.add_request(_request(f"r{i}", prompt, None, o))
        peak, tokens = 0, 0
        start = time.perf_counter()
        while engine.has_work():
            outs = _check(engine.step())
            peak = max(peak, len(engine.running))
            tokens += sum(len(o.new_token_ids) for o in outs)
        wall = time.perf_counter() - start
        out.append(
            {
                "engine": label,
                "max_model_len": max_len,
                "kv_budget_mb": round(budget / 2**20, 2),
                "max_concurrent": peak,
                "tok_s": round(tokens / wall, 1),
                "preemptions": engine.stats().kv.preemptions,
            }
        )
    return out


# ----- (b) TTFT on a shared system prompt ---------------------------------------------------------
def shared_prefix(tmp: Path, repeats: int) -> list[dict[str, Any]]:

    model = make_native_tiny_model(tmp / "smol", **SMOLLM2_SHAPE)
    names = [f"ad{i}" for i in range(4)]
    adapters = {n: make_random_adapter(tmp / n, model, rank=8, seed=i) for i, n in enumerate(names)}
    comps = {"moe": make_composition(model, tmp / "moe", names, top_k=2, seed=9)}
    routes: list[Any] = [*names, LearnedRoute(composition="moe")]
    rng = random.Random(1)
    system = [rng.randrange(100, 20000) for _ in range(1024)]
    out = []
    for caching in (False, True):
        engine = _engine(
            model,
            adapters,
            comps,
            max_num_seqs=4,
            max_model_len=2048,
            max_num_batched_tokens=2048,
            enable_prefix_caching=caching,
        )
        ttft: list[tuple[int, float]] = []  # (repeat, seconds)
        for rep in range(repeats):
            for j, route in enumerate(routes):
                user = [rng.randrange(100, 20000) for _ in range(24)]
                engine.add_request(_request(f"q{rep}-{j}", system + user, route, 1))
                start = time.perf_counter()
                while engine.has_work():
                    _check(engine.step())
                ttft.append((rep, time.perf_counter() - start))
        hits = [t for rep, t in ttft if rep > 0] if caching else [t for _, t in ttft]
        out.append(
            {
                "prefix_cache": "on (hits)" if caching else "off",
                "ttft_p50_s": round(statistics.median(hits), 4),
                "requests": len(hits),
                "prefix_hit_tokens": engine.stats().kv.prefix_hit_tokens if caching else 0,
            }
        )
    return out


# ----- (c) decode speed, old engine vs this one ---------------------------------------------------
def decode_worker(model: str, adapter: str, batches: list[int], steps: int) -> None:
    """Runs inside a subprocess whose PYTHONPATH picks the engine; prints one JSON line."""
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    gen = torch.Generator().manual_seed(0)
    result = {}
    for b in batches:
        engine = _engine(Path(model), {"ad0": Path(adapter)}, {}, max_num_seqs=b, max_model_len=512)
        for i in range(b):
            prompt = torch.randint(100, 20000, (64,), generator=gen).tolist()
            engine.add_request(_request(f"r{i}", prompt, "ad0" if i % 2 else None, 200))
        while engine.waiting or any(s.in_prefill for s in engine.running):
            _check(engine.step())
        for _ in range(3):
            _check(engine.step())
        assert len(engine.running) == b, "every request must be decoding"
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        result[str(b)] = b * steps / (time.perf_counter() - start)
    print("RESULT " + json.dumps(result))


def decode_side_by_side(tmp: Path, baseline: Path, steps: int, rounds: int) -> list[dict]:

    model = make_native_tiny_model(tmp / "smol-decode", **SMOLLM2_SHAPE)
    adapter = make_random_adapter(tmp / "ad0", model, rank=8, seed=0)
    batches = [1, 8, 32]
    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "paged": []}
    argv = [str(Path(__file__).resolve()), "--worker", str(model), str(adapter)]
    argv += ["--steps", str(steps), "--batches", ",".join(map(str, batches))]
    # run this file by path from the tree's root: `molora_runtime` and `kernels` come from there
    code = (
        f"import runpy, sys; sys.argv = {argv!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    worker = [sys.executable, "-c", code]
    for _ in range(rounds):
        for label, tree in (("baseline", baseline), ("paged", ROOT)):
            env = {**os.environ, "PYTHONPATH": str(tree)}
            proc = subprocess.run(worker, env=env, capture_output=True, text=True, cwd=tree)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                raise RuntimeError(f"{label} decode worker failed:\n{proc.stderr[-3000:]}")
            runs[label].append(json.loads(line[-1][7:]))
    rows = []
    for b in batches:
        old = statistics.median(r[str(b)] for r in runs["baseline"])
        new = statistics.median(r[str(b)] for r in runs["paged"])
        rows.append(
            {
                "batch": b,
                "baseline_tok_s": round(old, 1),
                "paged_tok_s": round(new, 1),
                "ratio": round(new / old, 3),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="checkout of the previous engine")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parts", default="abc")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/kv_cache.json")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "ADAPTER"), help=argparse.SUPPRESS)
    parser.add_argument("--batches", default="1,8,32", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        batches = [int(b) for b in args.batches.split(",")]
        decode_worker(args.worker[0], args.worker[1], batches, args.steps)
        return
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    result: dict[str, Any] = {"device": "cpu", "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if "a" in args.parts:
            result["concurrency"] = rows = concurrency(tmp, args.requests)
            print(
                f"\n(a) {'engine':<13}{'max len':>8}{'KV MB':>8}{'max concurrent':>16}"
                f"{'tok/s':>9}{'preempt':>9}"
            )
            for r in rows:
                print(
                    f"    {r['engine']:<13}{r['max_model_len']:>8}{r['kv_budget_mb']:>8}"
                    f"{r['max_concurrent']:>16}"
                    f"{r['tok_s']:>9}{r['preemptions']:>9}"
                )
        if "b" in args.parts:
            result["shared_prefix"] = rows = shared_prefix(tmp, args.repeats)
            print(f"\n(b) {'prefix cache':<14}{'TTFT p50 s':>12}{'requests':>10}{'hit tokens':>12}")
            for r in rows:
                print(
                    f"    {r['prefix_cache']:<14}{r['ttft_p50_s']:>12}{r['requests']:>10}"
                    f"{r['prefix_hit_tokens']:>12}"
                )
            result["ttft_speedup"] = round(rows[0]["ttft_p50_s"] / rows[1]["ttft_p50_s"], 2)
            print(f"    TTFT off / on: {result['ttft_speedup']}x")
        if "c" in args.parts and args.baseline is not None:
            result["decode"] = rows = decode_side_by_side(
                tmp, args.baseline, args.steps, args.rounds
            )
            print(f"\n(c) {'batch':<7}{'old tok/s':>11}{'paged tok/s':>13}{'ratio':>8}")
            for r in rows:
                print(
                    f"    {r['batch']:<7}{r['baseline_tok_s']:>11}{r['paged_tok_s']:>13}"
                    f"{r['ratio']:>8}"
                )

    write_json(args.out, result)


if __name__ == "__main__":
    main()
