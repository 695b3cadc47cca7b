"""The endpoint a user calls, side by side: MoLoRA `serve run` vs vLLM's own OpenAI server.

Same box, same SmolLM2-135M-Instruct, same 4 PEFT adapters (r=8, alpha 16, all 7 projections),
same streaming chat client over HTTP (short prompts, 64 tokens, `ignore_eos`, temperature 0),
same run. vLLM (`make vllm-env`) computes with its OpenMP threads bound to every core
(`VLLM_CPU_OMP_THREADS_BIND=0-N`); MoLoRA runs one model replica owning every core. Cells:
concurrency 1/8/32 × base, one adapter, 4 adapters (one per request), and for MoLoRA also a
learned top-2 composition over the 4 and a vocabulary route. Per cell: output tok/s, TTFT
p50/p99, inter-token latency p50/p99. Before timing, each server answers 4 prompts greedily
(one request at a time) on the base model and on every adapter: each adapter must change at
least one text (LoRA is really applied), and `greedy_agreement` counts the texts MoLoRA and vLLM
produced identically (the same model, adapters and fp32 greedy decoding should agree). Each
server's thread binding is recorded from its own log / replica stats as evidence. The offline
engine on the same workload and replica layout (`benchmarks.serve_offline`: no Ray, no HTTP) is
the yardstick for what the serving layer keeps ("kept" = endpoint ÷ offline).

    .venv/bin/python -m benchmarks.serve_vs_vllm [--dtypes float32 bfloat16] [--quick] [--rounds 2]

`--rounds N` runs vLLM, MoLoRA and the offline yardstick N times, the order reversed every other
round (ABC CBA ...: the box's speed drifts over minutes, and a fixed order hands the drift to whoever
runs last). The table pairs each side's best round per cell; every round is in the JSON under
`rounds`, and `per_round` gives the ratios within each round's own window.

Writes `benchmarks/results/serve_vs_vllm.json` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import torch
import yaml
from transformers import AutoModelForCausalLM

from benchmarks import serve_offline
from benchmarks.machine import machine_info
from benchmarks.report import write_json
from benchmarks.sse import sse_events
from benchmarks.vllm_env import vllm_cpu_env
from benchmarks.workload import (
    ADAPTERS,
    CELLS,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    NEW_TOKENS,
    PROMPTS,
    TARGETS,
    modes,
)
from molora_runtime.lora.composition import CompositionConfig, save_composition
from molora_runtime.model.arch import load_arch
from molora_runtime.model.model_paths import resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "serve_vs_vllm.json"
VLLM_PORT = 18431
MOLORA_PORT = 18500


# ---- assets ---------------------------------------------------------------------------------


def make_assets(work: Path, model_dir: Path) -> Path:
    """4 random PEFT adapters and a learned top-2 composition, published to a local store."""
    store = work / "store"
    if (store / ".done").is_file():
        return store
    from peft import LoraConfig, get_peft_model

    for i, name in enumerate(ADAPTERS):
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS)
        peft_model = get_peft_model(base, cfg)
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.02)  # non-zero B: each adapter changes the output
        peft_model.save_pretrained(work / "adapters" / name)
    arch = load_arch(model_dir)
    torch.manual_seed(7)
    comp_cfg = CompositionConfig(
        base_model=str(model_dir),  # as the adapters record it (pushed with --base-config)
        adapters=[f"{n}@1" for n in ADAPTERS],
        top_k=2,
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
    )
    gates = torch.randn(arch.num_layers, len(ADAPTERS), arch.hidden_size)
    comp_dir = save_composition(work / "compositions" / "mix4", comp_cfg, gates)
    shutil.rmtree(store, ignore_errors=True)  # a run that stopped half-way published some
    cli = [sys.executable, "-m", "deployments.ops.cli"]
    for name in ADAPTERS:
        subprocess.run(
            [
                *cli,
                "adapters",
                "push",
                str(work / "adapters" / name),
                "--name",
                name,
                "--version",
                "1",
                "--store",
                str(store),
                "--base-config",
                str(model_dir),
            ],
            check=True,
            capture_output=True,
        )
    subprocess.run(
        [
            *cli,
            "compositions",
            "push",
            str(comp_dir),
            "--name",
            "mix4",
            "--version",
            "1",
            "--store",
            str(store),
        ],
        check=True,
        capture_output=True,
    )
    (store / ".done").write_text("ok\n")
    return store


# ---- servers --------------------------------------------------------------------------------


def prepare_assets(work_arg: str | None, prefix: str) -> tuple[Path, Path, Path, int]:
    """(model dir, work folder, adapter store, vocab-route split) of a benchmark run; the work
    folder is `work_arg` (kept between runs) or a new temporary one."""

    model_dir = resolve_model_path("smollm2-135m-instruct")
    work = Path(work_arg or tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    store = make_assets(work, model_dir)
    return model_dir, work, store, load_arch(model_dir).vocab_size // 3


def wait_up(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not answer within {timeout_s} s")


def stop(proc: subprocess.Popen, grace_s: float = 20, linger_s: float = 30) -> None:
    """SIGINT the server's process group (serve run shuts Ray down on it), then SIGKILL; then
    wait for the rest of its session. Ray's workers outlive `serve run` for a while, and an HTTP
    proxy still on the port would answer the next server's health check and then vanish (a
    MoLoRA round right after a MoLoRA round once measured 0 tok/s: connection refused)."""
    if proc.poll() is None:
        for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
    deadline = time.monotonic() + linger_s
    while (left := session_processes(proc, alive_only=True)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for p in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)


def start_vllm(python: Path, model_dir: Path, work: Path, dtype: str, log: Path):
    env = vllm_cpu_env()  # threads bound to every core
    modules = [f"{n}={work / 'adapters' / n}" for n in ADAPTERS]
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(VLLM_PORT), "--served-model-name", "base"]
    cmd += ["--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN)]
    cmd += ["--max-num-seqs", str(MAX_NUM_SEQS), "--enable-lora", "--max-loras", "4"]
    cmd += ["--max-lora-rank", "8", "--lora-modules", *modules]
    out = log.open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=work,
                            start_new_session=True)  # fmt: skip
    wait_up(f"http://127.0.0.1:{VLLM_PORT}/v1/models", proc)
    return proc


def vllm_binding(log: Path) -> list[str]:
    """The lines where vLLM says which cores its OpenMP threads are bound to."""
    lines = log.read_text(errors="replace").splitlines()
    return [ln.strip()[-200:] for ln in lines if re.search(r"core ids|OMP threads|bind", ln)][:6]


def molora_config(store: Path, dtype: str, path: Path) -> Path:
    """serve_config.yaml with the benchmark's limits, on the shipped replica layout (replicas x
    CPUs covering every core; each replica has vLLM's limits: 32 sequences, 4 adapter slots)."""
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    cfg["http_options"]["port"] = MOLORA_PORT
    cfg["logging_config"]["enable_access_log"] = False
    app = cfg["applications"][0]
    args = app["args"]
    args["engine"].update(
        dtype=dtype,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=1024,
        max_queue_len=256,
    )
    args["engine"]["hot_set"] = {"num_slots": 4, "max_rank": 8}
    args["store"] = {"url": str(store)}
    args["served_model_name"] = "base"
    for dep in app["deployments"]:
        if dep["name"] == "ModelReplica":
            dep.pop("autoscaling_config", None)
            dep["max_ongoing_requests"] = MAX_NUM_SEQS + 1  # + the router's stream channel
            dep["max_queued_requests"] = 256
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def start_molora(
    config: Path, log: Path, extra_env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`serve run config` in a session of its own; `extra_env` reaches the cluster it starts
    (Serve's controller reads some settings only from there)."""
    # Ray starts its workers at nice 15 by default; vLLM runs at the caller's priority. Both
    # servers compute at the same priority, else any other process on the box (the client
    # included) takes its CPU from MoLoRA first.
    env = {
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "PYTHONPATH": str(ROOT),
        "RAY_worker_niceness": "0",
        **(extra_env or {}),
    }
    serve = Path(sys.executable).parent / "serve"
    out = log.open("w")
    proc = subprocess.Popen([str(serve), "run", str(config)], env=env, stdout=out,
                            stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)  # fmt: skip
    wait_up(f"http://127.0.0.1:{MOLORA_PORT}/health", proc)
    return proc


def replica_layout() -> dict[str, Any]:
    """The shipped ModelReplica layout the benchmark serves on."""
    app = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]
    dep = next(d for d in app["deployments"] if d["name"] == "ModelReplica")
    return {"num_replicas": dep["num_replicas"], **dep["ray_actor_options"]}


def measure_offline(
    store: Path, dtype: str, cells: list[tuple[int, int]], mode_names: list[str]
) -> list[dict[str, Any]]:
    """The offline engine (no Ray, no HTTP) on the shipped replica layout: the yardstick."""
    layout = replica_layout()
    replicas = int(layout["num_replicas"])
    threads = max(1, round(float(layout.get("num_cpus", 1))))
    return serve_offline.measure(store, dtype, cells, mode_names, replicas, threads)


class SessionProcess(NamedTuple):
    label: str  # "name pid"; a Ray worker is named by its command's first word (ray::...)
    pid: int
    cpu_s: float  # CPU seconds so far
    nice: int


def session_processes(proc: subprocess.Popen, alive_only: bool = False) -> list[SessionProcess]:
    """Every process in the server's session: `serve run`, Ray's daemons and its workers
    (`alive_only`: not the exited ones no parent has reaped yet)."""
    out = []
    tick = os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            fields = text[text.rindex(")") + 2 :].split()
            if int(fields[3]) != proc.pid:  # another session: its command line is not read
                continue
            if alive_only and fields[0] in ("Z", "X"):
                continue
            word = (
                (stat.parent / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
            )
        except OSError:
            continue
        name = (
            word[:60] if word.startswith("ray::") else text[text.index("(") + 1 : text.rindex(")")]
        )
        cpu_s = (int(fields[11]) + int(fields[12])) / tick
        pid = int(stat.parent.name)
        out.append(SessionProcess(f"{name} {pid}", pid, cpu_s, int(fields[16])))
    return out


def priorities(proc: subprocess.Popen) -> dict[str, int]:
    """Nice value of each busy process the server started (its session), as evidence that both
    servers computed at the same priority: {"name pid": nice} for processes with >1 s of CPU."""
    return {p.label: p.nice for p in session_processes(proc) if p.cpu_s > 1}


class CpuMeter:
    """Where a cell's CPU went: each server process's CPU seconds over the cell, and the
    client's own (it shares the box's cores with the server)."""

    def __init__(self, proc: subprocess.Popen | None) -> None:
        self.proc = proc
        self._start: dict[str, float] = {}
        self._client = 0.0
        self.client_s = 0.0  # the benchmark process's CPU over the cell (it is the client)
        self.server_s: dict[str, float] = {}  # "label pid" -> CPU seconds, >= 0.1 s only

    def __enter__(self) -> CpuMeter:
        self._start = self._server()
        self._client = time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.client_s = round(time.process_time() - self._client, 2)
        end = self._server()
        spent = {k: v - self._start.get(k, 0.0) for k, v in end.items()}
        self.server_s = {k: round(v, 2) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])
                         if v >= 0.1}  # fmt: skip

    def _server(self) -> dict[str, float]:
        if self.proc is None:
            return {}
        return {p.label: p.cpu_s for p in session_processes(self.proc)}


