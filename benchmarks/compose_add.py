"""Adding an expert without retraining the rest: `compose add` against retraining the gate.

Trains (or reuses from the work folder) a 5th adapter on a new reasoning-gym domain, publishes
it and `molora` + it (new gate rows only, `compose add`) into a throwaway store layered over the
default one, retrains a gate from scratch over all five with the same budget, and scores with
the serving engine: the old composition, the grown one, the retrained one and the new adapter
alone, on the four old domains, the new one, mixed prompts pairing the new domain with an old
one, and mixed old-old prompts. CPU-minutes are process CPU time (all threads) of each training.
Few training steps, so it runs in minutes on a 2-core box; the old domains get enough prompts
(96 one-task prompts each, ~1 point per prompt) that a 98% retention is resolvable, and the
share of their completions that come out identical to the old composition's is counted too.
The new adapter alone is scored only where it can answer (its domain and the mixed+new prompts).

    python -m benchmarks.compose_add
    python -m benchmarks.compose_add --gate-steps 60 --old-per-domain 128
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from adapter_store.config import molora_home
from adapter_store.source import AdapterStoreSource
from adapter_store.versions import open_registry
from benchmarks.report import BUNDLED_STORE, RESULTS_DIR, write_json
from molora_runtime.engine.llm import LLM
from molora_runtime.engine.types import SamplingParams
from molora_runtime.routes import LearnedRoute, SingleRoute
from molora_runtime.training.adapter import AdapterTrainConfig, train_adapter
from molora_runtime.training.compose_add import ComposeAddConfig, GrowSettings, compose_add
from molora_runtime.training.data import domain_examples, mixed_examples
from molora_runtime.training.evaluate import render_all, score
from molora_runtime.training.grow import mixed_with_new
from molora_runtime.training.router import RouterTrainConfig, train_router

NAME = "molora"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--store", default=str(BUNDLED_STORE), help="store holding `molora`")
    p.add_argument("--new", default="multiplication", help="the new expert's domain")
    p.add_argument("--adapter-steps", type=int, default=16)
    p.add_argument("--gate-steps", type=int, default=32, help="compose add and scratch each")
    p.add_argument("--gate-lr", type=float, default=5e-2)
    p.add_argument("--batch-size", type=int, default=4, help="gate training batch")
    p.add_argument("--old-per-domain", type=int, default=96, help="eval prompts, each old domain")
    p.add_argument("--per-domain", type=int, default=24, help="eval prompts of the new domain")
    p.add_argument("--mixed", type=int, default=12, help="mixed eval prompts, each kind")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="training seed (new adapter, both gates)")
    p.add_argument("--eval-seed", type=int, default=0, help="which held-out prompts are scored")
    p.add_argument("--work", default=str(molora_home() / "train" / "compose_add"))
    p.add_argument("--out", default=str(RESULTS_DIR / "compose_add.json"))
    return p.parse_args()


def cpu_minutes(fn, *args, **kwargs):
    """`fn`'s result and the CPU-minutes this process spent in it."""
    t0 = time.process_time()
    result = fn(*args, **kwargs)
    return result, (time.process_time() - t0) / 60


def new_adapter(args: argparse.Namespace) -> tuple[Path, float]:
    """The new domain's adapter (the default store's rank, upper layers only, few steps),
    trained once per config; its CPU-minutes are kept beside it."""
    suffix = f"-seed{args.seed}" if args.seed else ""
    cfg = AdapterTrainConfig(
        model=args.model, domain=args.new, rank=16, alpha=32, first_layer=16,
        steps=args.adapter_steps, batch_size=8, lr=4e-3, warmup=2, seed=args.seed,
        threads=args.threads, output=str(Path(args.work) / f"{args.new}-{args.adapter_steps}{suffix}"),
    )  # fmt: skip
    folder, meter = Path(cfg.output), Path(f"{cfg.output}.cpu_minutes.json")
    if meter.is_file():
        return folder, json.loads(meter.read_text())["cpu_minutes"]
    _, minutes = cpu_minutes(train_adapter, cfg)
    meter.write_text(json.dumps({"cpu_minutes": minutes}))
    return folder, minutes


