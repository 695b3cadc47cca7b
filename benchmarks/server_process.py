"""Benchmark servers as child processes: start, wait, stop, and where their CPU went.

Each server runs in a session of its own, so stopping it reaches every process it started (Ray's
daemons and workers) and `CpuMeter` can charge a cell's CPU seconds to each of them.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import yaml

from benchmarks.vllm_env import vllm_cpu_env
from deployments.replica.serve_env import (
    ENABLE,
    PROXY_ENV_VARS,
    direct_ingress_env,
    ray_address_env,
)

ROOT = Path(__file__).resolve().parents[1]
MOLORA_PORT = 18500  # the benchmark configs serve here; start_molora waits on it
PROXY_PORT = MOLORA_PORT + 1  # Serve's proxy when the router serves MOLORA_PORT itself


def set_ingress(cfg: dict[str, Any], direct: bool = True) -> None:
    """Point a Serve document at MOLORA_PORT: the router's own server (direct ingress, the
    shipped mode; Serve's proxy on PROXY_PORT) or Serve's proxy (`direct=False`)."""
    cfg["http_options"]["port"] = PROXY_PORT if direct else MOLORA_PORT
    env = cfg["applications"][0].setdefault("runtime_env", {}).setdefault("env_vars", {})
    env[ENABLE] = "1" if direct else "0"


def bench_config(
    *,
    max_num_seqs: int,
    max_queue_len: int,
    direct: bool = True,
    num_cpus: float | None = None,
    **engine: Any,
) -> dict[str, Any]:
    """serve_config.yaml as a benchmark serves it: the model as `base`, no access log, the
    engine's limits (`engine` on top), and a fixed set of model replicas (on `num_cpus` each when
    given) that each take `max_num_seqs` requests and queue `max_queue_len` more."""
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    set_ingress(cfg, direct)
    cfg["logging_config"]["enable_access_log"] = False
    app = cfg["applications"][0]
    app["args"]["engine"].update(max_num_seqs=max_num_seqs, max_queue_len=max_queue_len, **engine)
    app["args"]["served_model_name"] = "base"
    for dep in app["deployments"]:
        if dep["name"] == "ModelReplica":
            dep.pop("autoscaling_config", None)
            dep["max_ongoing_requests"] = max_num_seqs + 1  # + the router's stream channel
            dep["max_queued_requests"] = max_queue_len
            if num_cpus is not None:
                dep.setdefault("ray_actor_options", {})["num_cpus"] = num_cpus
    return cfg


def ingress_env(direct: bool = True) -> dict[str, str]:
    """What the cluster `serve run` starts must inherit for `set_ingress`'s document."""
    return {**PROXY_ENV_VARS, **direct_ingress_env(MOLORA_PORT, enabled=direct)}


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


def start_molora(
    config: Path, log: Path, extra_env: dict[str, str] | None = None, direct: bool = True
) -> subprocess.Popen:
    """`serve run config` (a `set_ingress` document) in a session of its own; `extra_env` and
    the ingress settings reach the cluster it starts (Serve's controller reads some settings
    only from there)."""
    # Ray starts its workers at nice 15 by default; vLLM runs at the caller's priority. Both
    # servers compute at the same priority, else any other process on the box (the client
    # included) takes its CPU from MoLoRA first.
    env = {
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "PYTHONPATH": str(ROOT),
        "RAY_worker_niceness": "0",
        **ingress_env(direct),
        **(extra_env or {}),
    }
    env.update(ray_address_env(env)[0])  # its own cluster, never one a killed run left behind
    serve = Path(sys.executable).parent / "serve"
    out = log.open("w")
    proc = subprocess.Popen([str(serve), "run", str(config)], env=env, stdout=out,
                            stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)  # fmt: skip
    wait_up(f"http://127.0.0.1:{MOLORA_PORT}/health", proc)
    return proc


def start_vllm(
    python: Path,
    model: Path,
    log: Path,
    port: int,
    *,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    extra: tuple[str, ...] = (),
) -> subprocess.Popen:
    """vLLM's OpenAI server on `model` (served as `base`, threads bound to every core, `extra`
    added to its command line) in a session of its own, started in `log`'s folder; returns once
    it answers."""
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "base"]
    cmd += ["--dtype", dtype, "--max-model-len", str(max_model_len)]
    cmd += ["--max-num-seqs", str(max_num_seqs), *extra]
    proc = subprocess.Popen(cmd, env=vllm_cpu_env(), stdout=log.open("w"),
                            stderr=subprocess.STDOUT, cwd=log.parent, start_new_session=True)  # fmt: skip
    wait_up(f"http://127.0.0.1:{port}/v1/models", proc)
    return proc


def replica_layout() -> dict[str, Any]:
    """The shipped ModelReplica layout the benchmark serves on."""
    app = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]
    dep = next(d for d in app["deployments"] if d["name"] == "ModelReplica")
    return {"num_replicas": dep["num_replicas"], **dep["ray_actor_options"]}


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
        self._start: dict[int, float] = {}
        self._client = 0.0
        self.client_s = 0.0  # the benchmark process's CPU over the cell (it is the client)
        self.server_s: dict[str, float] = {}  # "label pid" -> CPU seconds, >= 0.1 s only

    def __enter__(self) -> CpuMeter:
        self._start = {pid: cpu for pid, (_, cpu) in self._server().items()}
        self._client = time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.client_s = round(time.process_time() - self._client, 2)
        # By pid: Ray retitles a worker while it runs, so its label may change within a cell.
        spent = {
            label: cpu - self._start.get(pid, 0.0) for pid, (label, cpu) in self._server().items()
        }
        self.server_s = {k: round(v, 2) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])
                         if v >= 0.1}  # fmt: skip

    def _server(self) -> dict[int, tuple[str, float]]:
        if self.proc is None:
            return {}
        return {p.pid: (p.label, p.cpu_s) for p in session_processes(self.proc)}


def molora_binding(log: Path) -> list[str]:
    lines = log.read_text(errors="replace").splitlines()
    return [ln.strip()[-160:] for ln in lines if "torch threads" in ln][:4]


def vllm_binding(log: Path) -> list[str]:
    """The lines where vLLM says which cores its OpenMP threads are bound to."""
    lines = log.read_text(errors="replace").splitlines()
    return [ln.strip()[-200:] for ln in lines if re.search(r"core ids|OMP threads|bind", ln)][:6]