def molora_binding(log: Path) -> list[str]:
    lines = log.read_text(errors="replace").splitlines()
    return [ln.strip()[-160:] for ln in lines if "torch threads" in ln][:4]


# ---- client ---------------------------------------------------------------------------------


@dataclass
class Sample:
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    text: str = ""
    error: str | None = None


def request_body(model: str, prompt: str, route: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if route is not None:
        body["molora"] = {"route": route}
    return body


async def one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Sample:
    s = Sample()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                s.error = f"{resp.status_code}: {(await resp.aread())[:200]!r}"
                return s
            async for event in sse_events(resp):
                for choice in event.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        now = time.perf_counter()
                        if s.ttft is None:
                            s.ttft = now - start
                        else:
                            s.itl.append(now - last)
                        last = now
                        s.text += content
                if event.get("usage"):
                    s.tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    return s


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


async def run_cell(port: int, models: list[tuple[str, dict | None]], conc: int, n: int) -> dict:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    limits = httpx.Limits(max_connections=conc + 4, max_keepalive_connections=conc + 4)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        sem = asyncio.Semaphore(conc)

        async def task(i: int) -> Sample:
            model, route = models[i % len(models)]
            async with sem:
                return await one(client, url, request_body(model, PROMPTS[i % 8], route))

        start = time.perf_counter()
        samples = await asyncio.gather(*(task(i) for i in range(n)))
        seconds = time.perf_counter() - start
    tokens = sum(s.tokens for s in samples)
    ttfts = [s.ttft for s in samples if s.ttft is not None]
    itls = [x for s in samples for x in s.itl]
    return {
        "concurrency": conc,
        "requests": n,
        "errors": [s.error for s in samples if s.error][:3],
        "completion_tokens": tokens,
        "seconds": round(seconds, 2),
        "tok_per_s": round(tokens / seconds, 1),
        "ttft_p50_ms": pct(ttfts, 0.5),
        "ttft_p99_ms": pct(ttfts, 0.99),
        "itl_p50_ms": pct(itls, 0.5),
        "itl_p99_ms": pct(itls, 0.99),
    }


SANITY_PROMPTS = 4  # greedy texts per model in the sanity check (sequential: deterministic)


async def sanity(port: int) -> dict[str, Any]:
    """Greedy texts of the first prompts on the base model and on each adapter. An adapter whose
    texts all equal the base model's is not shown to be applied: these small random adapters
    leave some prompts' greedy text unchanged, so one prompt is not enough evidence."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    texts: dict[str, list[str]] = {}
    async with httpx.AsyncClient(timeout=300) as client:
        for model in ["base", *ADAPTERS]:
            texts[model] = []
            for prompt in PROMPTS[:SANITY_PROMPTS]:
                s = await one(client, url, request_body(model, prompt, None))
                texts[model].append(s.text if s.error is None else f"ERROR {s.error}")
    return {"adapters_applied": adapters_applied(texts), "of": len(ADAPTERS), "texts": texts}


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


def drive(
    port: int,
    mode_names: list[str],
    cells: list[tuple[int, int]],
    vocab_split: int,
    proc: subprocess.Popen | None = None,
):
    all_modes = modes(vocab_split)
    rows = []
    asyncio.run(run_cell(port, all_modes["mixed"], 8, 8))  # warm up every adapter
    for conc, n in cells:
        for mode in mode_names:
            with CpuMeter(proc) as cpu:
                row = asyncio.run(run_cell(port, all_modes[mode], conc, n))
            row["mode"] = mode
            row["cpu_s"] = {"client": cpu.client_s, "server": cpu.server_s}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# ---- main -----------------------------------------------------------------------------------


def phase(
    run: dict[str, Any], server: str, proc: subprocess.Popen, port: int, mode_names: list[str],
    cells: list[tuple[int, int]], vocab_split: int, first_round: bool,
) -> None:  # fmt: skip
    """One server's round: its cells (after the sanity texts on its first round), then stop it."""
    try:
        if first_round:
            run[server] = {"sanity": asyncio.run(sanity(port)), "rounds": []}
        run[server]["rounds"].append(drive(port, mode_names, cells, vocab_split, proc))
        run[server]["priorities"] = priorities(proc)
    finally:
        stop(proc)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--quick", action="store_true", help="c=8 and c=32 only")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--work", default=None, help="keep adapters/store here between runs")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument(
        "--skip-offline", action="store_true", help="no offline-engine yardstick (serve_offline)"
    )
    ap.add_argument("--modes", nargs="+", default=None, help="only these modes (a quick A/B)")
    ap.add_argument("--concurrency", nargs="+", type=int, default=None, help="only these c")
    ap.add_argument("--out", default=str(RESULTS), help="where the JSON goes")
    ap.add_argument(
        "--rounds", type=int, default=1,
        help="run vLLM, MoLoRA and offline this many times, order reversed every other round "
        "(ABC CBA ...); best of N per cell, and per-round ratios in the JSON",
    )  # fmt: skip
    args = ap.parse_args()

    model_dir, work, store, vocab_split = prepare_assets(args.work, "serve-vs-vllm-")
    cells = CELLS["quick" if args.quick else "full"]
    if args.concurrency:
        cells = [cell for cell in CELLS["full"] if cell[0] in args.concurrency]
    only = set(args.modes or modes(vocab_split))
    vllm_python = Path(args.vllm_python)
    runs: dict[str, Any] = {}
    for dtype in args.dtypes:
        run: dict[str, Any] = {}
        # The modes every side (vLLM, MoLoRA, offline) runs; ours adds the MoLoRA-only routes.
        shared_modes = [m for m in ("base", "single", "mixed") if m in only]
        our_modes = [m for m in modes(vocab_split) if m in only]
        for round_no in range(args.rounds):
            for server in round_order(round_no, args.skip_vllm, args.skip_offline):
                if server == "vllm" and not vllm_python.is_file():
                    run["vllm"] = {"skipped": f"{vllm_python} not found: run `make vllm-env`"}
                elif server == "vllm":
                    log = work / f"vllm_{dtype}.log"
                    proc = start_vllm(vllm_python, model_dir, work, dtype, log)
                    phase(run, "vllm", proc, VLLM_PORT, shared_modes, cells, vocab_split,
                          round_no == 0)  # fmt: skip
                    run["vllm"]["thread_binding"] = vllm_binding(log)
                elif server == "molora":
                    log = work / f"molora_{dtype}.log"
                    config = molora_config(store, dtype, work / f"molora_{dtype}.yaml")
                    proc = start_molora(config, log)
                    phase(run, "molora", proc, MOLORA_PORT, our_modes, cells, vocab_split,
                          round_no == 0)  # fmt: skip
                    run["molora"]["thread_binding"] = molora_binding(log)
                else:
                    offline = run.setdefault("offline", {"layout": replica_layout(), "rounds": []})
                    offline["rounds"].append(measure_offline(store, dtype, cells, shared_modes))
        for server in ("vllm", "molora", "offline"):
            if "rounds" in run.get(server, {}):
                run[server]["cells"] = best_of_rounds(run[server]["rounds"])
        run["per_round"] = per_round_ratios(run)
        run["greedy_agreement"] = agreement(run)
        runs[dtype] = run
    table = summarize(runs)
    print("\n".join(table))
    for dtype, run in runs.items():
        for server in ("vllm", "molora"):
            check = run.get(server, {}).get("sanity")
            if check:
                print(f"{dtype} {server}: adapters that change a greedy text: "
                      f"{check['adapters_applied']} of {check['of']}")  # fmt: skip
        if run["greedy_agreement"]:
            a = run["greedy_agreement"]
            print(f"{dtype}: greedy texts identical to vLLM's: {a['identical']} of {a['of']}")
        for r in run["per_round"]:
            print(f"{dtype} round {r['round']} {r['mode']} c={r['concurrency']}: "
                  f"vs vLLM {r.get('vs_vllm', '-')}, kept {r.get('kept', '-')}")  # fmt: skip
    write_json(
        Path(args.out),
        {
            "benchmark": "serve_vs_vllm",
            "machine": machine_info(),
            "workload": {
                "model": "SmolLM2-135M-Instruct",
                "adapters": "4 PEFT LoRAs r=8 alpha=16 on all 7 projections",
                "prompts": len(PROMPTS),
                "max_tokens": NEW_TOKENS,
                "sampling": "greedy, ignore_eos, streaming chat",
                "max_num_seqs": MAX_NUM_SEQS,
                "max_model_len": MAX_MODEL_LEN,
                "molora_replicas": replica_layout(),
            },
            "runs": runs,
            "table": table,
        },
    )


if __name__ == "__main__":
    main()