def eval_examples(
    old: list[str], new: str, old_per_domain: int, per_domain: int, mixed: int, seed: int = 0
) -> list:
    singles = [e for d in old for e in domain_examples(d, old_per_domain, seed, "eval", 1)]
    singles += domain_examples(new, per_domain, seed, "eval", 1)
    pairs_new = mixed_with_new(old, new, mixed, seed)
    for e in pairs_new:
        e.meta["bucket"] = "mixed+new"
    pairs_old = mixed_examples(old, mixed, seed, "eval")
    for e in pairs_old:
        e.meta["bucket"] = "mixed old"
    return singles + pairs_new + pairs_old


def accuracy(examples: list, completions: list[str]) -> dict[str, float]:
    subs, _ = score(examples, completions)
    buckets: dict[str, list[float]] = {}
    for e, s in zip(examples, subs, strict=True):
        buckets.setdefault(e.meta.get("bucket", e.tasks[0].domain), []).extend(s)
    return {k: round(100 * sum(v) / len(v), 1) for k, v in buckets.items()}


def routing_card(folder: Path) -> dict[str, float]:
    """The held-out routing shares `compose add` wrote into the composition's card."""
    text = (folder / "README.md").read_text()
    _, _, tail = text.partition("Routing on held-out prompts:")
    rows = [line[2:].split(": ") for line in tail.splitlines() if line.startswith("- ")]
    return {k: float(v) for k, v in rows}


