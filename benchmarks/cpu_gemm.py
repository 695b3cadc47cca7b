"""A decode step's base GEMMs on CPU, kernel by kernel: the panel GEMM against oneDNN and plain.

Every base projection of a SmolLM2-135M-shaped model (30 layers of fused q/k/v, o, fused
gate/up and down; random weights, 425 MB in fp32) is multiplied by the same `M`-row activation,
one weight after another, so each pass streams all weights from DRAM as a decode step does.
The variants run interleaved within each repetition (the box's drift hits them all alike) and
the table gives each one's median pass time, its effective weight bandwidth and its speed
relative to oneDNN's packed fp32 kernel, the engine's path before the panel GEMM:

- `plain_fp32` / `plain_bf16`: `F.linear` on the row-major weight (oneDNN reorders per call);
- `onednn_fp32`: `F.linear` through oneDNN's weight packed once (`packed_linear.pack_onednn`);
- `panel_fp32`, `panel_bf16`: `kernels.cpu_panel_gemm` on fp32 / bf16 panels, fp32 input
  (`panel_bf16_x16`: bf16 input and output, as a bf16 model calls it).

    python -m benchmarks.cpu_gemm [--rows 1 8 32 256] [--reps 9] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

from benchmarks.report import write_json
from kernels import cpu_panel_gemm
from molora_runtime.model.packed_linear import pack_onednn, packed_gemm

HIDDEN, INTERMEDIATE, LAYERS = 576, 1536, 30
QKV_OUT = HIDDEN + 2 * 192  # 9 query heads and 3 KV heads of 64
SHAPES = [(QKV_OUT, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
BASELINE = "onednn_fp32"


def _variants() -> dict[str, tuple[list[Any], torch.dtype, Callable[[torch.Tensor, Any], Any]]]:
    """name -> (one operand per weight, input dtype, GEMM of an input and an operand)."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) / k**0.5 for _ in range(LAYERS) for n, k in SHAPES]
    out: dict[str, tuple[list[Any], torch.dtype, Callable[[torch.Tensor, Any], Any]]] = {
        "plain_fp32": (weights, torch.float32, F.linear),
        "plain_bf16": ([w.bfloat16() for w in weights], torch.bfloat16, F.linear),
    }
    onednn = [pack_onednn(w) for w in weights]
    if all(p is not None for p in onednn):
        out[BASELINE] = (onednn, torch.float32, packed_gemm)
    if cpu_panel_gemm.available():
        bf16_panels = [cpu_panel_gemm.pack(w.bfloat16()) for w in weights]
        out["panel_fp32"] = ([cpu_panel_gemm.pack(w) for w in weights], torch.float32, packed_gemm)
        out["panel_bf16"] = (bf16_panels, torch.float32, packed_gemm)
        out["panel_bf16_x16"] = (bf16_panels, torch.bfloat16, packed_gemm)
    return out


def run(rows: list[int], reps: int) -> list[dict[str, Any]]:
    variants = _variants()
    fp32_bytes = sum(w.numel() * 4 for w in variants["plain_fp32"][0])
    results = []
    for m in rows:
        inputs = {k: torch.randn(m, k) for k in (HIDDEN, INTERMEDIATE)}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for rep in range(reps + 1):  # the first repetition warms every path up, untimed
            for name, (operands, dtype, gemm) in variants.items():
                xs = {k: v.to(dtype) for k, v in inputs.items()}
                start = time.perf_counter()
                for (_, k), op in zip(SHAPES * LAYERS, operands, strict=True):
                    gemm(xs[k], op)
                if rep:
                    times[name].append(time.perf_counter() - start)
        base = statistics.median(times[BASELINE]) if BASELINE in times else None
        for name, samples in times.items():
            ms = statistics.median(samples) * 1e3
            dtype_bytes = 2 if "bf16" in name else 4
            row = {
                "rows": m,
                "variant": name,
                "ms": round(ms, 2),
                "weight_gbps": round(fp32_bytes * dtype_bytes / 4 / (ms * 1e6), 1),
                "speedup_vs_onednn_fp32": round(base * 1e3 / ms, 2) if base else None,
            }
            results.append(row)
            print(
                f"M={m:<4} {name:<15} {row['ms']:>8.2f} ms  {row['weight_gbps']:>5.1f} GB/s  "
                f"x{row['speedup_vs_onednn_fp32']} vs {BASELINE}",
                flush=True,
            )
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        rows = run(args.rows, args.reps)
    result = {
        "threads": args.threads,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "model": "SmolLM2-135M shapes, 30 layers, random weights",
        "rows": rows,
    }
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
