"""Rounds of a side-by-side benchmark: alternating order, best round per cell, per-round ratios,
greedy-text agreement between the two servers, and the summary table."""

from __future__ import annotations

from typing import Any

from benchmarks.workload import ADAPTERS


def adapters_applied(texts: dict[str, list[str]]) -> list[str]:
    """The adapters whose greedy texts differ from the base model's, both answered without an
    error (an adapter that failed changed nothing)."""
    failed = {m for m, ts in texts.items() if any(t.startswith("ERROR") for t in ts)}
    return [a for a in ADAPTERS if texts[a] != texts["base"] and not failed & {a, "base"}]


def agreement(run: dict[str, Any]) -> dict[str, Any] | None:
    """Which (model, prompt) greedy texts MoLoRA and vLLM produced identically."""
    ours = run.get("molora", {}).get("sanity", {}).get("texts")
    theirs = run.get("vllm", {}).get("sanity", {}).get("texts")
    if not ours or not theirs:
        return None
    same, total = [], 0
    for model, texts in ours.items():
        for i, text in enumerate(texts):
            total += 1
            peer = theirs.get(model, [])
            if i < len(peer) and peer[i] == text and not text.startswith("ERROR"):
                same.append(f"{model}/{i}")
    return {"identical": len(same), "of": total, "which": same}


def round_order(round_no: int, skip_vllm: bool, skip_offline: bool) -> list[str]:
    """vLLM, MoLoRA, offline in even rounds and the reverse in odd ones (ABC then CBA): the box's
    speed drifts over minutes, and a fixed order would hand the drift to whoever runs last."""
    order = [s for s, skip in (("vllm", skip_vllm), ("molora", False), ("offline", skip_offline))
             if not skip]  # fmt: skip
    return order if round_no % 2 == 0 else order[::-1]


def per_round_ratios(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Each cell's MoLoRA ÷ vLLM and MoLoRA ÷ offline within one round (one window of the box's
    drift), beside the best-of-rounds table that pairs each side's best window."""
    rows = []
    for k, ours in enumerate(run.get("molora", {}).get("rounds", [])):
        others = {}
        for server in ("vllm", "offline"):
            rounds = run.get(server, {}).get("rounds", [])
            if k < len(rounds):
                others[server] = {(r["mode"], r["concurrency"]): r for r in rounds[k]}
        for row in ours:
            key = (row["mode"], row["concurrency"])
            out: dict[str, Any] = {"round": k, "mode": key[0], "concurrency": key[1]}
            for server, label in (("vllm", "vs_vllm"), ("offline", "kept")):
                other = others.get(server, {}).get(key)
                if other and other["tok_per_s"]:
                    out[label] = round(row["tok_per_s"] / other["tok_per_s"], 2)
            rows.append(out)
    return rows


def best_of_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each cell's best round by tok/s (in first-round order). The box's speed drifts over
    minutes, so each server gets its cells in alternating windows, each judged at its best."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for cells in rounds:
        for row in cells:
            key = (row["mode"], row["concurrency"])
            if key not in best or row["tok_per_s"] > best[key]["tok_per_s"]:
                best[key] = row
    return list(best.values())


def summarize(runs: dict[str, Any]) -> list[str]:
    lines = [
        "| dtype | mode | c | vLLM tok/s | MoLoRA tok/s | ratio | offline tok/s | kept | "
        "TTFT p50 v/m ms | ITL p99 v/m ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dtype, run in runs.items():
        vllm = {(r["mode"], r["concurrency"]): r for r in run.get("vllm", {}).get("cells", [])}
        offline = {
            (r["mode"], r["concurrency"]): r for r in run.get("offline", {}).get("cells", [])
        }
        for r in run["molora"]["cells"]:
            v = vllm.get((r["mode"], r["concurrency"]))
            o = offline.get((r["mode"], r["concurrency"]))
            ratio = f"{r['tok_per_s'] / v['tok_per_s']:.2f}" if v and v["tok_per_s"] else "-"
            kept = f"{r['tok_per_s'] / o['tok_per_s']:.2f}" if o and o["tok_per_s"] else "-"
            lines.append(
                f"| {dtype} | {r['mode']} | {r['concurrency']} | "
                f"{v['tok_per_s'] if v else '-'} | {r['tok_per_s']} | {ratio} | "
                f"{o['tok_per_s'] if o else '-'} | {kept} | "
                f"{v['ttft_p50_ms'] if v else '-'}/{r['ttft_p50_ms']} | "
                f"{v['itl_p99_ms'] if v else '-'}/{r['itl_p99_ms']} |"
            )
    return lines
