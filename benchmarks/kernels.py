"""Routed-LoRA kernel benchmark: every variant over a shape grid; prints a table, writes JSON.

    python -m benchmarks.kernels              # CUDA if present: Triton kernels + references
    python -m benchmarks.kernels --quick      # reduced grid (the CPU run that justifies the
                                              # dispatcher's thresholds takes a few minutes)
    python -m benchmarks.kernels --device cpu --dry-run   # the GPU code path, tiny, to a temp dir

Two times per variant and shape. `graph_device_us`: device time per call inside a captured CUDA
graph (the calls captured back to back, replayed many times between CUDA events, divided by the
calls), each call on its own copy of the weights and activations so a replay reads HBM, not a
warm L2 — the kernel's cost in a captured decode step, free of launch latency. `eager_wall_us`:
host wall time of one eager call, synchronised before and after — what an uncaptured caller
pays, launch included. On a CPU only the eager figure exists. `basis` says which figure the
derived columns use (the graph one where there is one); the HBM fraction (`bw_frac`) is computed
from the graph figure only. Derived: achieved GB/s and TFLOP/s (and their share of the device
peak), the speed-up over the best PyTorch reference, the LoRA cost relative to the base
projection x Wᵀ, and the speed-up of one per-token pass (base + routed LoRA) over S
per-sequence passes (base + one adapter, once per adapter) — the comparison the MoLoRA paper
reports as 4.1× at 4 adapters, 2048 tokens, d=4096.

Bytes are the minimum traffic: x, y, routing, and A/B of the slots the batch actually uses
(read once). Flops count only the used (token, j) pairs. Buffers hold S adapters plus the
all-zero slot 0; tokens pick k distinct adapters uniformly.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.gpu_bench import DeviceClock, gpu_busy, hbm_peak, provenance, use_repo_caches
from benchmarks.report import RESULTS_DIR, write_json
from kernels.reference import REFERENCE_VARIANTS

# Dense 16-bit tensor FLOP/s from the vendors' datasheets (SXM parts); HBM peaks live in
# benchmarks.gpu_bench (a datasheet table, else a measured copy).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
REFERENCES = ("segmented", "gather")
GATHER_MAX_BYTES = 1 << 30  # gather+bmm materialises [T, k, r, d] weight copies
# Variants whose every call syncs with the host cannot be captured; they get no graph figure.
NOT_CAPTURABLE = {"ref:segmented": "not capturable: host sync per call (.tolist() of slots)"}
# L2 rotation: enough copies of a problem that consecutive calls in one graph miss L2 (2x its
# size), at most this many copies and this many bytes of them; at least this many calls per
# graph, so the replay's own launch is amortised.
MAX_COPIES, MAX_COPY_BYTES, MIN_GRAPH_CALLS = 128, 1 << 30, 8
DRY_RUN_L2_BYTES = 64 << 10  # a CPU dry run still exercises the rotation


@dataclass(frozen=True)
class Timing:
    """Seconds per call: eager wall time, and device time in a CUDA graph (None: no graph,
    `note` says why)."""

    eager: float
    graph: float | None = None
    note: str | None = None


def clock_of(*parts: Timing) -> tuple[Callable[[Timing], float], str]:
    """The graph figure when every part has one, else the eager one, and its name, so a ratio
    or a sum never mixes the two clocks."""
    if all(t.graph is not None for t in parts):
        return (lambda t: t.graph or 0.0), "graph_device"
    return (lambda t: t.eager), "eager_wall"


def grid(device: str, quick: bool, dry_run: bool = False) -> list[dict]:
    """Shapes: T tokens, d = d_in = d_out, r rank, S adapters, k adapters per token."""
    if dry_run:  # seconds on a CPU: the code path, not the numbers
        return [{"T": t, "d": 64, "r": 8, "S": 4, "k": 2} for t in (1, 8)]
    if device == "cpu":
        ts = [1, 4, 16, 32, 64, 128, 512] if quick else [1, 4, 16, 32, 64, 128, 512, 2048]
        ds = [1024] if quick else [576, 1024, 2048]
        rs = [16] if quick else [8, 16, 64]
        sk = [(4, 1), (4, 2), (32, 2)]
    else:
        ts = [1, 8, 32, 64, 128, 512, 2048, 4096]
        ds = [576, 2048] if quick else [576, 2048, 4096]
        rs = [16] if quick else [8, 16, 64]
        sk = [(4, 1), (32, 2)] if quick else [(4, 1), (4, 2), (32, 1), (32, 2)]
    shapes = [
        {"T": t, "d": d, "r": r, "S": s, "k": k} for d in ds for r in rs for s, k in sk for t in ts
    ]
    # The shapes the issue's targets read go first, so a run stopped at --max-seconds has them.
    return sorted(shapes, key=lambda sh: not _target_shape(sh)) if device == "cuda" else shapes


def _target_shape(shape: dict) -> bool:
    """Per-token vs per-sequence at 2,048 tokens d=4,096 (4 adapters); decode at T=32/64."""
    paper = (shape["T"], shape["d"], shape["S"], shape["r"]) == (2048, 4096, 4, 16)
    decode = shape["T"] in (32, 64) and shape["d"] == 4096 and shape["r"] == 16
    return paper or decode


def timer(device: str, budget_s: float) -> Callable[[Callable[[], object]], float]:
    """Eager wall seconds of one call of fn, over repeats that fill about `budget_s` (after one
    warm-up). On CUDA the device is synchronised before and after each call, so the figure is
    launch + kernel + sync: what an uncaptured caller waits.

    GPU: the median. CPU: the minimum, because the dev box's cores are shared and contention
    only ever adds time.
    """
    cuda = device == "cuda"

    def measure(fn: Callable[[], object]) -> float:
        fn()
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 200):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) if cuda else min(times)

    return measure


def graph_timer(
    device: str, budget_s: float, capture: bool
) -> Callable[[list[Callable[[], object]]], float]:
    """Device seconds per call of `fns` (one per problem copy, repeated to MIN_GRAPH_CALLS)
    captured back to back into one CUDA graph and replayed between CUDA events; the median
    over replays filling about `budget_s`.

    `capture=False` (a CPU dry run) runs the same calls in a Python loop on the host clock, so
    everything but the capture itself is exercised off the GPU.
    """
    dev = torch.device(device)
    clock = DeviceClock(dev)

    def measure(fns: list[Callable[[], object]]) -> float:
        calls = fns * max(1, -(-MIN_GRAPH_CALLS // len(fns)))
        if capture:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # JIT, autotune and allocator warm-up off the graph
                for fn in fns:
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for fn in calls:
                    fn()
            replay: Callable[[], object] = graph.replay
        else:

            def replay() -> None:
                for fn in calls:
                    fn()

        replay()  # the first replay uploads the graph
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 100):
            gpu_busy(dev)
            begin = clock.mark()
            replay()
            times.append(clock.seconds(begin, clock.mark()) / len(calls))
        return statistics.median(times) if capture else min(times)

    return measure


def problem(shape: dict, dtype: torch.dtype, device: str, seed: int = 0) -> dict:
    """Hot-set views (layer 1 of a 2-layer buffer, as the engine passes them) and routing."""
    T, d, r, S, k = shape["T"], shape["d"], shape["r"], shape["S"], shape["k"]
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g, device=device)

    a_buf = (randn(S + 1, 2, r, d) / d**0.5).to(dtype)
    b_buf = (randn(S + 1, 2, d, r) / r**0.5).to(dtype)
    a_buf[0].zero_()
    b_buf[0].zero_()
    ids = torch.rand(T, S, generator=g, device=device).argsort(dim=1)[:, :k] + 1
    return _with_views(
        {
            "x": randn(T, d).to(dtype),
            "W": (randn(d, d) / d**0.5).to(dtype),
            "a_buf": a_buf,
            "b_buf": b_buf,
            "ids": ids,
            "w": torch.softmax(randn(T, k), -1),
        }
    )


def _with_views(p: dict) -> dict:
    a_buf, b_buf = p["a_buf"], p["b_buf"]
    qkv = [(a_buf[:, i], b_buf[:, i]) for i in (0, 1, 1)]
    return {**p, "A": a_buf[:, 1], "B": b_buf[:, 1], "qkv": qkv}


def rotation(p: dict, l2_bytes: int) -> list[dict]:
    """`p` and clones of its activations and weights (the routing shared, as in a decode step
    where every layer reads the same table), enough that a graph cycling through them reads
    each from HBM: the weights of a real step's next layer are never in L2 either."""
    nbytes = sum(p[k].numel() * p[k].element_size() for k in ("x", "W", "a_buf", "b_buf"))
    copies = min(MAX_COPIES, max(1, MAX_COPY_BYTES // nbytes), math.ceil(2 * l2_bytes / nbytes))
    clones = [
        _with_views({**p, **{k: p[k].clone() for k in ("x", "W", "a_buf", "b_buf")}})
        for _ in range(max(0, copies - 1))
    ]
    return [p, *clones]


def traffic(shape: dict, p: dict, elem: int) -> tuple[float, float]:
    """(minimum bytes, useful flops) of one routed-LoRA call."""
    T, d, r, k = shape["T"], shape["d"], shape["r"], shape["k"]
    used = int(torch.unique(p["ids"]).numel())
    nbytes = 2 * T * d * elem + used * 2 * r * d * elem + T * k * 8
    return float(nbytes), float(2 * T * k * r * 2 * d)


def variants(device: str, p: dict, shape: dict, elem: int) -> dict[str, Callable[[], object]]:
    x, A, B, ids, w = p["x"], p["A"], p["B"], p["ids"], p["w"]
    fns: dict[str, Callable[[], object]] = {}
    for name in REFERENCES:
        gather_bytes = shape["T"] * shape["k"] * shape["r"] * 2 * shape["d"] * 4
        if name == "gather" and gather_bytes > GATHER_MAX_BYTES:
            continue
        fn = REFERENCE_VARIANTS[name]
        fns[f"ref:{name}"] = lambda fn=fn: fn(x, A, B, ids, w)
    if device == "cuda":
        # triton: the optional `kernels` extra, present only beside a GPU
        from kernels.triton_ops import routed_lora_multi_triton, routed_lora_triton

        for mode in ("auto", "bgmv", "sgmv"):
            fns[f"triton:{mode}"] = lambda m=mode: routed_lora_triton(x, A, B, ids, w, mode=m)
        fns["triton:qkv_fused"] = lambda: routed_lora_multi_triton(x, p["qkv"], ids, w)
        fns["triton:qkv_separate"] = lambda: [
            routed_lora_triton(x, a, b, ids, w) for a, b in p["qkv"]
        ]
    return fns


def single_adapter_fn(device: str, p: dict) -> Callable[[], object]:
    """One per-sequence pass's LoRA: every token on one adapter, best implementation."""
    x, A, B = p["x"], p["A"], p["B"]
    if device == "cuda":
        # triton: the optional `kernels` extra, present only beside a GPU
        from kernels.triton_ops import routed_lora_triton

        ids = torch.ones(x.shape[0], 1, dtype=torch.int32, device=x.device)
        w = torch.ones(x.shape[0], 1, device=x.device)
        return lambda: routed_lora_triton(x, A, B, ids, w)
    return lambda: (x @ A[1].t()) @ B[1].t()


def run(
    device: str,
    dtype: torch.dtype,
    quick: bool,
    budget_s: float,
    max_seconds: float,
    dry_run: bool = False,
    peak_bw: float | None = None,
) -> dict:
    dev = torch.device(device)
    eager = timer(device, budget_s)
    graphed = device == "cuda" or dry_run
    in_graph = graph_timer(device, budget_s, capture=device == "cuda") if graphed else None
    started = time.perf_counter()
    truncated = False
    elem = torch.finfo(dtype).bits // 8
    prov = provenance(dev)
    peak = hbm_peak(dev, peak_bw)
    peak_bw = peak.bytes_per_s
    peak_flops = next((v for k, v in PEAK_FLOPS.items() if k in prov.device_name), None)
    props = torch.cuda.get_device_properties(dev) if device == "cuda" else None
    l2 = getattr(props, "L2_cache_size", 0) or (50 << 20 if props else DRY_RUN_L2_BYTES)
    rows = []
    for shape in grid(device, quick, dry_run):
        if time.perf_counter() - started > max_seconds:
            truncated = True
            break
        p = problem(shape, dtype, device)
        copies = rotation(p, l2) if in_graph else [p]
        nbytes, flops = traffic(shape, p, elem)

        def timed(name: str, fns: list[Callable[[], object]]) -> Timing:
            if in_graph is None:
                return Timing(eager(fns[0]))
            if name in NOT_CAPTURABLE:
                return Timing(eager(fns[0]), note=NOT_CAPTURABLE[name])
            try:
                graph_s = in_graph(fns)
            except Exception as exc:  # recorded in the row, never silently dropped
                return Timing(eager(fns[0]), note=f"capture failed: {exc!r}"[:300])
            return Timing(eager(fns[0]), graph_s)

        base = timed("base", [lambda c=c: c["x"] @ c["W"].t() for c in copies])
        single = timed("single", [single_adapter_fn(device, c) for c in copies])
        per_copy = [variants(device, c, shape, elem) for c in copies]
        times = {n: timed(n, [v[n] for v in per_copy]) for n in per_copy[0]}
        del per_copy, copies
        refs = [t for n, t in times.items() if n.startswith("ref:")]
        routed = times.get("triton:auto") or min(refs, key=lambda t: t.eager)
        pick, pass_basis = clock_of(base, single, routed)
        per_sequence = shape["S"] * (pick(base) + pick(single))
        per_token = pick(base) + pick(routed)
        for variant, t in times.items():
            own, basis = clock_of(t)
            # against the fastest reference on the variant's clock (segmented has no graph one)
            graph_refs = [r.graph for r in refs if r.graph is not None]
            if t.graph is not None and graph_refs:
                vs_best_ref = min(graph_refs) / t.graph
            else:
                vs_best_ref = min(r.eager for r in refs) / t.eager
            base_clock, _ = clock_of(t, base)
            rows.append(
                {
                    **shape,
                    "variant": variant,
                    "graph_device_us": t.graph * 1e6 if t.graph is not None else None,
                    "eager_wall_us": t.eager * 1e6,
                    "graph_note": t.note,
                    "basis": basis,
                    "basis_us": own(t) * 1e6,
                    "gbps": nbytes / own(t) / 1e9,
                    "tflops": flops / own(t) / 1e12,
                    "bw_frac": nbytes / t.graph / peak_bw if t.graph and peak_bw else None,
                    "flops_frac": flops / t.graph / peak_flops if t.graph and peak_flops else None,
                    "vs_best_ref": vs_best_ref,
                    "vs_base_matmul": base_clock(t) / base_clock(base),
                    "base_graph_device_us": base.graph * 1e6 if base.graph else None,
                    "base_eager_wall_us": base.eager * 1e6,
                    "per_sequence_us": per_sequence * 1e6,
                    "per_token_us": per_token * 1e6,
                    "per_token_speedup": per_sequence / per_token,
                    "per_token_basis": pass_basis,
                }
            )
        print(".", end="", flush=True, file=sys.stderr)
    print(file=sys.stderr)
    return {
        **prov.model_dump(),
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "quick": quick,
        "dry_run": dry_run,
        "truncated_at_max_seconds": truncated,
        "threads": torch.get_num_threads(),
        "timing": {
            "graph_device_us": "device time per call in a captured CUDA graph (CUDA events "
            "around replays of back-to-back calls over L2-rotated copies, / calls)"
            if device == "cuda"
            else "dry run on a CPU: the same calls looped, host clock (no capture)"
            if dry_run
            else "absent on a CPU",
            "eager_wall_us": "host wall time of one eager call, synchronised before and after",
            "bw_frac": "bytes / graph_device_us / peak_bytes_per_s (graph figure only)",
        },
        "l2_bytes": l2,
        "peak_bytes_per_s": peak_bw,
        "peak_source": peak.source,
        "measured_copy_bytes_per_s": peak.measured_copy_bytes_per_s,
        "peak_flops": peak_flops,
        "rows": rows,
        "best_reference_by_T": best_by_t(rows),
        "targets": targets(rows) if graphed else {},
    }


def best_by_t(rows: list[dict]) -> dict[str, dict[str, int]]:
    """For each T, how many shapes each reference variant won on eager wall time (justifies
    the CPU dispatch, which runs them eagerly)."""
    wins: dict[str, dict[str, int]] = {}
    keys = {(r["T"], r["d"], r["r"], r["S"], r["k"]) for r in rows}
    for key in sorted(keys):
        refs = [r for r in rows if (r["T"], r["d"], r["r"], r["S"], r["k"]) == key]
        refs = [r for r in refs if r["variant"].startswith("ref:")]
        best = min(refs, key=lambda r: r["eager_wall_us"])["variant"]
        bucket = wins.setdefault(str(key[0]), {})
        bucket[best] = bucket.get(best, 0) + 1
    return wins


def targets(rows: list[dict]) -> dict:
    """The issue's H200 targets, as measured values (never asserted here)."""
    decode = [r for r in rows if r["variant"] == "triton:bgmv" and r["T"] >= 32 and r["bw_frac"]]
    paper = [
        r
        for r in rows
        if r["variant"] == "triton:auto" and (r["T"], r["d"], r["S"]) == (2048, 4096, 4)
    ]
    best_decode = max((r["bw_frac"] for r in decode), default=None)
    speedup = max((r["per_token_speedup"] for r in paper), default=None)
    return {
        "decode_best_bw_frac_at_T_ge_32": best_decode,
        "decode_bw_target_0.70_met": best_decode is not None and best_decode >= 0.70,
        "per_token_vs_4_per_sequence": speedup,
        "per_token_target_3.6_met": speedup is not None and speedup >= 3.6,
    }


def print_table(result: dict) -> None:
    head = f"{'T':>5} {'d':>5} {'r':>3} {'S':>3} {'k':>2}  {'variant':<20} {'graph us':>9} "
    head += f"{'eager us':>9} {'GB/s':>8} {'TFLOP/s':>8} {'%bw':>5} {'xbestref':>8} {'xbase':>7} "
    head += f"{'tok/seq':>7}"
    print(f"routed-LoRA on {result['device_name']} ({result['dtype']})")
    print(head)
    for r in result["rows"]:
        bw = f"{100 * r['bw_frac']:5.1f}" if r["bw_frac"] else "    -"
        graph = (
            f"{r['graph_device_us']:>9.2f}" if r["graph_device_us"] is not None else " " * 8 + "-"
        )
        print(
            f"{r['T']:>5} {r['d']:>5} {r['r']:>3} {r['S']:>3} {r['k']:>2}  {r['variant']:<20} "
            f"{graph} {r['eager_wall_us']:>9.1f} {r['gbps']:>8.2f} {r['tflops']:>8.4f} {bw} "
            f"{r['vs_best_ref']:>8.2f} {r['vs_base_matmul']:>7.2f} {r['per_token_speedup']:>7.2f}"
        )
    print("best reference by T:", json.dumps(result["best_reference_by_T"]))
    if result["targets"]:
        print("targets:", json.dumps(result["targets"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default=None)
    ap.add_argument("--quick", action="store_true", help="reduced shape grid")
    ap.add_argument("--budget", type=float, default=None, help="seconds of repeats per timing")
    ap.add_argument("--max-seconds", type=float, default=1e9, help="stop the grid after this")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    ap.add_argument(
        "--peak-bw", type=float, default=None, help="HBM bytes/s to divide by (default: table)"
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="the same code path on 2 tiny shapes in seconds, written to a temp dir (CPU: the "
        "graph figure is a host-timed loop)",
    )
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: results dir)")
    args = ap.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dry_run and args.out and args.out.resolve().is_relative_to(RESULTS_DIR):
        ap.error("a dry run never writes under benchmarks/results/")
    if device == "cpu":
        torch.set_num_threads(args.threads)
    else:
        use_repo_caches()
    dtype_name = args.dtype or ("bf16" if device == "cuda" else "fp32")
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    budget = args.budget
    if budget is None:
        budget = 0.002 if args.dry_run else 0.01 if device == "cuda" else 0.2
    result = run(device, dtype, args.quick, budget, args.max_seconds, args.dry_run, args.peak_bw)
    print_table(result)
    out = args.out or RESULTS_DIR / f"kernels_{device}{'_quick' if args.quick else ''}.json"
    if args.dry_run and args.out is None:
        out = Path(tempfile.mkdtemp(prefix="kernels_dry_run_")) / f"kernels_{device}.json"
    write_json(out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