def identical(examples: list, a: list[str], b: list[str], domains: list[str]) -> dict[str, float]:
    """Per old domain, the share of one-task prompts whose completions under `a` and `b` match."""
    same: dict[str, list[bool]] = {d: [] for d in domains}
    for e, x, y in zip(examples, a, b, strict=True):
        if e.kind != "mixed" and e.tasks[0].domain in same:
            same[e.tasks[0].domain].append(x == y)
    return {d: round(sum(v) / len(v), 3) for d, v in same.items() if v}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.monotonic()
    adapter_dir, adapter_min = new_adapter(args)
    print(f"new adapter {args.new}: {adapter_min:.1f} CPU-min", flush=True)

    with tempfile.TemporaryDirectory(prefix="molora-compose-add-bench-") as tmp:
        registry = open_registry(f"{tmp}/store|{args.store}")
        old = registry.latest("composition", NAME)
        expert = registry.publish_adapter(adapter_dir, args.new, "v1", base_model=args.model)
        grow = GrowSettings(
            steps=args.gate_steps, batch_size=args.batch_size, lr=args.gate_lr, warmup=1,
            seed=args.seed,
        )  # fmt: skip
        cfg = ComposeAddConfig(
            composition=old.ref, adapter=expert.ref, device="cpu", threads=args.threads, grow=grow
        )
        (grown, add_cpu_s) = compose_add(registry, cfg)
        print(f"compose add -> {grown.ref}: {add_cpu_s / 60:.1f} CPU-min", flush=True)
        source = AdapterStoreSource(registry=registry)
        routing = routing_card(source.composition_path(grown.ref))
        refs = list(grown.adapters)
        adapters = {ref: str(source.adapter_path(ref)) for ref in refs}
        scratch_cfg = RouterTrainConfig(
            model=args.model, adapters=adapters, output=f"{tmp}/scratch", top_k=old.top_k,
            steps=args.gate_steps, batch_size=args.batch_size, lr=args.gate_lr, warmup=1,
            seed=args.seed, threads=args.threads, device="cpu", checkpoint_every=10**6,
        )  # fmt: skip
        scratch_dir, scratch_min = cpu_minutes(train_router, scratch_cfg)
        print(f"scratch gate over {len(refs)}: {scratch_min:.1f} CPU-min", flush=True)

        old_domains = [r.split("@")[0] for r in old.adapters]
        examples = eval_examples(
            old_domains, args.new, args.old_per_domain, args.per_domain, args.mixed, args.eval_seed
        )
        llm = LLM(
            model=args.model,
            adapters=adapters,
            compositions={
                "old": str(source.composition_path(old.ref)),
                "grown": str(source.composition_path(grown.ref)),
                "scratch": str(scratch_dir),
            },
            dtype="float32",
            device="cpu",
            max_num_seqs=64,
            max_num_batched_tokens=4096,
            max_model_len=512,
            hot_set={"num_slots": len(refs) + 1},
        )
        prompts = render_all(llm.tokenizer, examples)
        needs_new = [i for i, e in enumerate(examples) if args.new in e.domains]
        longest = max(len(llm.tokenizer(e.target())["input_ids"]) for e in examples)
        sp = SamplingParams(max_tokens=longest + 8, temperature=0.0)
        routes = {
            f"{old.ref} (4 experts)": LearnedRoute(composition="old"),
            f"{grown.ref} compose add": LearnedRoute(composition="grown"),
            "scratch gate over 5": LearnedRoute(composition="scratch"),
            f"{args.new} alone": SingleRoute(adapter=expert.ref),
        }
        table, texts = {}, {}
        for label, route in routes.items():
            t0 = time.monotonic()
            idx = needs_new if isinstance(route, SingleRoute) else range(len(examples))
            subset = [examples[i] for i in idx]
            out = llm.generate([prompts[i] for i in idx], sampling_params=sp, routes=route)
            texts[label] = [r.text for r in out]
            table[label] = accuracy(subset, texts[label])
            print(
                f"  {label:<28} {len(subset):4d} prompts {time.monotonic() - t0:6.1f}s", flush=True
            )

    columns = [*old_domains, args.new, "mixed+new", "mixed old"]
    print(f"\n{'route':<30}" + "".join(f"{c:>12}" for c in columns))
    for label, row in table.items():
        print(f"{label:<30}" + "".join(f"{row.get(c, float('nan')):>12.1f}" for c in columns))
    o, g, s, alone = (table[k] for k in routes)
    old_label, grown_label, scratch_label = list(routes)[:3]
    same = {
        "compose_add": identical(examples, texts[old_label], texts[grown_label], old_domains),
        "scratch": identical(examples, texts[old_label], texts[scratch_label], old_domains),
    }
    kept = {d: round(g[d] / o[d], 3) if o[d] else None for d in old_domains}
    targets = {
        "old_domains_kept_vs_old (>= 0.98)": kept,
        "new_domain_vs_adapter_alone (>= 0.90)": round(g[args.new] / alone[args.new], 3)
        if alone[args.new]
        else None,
        "mixed_new_gain_points": round(g["mixed+new"] - o["mixed+new"], 1),
        "scratch_vs_add_on_new_domain": round(s[args.new] - g[args.new], 1),
    }
    cpu = {
        "new_adapter": round(adapter_min, 2),
        "compose_add_gate_rows": round(add_cpu_s / 60, 2),
        "scratch_gate_all_rows": round(scratch_min, 2),
    }
    print("\nCPU-minutes:", json.dumps(cpu), "\ntargets:", json.dumps(targets))
    print("old-domain completions identical to the old composition's:", json.dumps(same))
    print("compose add routing on held-out prompts:", json.dumps(routing))
    write_json(
        args.out,
        {
            "model": args.model,
            "composition": old.ref,
            "new_domain": args.new,
            "steps": {"adapter": args.adapter_steps, "gate": args.gate_steps},
            "eval": {
                "old_per_domain": args.old_per_domain,
                "new_per_domain": args.per_domain,
                "mixed_each": args.mixed,
                "seed": args.eval_seed,
            },
            "training_seed": args.seed,
            "metric": "exact-match % per sub-answer (engine, greedy)",
            "table": table,
            "targets": targets,
            "old_completions_identical_to_old": same,
            "compose_add_heldout_routing": routing,
            "cpu_minutes": cpu,
            "torch_threads": args.threads,
            "seconds": round(time.monotonic() - t_start, 1),
            "note": "accuracies are greedy and deterministic; CPU-minutes are process CPU time on a"
            " box other jobs may share (its CPU under machine_info)",
        },
    )


if __name__ == "__main__":
    main()
