"""The shipped mode end to end: `serve run` of serve_config.yaml under the cluster settings `make
serve` gives it (deployments/replica/serve_env.py), its own Ray cluster with token auth, the
tiny model: the router serves the API on its fixed port itself, Serve's proxy the next port."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from benchmarks.server_process import session_processes, stop, wait_up
from deployments.access.auth import KeyFile, new_key, write_key_file
from tests.deployments.serve_helpers import (
    open_stream,
    openai_client,
    shipped_args,
    whole_chat_seconds,
)
from tests.support import ports

pytestmark = pytest.mark.slow  # `serve run` in a subprocess: a Ray cluster of its own

ROOT = Path(__file__).resolve().parents[3]
MESSAGES = [{"role": "user", "content": "Say something."}]
LONG = 1000  # tokens of a request the disconnect test cuts short


class Served:
    def __init__(self, proc: subprocess.Popen, port: int, proxy_port: int, key: str) -> None:
        self.proc, self.port, self.proxy_port, self.key = proc, port, proxy_port, key
        self.url = f"http://127.0.0.1:{port}"
        self.headers = {"Authorization": f"Bearer {key}"}


def _document(tiny_assets: dict[str, Path], keys: Path, proxy_port: int) -> dict[str, Any]:
    """serve_config.yaml as shipped, on the tiny model, with API keys on, one sequence at a
    time (so a request queued behind another shows when that one is dropped)."""
    doc = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app = doc["applications"][0]
    app["args"] = shipped_args(
        tiny_assets,
        engine={"max_num_seqs": 1, "max_queue_len": 1},
        server={"auth": {"enabled": True, "keys_file": str(keys)}},
    )
    doc["http_options"]["port"] = proxy_port
    replica = next(d for d in app["deployments"] if d["name"] == "ModelReplica")
    replica["ray_actor_options"]["num_cpus"] = 1
    replica["max_ongoing_requests"] = 2
    return doc


@pytest.fixture(scope="module")
def served(tiny_assets, tmp_path_factory) -> Iterator[Served]:
    work = tmp_path_factory.mktemp("direct-ingress")
    key, entry = new_key("acme")
    write_key_file(work / "keys.json", KeyFile(keys=[entry]))
    port = ports.free_ports(1, offsets=(0, 1))[0]  # the router's port, the proxy's next to it
    config = work / "serve.yaml"
    config.write_text(yaml.safe_dump(_document(tiny_assets, work / "keys.json", port + 1)))
    ray_tmp = tempfile.mkdtemp(prefix="molora-ray-")  # short socket paths
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RAY_ADDRESS": "local",
        "RAY_TMPDIR": ray_tmp,
        "RAY_AUTH_MODE": "token",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_worker_niceness": "0",
        # Ray's memory monitor judges the whole machine: on a shared box it would kill this
        # cluster's workers for other processes' memory.
        "RAY_memory_monitor_refresh_ms": "0",
    }
    serve = Path(sys.executable).parent / "serve"
    cmd = [sys.executable, "-m", "deployments.replica.serve_env", "--port", str(port)]
    log = (work / "serve.log").open("w")
    proc = subprocess.Popen(
        [*cmd, str(serve), "run", str(config)],
        env=env,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        try:
            wait_up(f"http://127.0.0.1:{port}/health", proc, timeout_s=300)
        except RuntimeError as exc:
            tail = (work / "serve.log").read_text(errors="replace")[-4000:]
            raise RuntimeError(f"{exc}\n{tail}") from None
        yield Served(proc, port, port + 1, key)
    finally:
        stop(proc)
        log.close()


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny-base", "messages": MESSAGES, "max_tokens": 8, **extra}


def test_the_router_serves_the_api_on_its_fixed_port(served: Served) -> None:
    with httpx.Client(base_url=served.url, headers=served.headers, timeout=60) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/-/healthz").status_code == 200  # Serve's own probe path, for k8s
        reply = http.post("/v1/chat/completions", json=_chat())
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
        lines = []
        with http.stream("POST", "/v1/chat/completions", json=_chat(stream=True)) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
        assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)
    # The same app answers one hop further, through Serve's proxy.
    proxied = httpx.post(
        f"http://127.0.0.1:{served.proxy_port}/v1/chat/completions",
        json=_chat(),
        headers=served.headers,
        timeout=60,
    )
    assert proxied.status_code == 200, proxied.text


def test_the_router_port_refuses_requests_without_a_valid_key(served: Served) -> None:
    for headers in ({}, {"Authorization": "Bearer mlr_nope_nope"}):
        reply = httpx.post(
            f"{served.url}/v1/chat/completions", json=_chat(), headers=headers, timeout=60
        )
        assert reply.status_code == 401, reply.text
        assert reply.json()["error"]["code"] == 401
    assert httpx.get(f"{served.url}/v1/models", timeout=60).status_code == 401


async def test_a_client_disconnect_aborts_the_request(served: Served) -> None:
    """One sequence at a time: a request queued behind a long stream starts only when the
    stream's request leaves the engine, and it does as soon as its client hangs up."""
    body = _chat(max_tokens=LONG, ignore_eos=True)
    async with httpx.AsyncClient(base_url=served.url, headers=served.headers, timeout=300) as http:
        full_s = await whole_chat_seconds(http, body, LONG)
        async with open_stream(http, body):
            queued = asyncio.create_task(http.post("/v1/chat/completions", json=_chat()))
            await asyncio.sleep(0.5)  # it waits behind the stream
            assert not queued.done()
        closed = time.monotonic()  # the client hung up as the stream's block ended
        reply = await queued
        freed_s = time.monotonic() - closed
    assert reply.status_code == 200, reply.text
    # Left running, the stream would hold the engine for about full_s more.
    assert freed_s < 0.5 * full_s, (freed_s, full_s)


