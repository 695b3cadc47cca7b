"""Draft acceptance of the learned draft (eagle) beside n-gram lookup, offline, on the bundled
SmolLM2-135M-Instruct and the bundled store: a shared head, and a head tuned on one adapter.

Heads are trained first with the training CLI (`molora train draft`) under `--work` (a temp dir
by default; a head already there is reused with `--reuse`): the shared head on the base model's
greedy answers to reasoning-gym prompts of the training split, then a copy of it tuned on the
`arithmetic` adapter's answers to the same kind of prompts. Then one engine per drafter (fp32, CPU,
`max_num_seqs` 4, speculation on for every step) answers the same prompts greedily on every route
kind of `benchmarks/spec_decode.py` (base, `arithmetic`, the static mix, the vocabulary route
`digits`, the learned top-2 composition `molora`): `ngram` (k=4, n in [2, 4]), `eagle` with the
shared head (k=4), and `eagle` with the per-adapter head for `arithmetic` (on its own route; every
other route drafts with the shared head, so it is not rerun). Workloads: `tasks` (reasoning-gym
prompts of the evaluation split, disjoint from the heads' training prompts) and `grounded` (the
passages of `benchmarks/spec_prompts.py`, which the heads never saw).

Per cell: acceptance rate (accepted / draft tokens) and mean accepted length (1 + accepted /
drafts), from the engine's own counters; and whether every answer equals the n-gram run's (both
are exact, so they must). Counts only: no wall time (the box is shared).

    .venv/bin/python -m benchmarks.draft_acceptance [--work DIR] [--reuse] [--prompts 8]
        [--max-tokens 64] [--sequences 128] [--steps 150] [--adapter-sequences 64]
        [--adapter-steps 60] [--threads 1] [--routes base single ...] [--workloads tasks grounded]

Writes `benchmarks/results/draft_acceptance.json` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import BUNDLED_STORE, RESULTS_DIR, write_json
from benchmarks.spec_decode import (
    MODEL,
    NGRAM,
    ROUTES,
    SINGLE_ADAPTER,
    adapter_folder,
    git_commit,
    offline_route,
)
from benchmarks.spec_prompts import GROUNDED

RESULTS = RESULTS_DIR / "draft_acceptance.json"
MAX_NUM_SEQS = 4
EAGLE = {"method": "eagle", "num_speculative_tokens": 4}
DOMAINS = ["arithmetic", "sorting", "counting", "reversal"]


def workload_prompts(name: str, n: int) -> list[list[dict[str, str]]]:
    """Chat messages of one workload's first `n` prompts."""
    if name == "grounded":
        return [[{"role": "user", "content": p.text}] for p in GROUNDED[:n]]
    from molora_runtime.training.data import mixed_examples

    return [e.messages() for e in mixed_examples(DOMAINS, n, seed=3, split="eval")]


