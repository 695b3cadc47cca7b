"""Paged decode attention vs attention over a contiguous (static-row) cache, per layer call.

SmolLM2-135M's attention shape (9 query / 3 KV heads, head dim 64), blocks of 16, batches of
1/8/32 at uniform and mixed context lengths up to 1.5k. Paths timed on the same K/V:
- `paged`: `molora_runtime.model.paged_decode.paged_decode_tables` (CPU: gather + two bmm; CUDA:
  the Triton kernel);
- `contig_sdpa`: today's gathered-rows decode (`rows[:, :, :len]` + masked SDPA, GQA);
- `contig_span`: today's CPU span decode (row views, no gather, two bmm) — the engine's
  current CPU decode attention.

    python -m benchmarks.paged_attention [--device cuda] [--threads 1] [--quick]
        [--max-seconds S] [--out FILE]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.report import write_json
from kernels.paged_inputs import PagedDecodeInputs
from molora_runtime.model.paged_decode import paged_decode_tables

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def _lens(batch: int, ctx: int, mixed: bool) -> list[int]:
    if not mixed:
        return [ctx] * batch
    g = torch.Generator().manual_seed(batch * 7919 + ctx)
    return torch.randint(max(1, ctx // 20), ctx + 1, (batch,), generator=g).tolist()


def _problem(lens: list[int], dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    B, max_len = len(lens), max(lens)
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(B, KV_HEADS, max_len, HEAD_DIM, generator=g).to(dtype)  # contiguous
    v_rows = torch.randn(B, KV_HEADS, max_len, HEAD_DIM, generator=g).to(dtype)
    width = -(-max_len // BLOCK)
    num_blocks = B * width + 1
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(B, width, dtype=torch.int32)
    k_cache = torch.zeros(num_blocks, KV_HEADS, BLOCK, HEAD_DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    at = 0
    for b, n in enumerate(lens):
        nb = -(-n // BLOCK)
        ids = perm[at : at + nb]
        at += nb
        tables[b, :nb] = ids.int()
        pad = nb * BLOCK - n
        k_b = F.pad(rows[b, :, :n], (0, 0, 0, pad)).view(KV_HEADS, nb, BLOCK, HEAD_DIM)
        v_b = F.pad(v_rows[b, :, :n], (0, 0, 0, pad)).view(KV_HEADS, nb, BLOCK, HEAD_DIM)
        k_cache[ids] = k_b.transpose(0, 1)
        v_cache[ids] = v_b.transpose(0, 1)
    q = torch.randn(B, HEADS, HEAD_DIM, generator=g).to(dtype)
    return {
        k: t.to(device) if isinstance(t, torch.Tensor) else t
        for k, t in dict(
            q=q, rows=rows, v_rows=v_rows, k_cache=k_cache, v_cache=v_cache, tables=tables,
            lens=torch.tensor(lens, dtype=torch.int32), max_len=max_len,
        ).items()
    }  # fmt: skip


def _contig_sdpa(p: dict[str, Any], scale: float) -> torch.Tensor:
    L = p["max_len"]
    mask = (torch.arange(L, device=p["q"].device)[None, :] < p["lens"][:, None])[:, None, None]
    ks, vs = p["rows"][:, :, :L], p["v_rows"][:, :, :L]
    o = F.scaled_dot_product_attention(
        p["q"].unsqueeze(2), ks, vs, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return o.squeeze(2)


def _contig_span(p: dict[str, Any], scale: float) -> torch.Tensor:
    L, q = p["max_len"], p["q"]
    B, H, D = q.shape
    g = H // KV_HEADS
    ks = p["rows"][:, :, :L].reshape(B * KV_HEADS, L, D)
    vs = p["v_rows"][:, :, :L].reshape(B * KV_HEADS, L, D)
    scores = torch.bmm(q.reshape(B * KV_HEADS, g, D), ks.transpose(1, 2)).float()
    valid = torch.arange(L, device=q.device)[None, :] < p["lens"][:, None]
    bias = torch.zeros(B, L, device=q.device).masked_fill_(~valid, float("-inf"))
    scores = scores.view(B, KV_HEADS, g, L).mul_(scale).add_(bias[:, None, None])
    probs = torch.softmax(scores, dim=-1).to(vs.dtype).view(B * KV_HEADS, g, L)
    return torch.bmm(probs, vs).view(B, H, D)


def _paged(p: dict[str, Any], scale: float) -> torch.Tensor:
    inputs = PagedDecodeInputs(p["q"], p["k_cache"], p["v_cache"], p["tables"], p["lens"], scale)
    return paged_decode_tables(inputs)


PATHS: dict[str, Callable[[dict[str, Any], float], torch.Tensor]] = {
    "paged": _paged,
    "contig_sdpa": _contig_sdpa,
    "contig_span": _contig_span,
}


def _time(fn: Callable[[], torch.Tensor], device: torch.device, reps: int) -> float:
    """Fastest of `reps` calls in microseconds: on a shared CPU box the minimum is the stable
    statistic (others' load only ever adds time)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e6


def run(
    device: torch.device, quick: bool, reps: int, max_seconds: float = float("inf")
) -> list[dict[str, Any]]:
    """Every case of the grid, or those measured before `max_seconds` ran out."""
    scale = HEAD_DIM**-0.5
    start = time.perf_counter()
    batches = (1, 32) if quick else (1, 8, 32)
    contexts = (512, 1500) if quick else (128, 512, 1500)
    dtypes = (torch.bfloat16,) if quick else (torch.float32, torch.bfloat16)
    rows = []
    for dtype in dtypes:
        for batch in batches:
            for ctx in contexts:
                for mixed in (False, True):
                    if time.perf_counter() - start > max_seconds:
                        print(f"stopping early after {max_seconds:.0f}s", flush=True)
                        return rows
                    p = _problem(_lens(batch, ctx, mixed), dtype, device)
                    want = _contig_span(p, scale).float()
                    entry: dict[str, Any] = {
                        "dtype": str(dtype).removeprefix("torch."), "batch": batch,
                        "max_context": ctx, "lengths": "mixed" if mixed else "uniform",
                        "context_tokens": int(p["lens"].sum()),
                    }  # fmt: skip
                    for name, fn in PATHS.items():
                        got = fn(p, scale).float()
                        err = float((got - want).abs().max())
                        assert err < 0.1, f"{name} disagrees with contig_span by {err}"
                        entry[f"{name}_us"] = round(
                            _time(lambda f=fn, p=p: f(p, scale), device, reps)
                        )
                    # bytes the paged path must read: each sequence's real K and V once
                    kv_bytes = entry["context_tokens"] * KV_HEADS * HEAD_DIM * 2 * p["q"].itemsize
                    entry["paged_gbps"] = round(kv_bytes / (entry["paged_us"] * 1e3), 1)
                    entry["paged_vs_span"] = round(entry["paged_us"] / entry["contig_span_us"], 2)
                    entry["paged_vs_sdpa"] = round(entry["paged_us"] / entry["contig_sdpa_us"], 2)
                    rows.append(entry)
                    print(
                        f"{entry['dtype']:>8} b={batch:<3} ctx={ctx:<5} {entry['lengths']:<8} "
                        f"paged {entry['paged_us']:>7} us  sdpa {entry['contig_sdpa_us']:>7} us  "
                        f"span {entry['contig_span_us']:>7} us  paged/span "
                        f"{entry['paged_vs_span']:.2f}",
                        flush=True,
                    )
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Headline numbers: the paged path's cost over each contiguous baseline (median and worst
    row) and its best achieved K/V read bandwidth at the largest batch."""
    if not rows:
        return {}
    out: dict[str, Any] = {}
    for key in ("paged_vs_span", "paged_vs_sdpa"):
        ratios = sorted(r[key] for r in rows)
        out[key] = {"median": ratios[len(ratios) // 2], "worst": ratios[-1]}
    top = max(r["batch"] for r in rows)
    out[f"paged_gbps_best_b{top}"] = max(r["paged_gbps"] for r in rows if r["batch"] == top)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="CPU intra-op threads")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--max-seconds", type=float, default=float("inf"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    with torch.inference_mode():
        rows = run(device, args.quick, args.reps, args.max_seconds)
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "threads": args.threads,
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK},
        "summary": summarize(rows),
        "rows": rows,
    }
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