def test_a_killed_router_ends_its_stream_and_its_successor_takes_the_port(served: Served) -> None:
    """Router death on the direct path: the connection is cut (no proxy is left to write an
    error event), so a stream ends without `[DONE]` in httpx's RemoteProtocolError and a request
    still waiting in the OpenAI SDK raises APIConnectionError, both at once rather than at their
    read timeouts; Serve starts a new router, which gets the same fixed port."""
    (router,) = [p for p in session_processes(served.proc, alive_only=True) if "Router" in p.label]
    body = _chat(max_tokens=LONG, ignore_eos=True, stream=True)
    sdk = openai_client(served.url, served.key)
    sdk_error: list[BaseException] = []

    def waiting_sdk_stream() -> None:  # queued behind the stream below (one sequence at a time)
        try:
            for _ in sdk.chat.completions.create(**_chat(max_tokens=LONG, stream=True)):
                pass
        except Exception as exc:
            sdk_error.append(exc)

    waiting = threading.Thread(target=waiting_sdk_stream, daemon=True)
    lines: list[str] = []
    with (
        httpx.Client(base_url=served.url, headers=served.headers, timeout=60) as http,
        pytest.raises(httpx.RemoteProtocolError),
        http.stream("POST", "/v1/chat/completions", json=body) as resp,
    ):
        for line in resp.iter_lines():
            lines.append(line)
            if len(lines) == 3:
                waiting.start()
                time.sleep(0.5)
                os.kill(router.pid, signal.SIGKILL)
    assert "data: [DONE]" not in lines
    waiting.join(timeout=90)
    assert not waiting.is_alive()
    (error,) = sdk_error
    assert isinstance(error, openai.APIConnectionError), repr(error)
    assert not isinstance(error, openai.APITimeoutError), repr(error)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            reply = httpx.post(
                f"{served.url}/v1/chat/completions",
                json=_chat(),
                headers=served.headers,
                timeout=30,
            )
            if reply.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    else:
        raise AssertionError("no router came back on the fixed port")
    (successor,) = [
        p for p in session_processes(served.proc, alive_only=True) if "Router" in p.label
    ]
    assert successor.pid != router.pid