def train_heads(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The shared head and the `arithmetic` head, with the CLI; what each took."""
    from deployments.ops.cli import main as molora

    shared, own = work / "shared", work / SINGLE_ADAPTER
    common = ["--max-tokens", str(args.max_tokens), "--batch-size", "16",
              "--threads", str(args.threads)]  # fmt: skip
    runs = [
        (shared, ["--sequences", str(args.sequences), "--steps", str(args.steps)]),
        (own, ["--sequences", str(args.adapter_sequences), "--steps", str(args.adapter_steps),
               "--adapter", f"{SINGLE_ADAPTER}={adapter_folder(SINGLE_ADAPTER)}",
               "--init-from", str(shared), "--seed", "1"]),
    ]  # fmt: skip
    took: dict[str, Any] = {}
    for folder, extra in runs:
        if args.reuse and (folder / "draft_head.safetensors").is_file():
            took[folder.name] = "reused"
            continue
        start = time.process_time()
        code = molora(["train", "draft", "--output", str(folder), *common, *extra])
        if code:
            raise SystemExit(f"training {folder.name} failed ({code})")
        took[folder.name] = {"cpu_s": round(time.process_time() - start, 1)}
    for folder, _ in runs:  # what each head was trained on, reused or not
        record = json.loads((folder / "draft_head.json").read_text())
        took[folder.name] = {"run": took[folder.name], **record}
    return {"shared": shared, "own": own, "training": took}


def engine_for(speculative: dict[str, Any]) -> Any:
    from deployments.catalog.store import open_source
    from deployments.config import StoreConfig
    from molora_runtime.config import EngineConfig, HotSetConfig, SpeculativeConfig
    from molora_runtime.engine.engine import LLMEngine

    spec = SpeculativeConfig(**speculative, max_batch=MAX_NUM_SEQS)
    config = EngineConfig(model=MODEL, device="cpu", dtype="float32", max_num_seqs=MAX_NUM_SEQS,
                          max_model_len=1024, max_num_batched_tokens=1024,
                          hot_set=HotSetConfig(num_slots=6, max_rank=16), speculative=spec)  # fmt: skip
    return LLMEngine(config, open_source(StoreConfig(url=str(BUNDLED_STORE))))


def run_cell(engine: Any, route: str, prompts: list, max_tokens: int) -> dict[str, Any]:
    """Every prompt on one route (all at once, `max_num_seqs` decoding together); the counters'
    deltas and the answers."""
    from molora_runtime.engine.types import GenerationRequest, SamplingParams

    before = engine.drafter.counters.snapshot().total
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    answers: dict[str, list[int]] = {}
    for i, messages in enumerate(prompts):
        req = GenerationRequest(request_id=f"{route}-{i}-{time.monotonic_ns()}",
                                route=offline_route(ROUTES[route]), sampling=sampling,
                                messages=messages)  # fmt: skip
        engine.add_request(req, engine.validate_request(req))
        answers[req.request_id] = []
    while engine.has_work():
        for out in engine.step():
            answers[out.request_id].extend(out.new_token_ids)
    after = engine.drafter.counters.snapshot().total
    drafts, tokens = after.drafts - before.drafts, after.draft_tokens - before.draft_tokens
    accepted = after.accepted - before.accepted
    return {"drafts": drafts, "draft_tokens": tokens, "accepted": accepted,
            "acceptance_rate": round(accepted / tokens, 4) if tokens else None,
            "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else None,
            "completion_tokens": sum(len(a) for a in answers.values()),
            "answers": list(answers.values())}  # fmt: skip


def render(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| workload | route | drafter | acceptance | mean accepted length | drafts | "
             "same answers as ngram |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        rate = "—" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        length = "—" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        lines.append(f"| {r['workload']} | {r['route']} | {r['drafter']} | {rate} | {length} | "
                     f"{r['drafts']} | {r['same_as_ngram']} |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=None, help="where heads are trained (temp dir)")
    p.add_argument("--reuse", action="store_true", help="reuse heads already in --work")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--sequences", type=int, default=128)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--adapter-sequences", type=int, default=64)
    p.add_argument("--adapter-steps", type=int, default=60)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: fair on a shared box)")
    p.add_argument("--routes", nargs="+", default=list(ROUTES), choices=list(ROUTES))
    p.add_argument("--workloads", nargs="+", default=["tasks", "grounded"],
                   choices=["tasks", "grounded"])  # fmt: skip
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    work = args.work or Path(tempfile.mkdtemp(prefix="draft-heads-"))
    heads = train_heads(args, work)
    drafters: dict[str, tuple[dict[str, Any], list[str]]] = {
        "ngram": (NGRAM, args.routes),
        "eagle shared": ({**EAGLE, "model": str(heads["shared"])}, args.routes),
        f"eagle {SINGLE_ADAPTER} head": (
            {**EAGLE, "model": str(heads["shared"]),
             "draft_heads": {SINGLE_ADAPTER: str(heads["own"])}},
            [r for r in args.routes if r == "single"],
        ),
    }  # fmt: skip
    rows: list[dict[str, Any]] = []
    reference: dict[tuple[str, str], list[list[int]]] = {}
    for drafter, (spec, routes) in drafters.items():
        if not routes:
            continue
        engine = engine_for(spec)
        for workload in args.workloads:
            prompts = workload_prompts(workload, args.prompts)
            for route in routes:
                cell = run_cell(engine, route, prompts, args.max_tokens)
                answers = cell.pop("answers")
                ref = reference.setdefault((workload, route), answers)
                same = sum(a == b for a, b in zip(answers, ref, strict=True))
                row = {"workload": workload, "route": route, "drafter": drafter, **cell,
                       "same_as_ngram": f"{same}/{len(answers)}"}  # fmt: skip
                print(row, flush=True)
                rows.append(row)
        del engine
    table = render(rows)
    print("\n".join(table))
    write_json(RESULTS, {
        "benchmark": "draft_acceptance", "git_commit": git_commit(), "model": MODEL,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "training": heads["training"], "rows": rows, "table": table,
    })  # fmt: skip


if __name__ == "__main__":
    main()
