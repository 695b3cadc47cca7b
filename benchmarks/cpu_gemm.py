"""The CPU GEMM candidates per weight shape, as the engine's chooser sees them on this CPU.

For every base weight shape of a SmolLM2-135M-shaped model (fused q/k/v, o, fused gate/up, down,
the LM head; random weights) and each dtype, every kind that runs here (`panel`: the panel GEMM
of `kernels.cpu_panel_gemm`; `onednn`: oneDNN on the weight packed once; `plain`: `F.linear`) is
timed by `kernels.chooser.measure` at the row counts the engine's chooser uses, and the table
shows microseconds per GEMM, each kind's score (weighted time relative to the fastest; 1.0 = the
fastest everywhere) and the winner, picked as the engine picks (fp32: among the kinds that give
a row the same bits alone as in a batch). A last table adds the shapes up as a 30-layer decode pass
(plus the head) would run them: each fixed kind against the per-shape choice. One weight is timed
at a time, so it may sit in cache; the engine's own step is the end-to-end check.

    python -m benchmarks.cpu_gemm [--dtypes float32 bfloat16] [--reps 5] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks.machine import machine_info
from benchmarks.report import write_json
from kernels import chooser
from molora_runtime.model.packed_linear import (
    BASE_ROWS,
    HEAD_ROWS,
    gemm_candidates,
    row_invariant,
    runnable_kinds,
)

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152
QKV_OUT = HIDDEN + 2 * 192  # 9 query heads and 3 KV heads of 64
# name -> (out, in, how many a model has, the row counts it sees)
SHAPES: dict[str, tuple[int, int, int, tuple[int, ...]]] = {
    "qkv": (QKV_OUT, HIDDEN, LAYERS, BASE_ROWS),
    "o": (HIDDEN, HIDDEN, LAYERS, BASE_ROWS),
    "gate_up": (2 * INTERMEDIATE, HIDDEN, LAYERS, BASE_ROWS),
    "down": (HIDDEN, INTERMEDIATE, LAYERS, BASE_ROWS),
    "lm_head": (VOCAB, HIDDEN, 1, HEAD_ROWS),
}


def shape_table(dtype: torch.dtype, out: int, inp: int, rows: tuple[int, ...], reps: int) -> dict:
    """One shape's table: seconds per GEMM by kind and rows, scores, the winner."""
    gen = torch.Generator().manual_seed(out * 7 + inp)
    weight = (torch.randn(out, inp, generator=gen) / inp**0.5).to(dtype)
    kinds = runnable_kinds(weight)
    with torch.inference_mode():
        table = chooser.measure(gemm_candidates(weight, kinds), rows, reps=reps)
    invariant = {kind: row_invariant(weight, kind, rows) for kind in table}
    # as the engine chooses: fp32 among row-invariant kinds, bf16 among all
    allowed = [k for k in table if invariant[k] or dtype != torch.float32] or list(table)
    return {
        "table": table,
        "scores": chooser.scores(table),
        "row_invariant": invariant,
        "winner": chooser.pick(table, allowed=allowed),
    }


def model_pass(shapes: dict[str, dict], counts: dict[str, int]) -> dict[str, dict[int, float]]:
    """Seconds of all of a model's GEMMs at each row count, per fixed kind and as chosen (a kind
    missing for some shape is left out; rows a shape never sees count nothing)."""
    kinds = set.intersection(*(set(s["table"]) for s in shapes.values()))
    rows = sorted({m for s in shapes.values() for t in s["table"].values() for m in t})
    out: dict[str, dict[int, float]] = {}
    for kind in [*sorted(kinds), "chosen"]:
        out[kind] = {}
        for m in rows:
            total = 0.0
            for name, s in shapes.items():
                times = s["table"][s["winner"] if kind == "chosen" else kind]
                total += counts[name] * times.get(m, 0.0)
            out[kind][m] = total
    return out


def run(dtypes: list[str], reps: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    counts = {name: count for name, (_, _, count, _) in SHAPES.items()}
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        shapes = {}
        for name, (out, inp, _, rows) in SHAPES.items():
            shapes[name] = shape_table(dtype, out, inp, rows, reps)
            varies = [k for k, ok in shapes[name]["row_invariant"].items() if not ok]
            note = f"; not row-invariant: {', '.join(varies)}" if varies else ""
            title = f"{dtype_name} {name} [{out}x{inp}] (us per GEMM by rows{note})"
            print(chooser.format_table(title, shapes[name]["table"], shapes[name]["winner"]))
        totals = model_pass(shapes, counts)
        print(f"{dtype_name}: all GEMMs of a decode pass, ms by rows (head at decode rows only)")
        rows = sorted(next(iter(totals.values())))
        print("  " + f"{'kind':<10}" + "".join(f"{m:>10}" for m in rows))
        for kind, by_rows in totals.items():
            print("  " + f"{kind:<10}" + "".join(f"{by_rows[m] * 1e3:>10.2f}" for m in rows))
        results[dtype_name] = {"shapes": shapes, "model_pass_seconds": totals}
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/cpu_gemm.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {
        "cpu": machine_info(),
        "threads": args.threads,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "model": "SmolLM2-135M shapes, random weights",
        "dtypes": run(args.dtypes, args.reps),
    }
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
