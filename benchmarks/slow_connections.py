"""Slow connections against a real served app while another tenant's bystander streams run.

Attackers hold thousands of connections: most send their headers with a valid (quota-limited)
key and trickle the body a byte a second; the rest make one keep-alive request and then sit
idle. Two modes, each against its own baseline: `hold` (each connection is opened once and
held as long as the server allows) and `reconnect` (an answered or closed connection comes back
after `--reconnect-s`, which turns the attack into a steady request flood). The
bystander (another tenant) streams the same greedy requests first alone, then under attack, in
the same run (the box is shared, so only ratios within one run mean anything): its texts must
be equal, its inter-token latency p99 within 2x, and `/health` must answer 200 throughout.

    python -m benchmarks.slow_connections --connections 2000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from benchmarks.report import write_json
from deployments.api.proxy_guard import CAP_ENV
from tests.deployments.serve_assets import make_assets
from tests.deployments.serve_helpers import auth_on, deployed, issue_keys, shipped_args
from tests.support.local_ray import start_local_cluster, stop_local_cluster

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "slow_connections.json"
MESSAGES = [{"role": "user", "content": "Write a few words."}]
ITL_BOUND = 2.0  # under attack, bystander ITL p99 may be at most this times the baseline


def raise_nofile(need: int) -> tuple[int, int]:
    """Raise the soft open-files limit to `need` (within the hard limit); (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


@dataclass
class Attack:
    """Shared state of the attackers: outcomes, seconds to each answer, the connections
    trickling, and a stop flag. One ticker writes every trickle (no timer per connection, so
    thousands of connections cost the attacking process little)."""

    host: str
    port: int
    reconnect_s: float
    outcomes: Counter[str] = field(default_factory=Counter)
    answer_s: list[float] = field(default_factory=list)
    trickling: set[asyncio.StreamWriter] = field(default_factory=set)
    open: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def ticker(self) -> None:
        while not self.stop.is_set():
            for writer in list(self.trickling):
                if not writer.is_closing():
                    writer.write(b" ")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 1.0)

    async def _hold(self, opening: bytes, trickle: bool) -> str:
        """One connection: send `opening`, then a byte a second (`trickle`) or nothing, until
        the server answers or closes; the outcome's name."""
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port), 30
            )
        except (OSError, TimeoutError):
            return "connect_failed"
        self.open += 1
        start = time.monotonic()
        read = stopped = None
        try:
            writer.write(opening)
            await writer.drain()
            if trickle:
                self.trickling.add(writer)
            else:  # keep-alive: read the one answer, then sit idle
                await _read_response(reader)
            read = asyncio.ensure_future(reader.readline())
            stopped = asyncio.ensure_future(self.stop.wait())
            await asyncio.wait({read, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not read.done():
                return "held_to_end"
            line = read.result()
            if not line:
                return "closed_by_server"
            if trickle:
                self.answer_s.append(time.monotonic() - start)
            return f"http_{line.split()[1].decode()}" if len(line.split()) > 1 else "garbled"
        except (OSError, ValueError, IndexError):
            return "reset"
        finally:
            for task in (read, stopped):
                if task is not None:
                    task.cancel()
            self.trickling.discard(writer)
            self.open -= 1
            writer.close()

    async def attacker(self, opening: bytes, trickle: bool, kind: str) -> None:
        while not self.stop.is_set():
            self.outcomes[f"{kind}:{await self._hold(opening, trickle)}"] += 1
            if self.reconnect_s <= 0:  # hold mode: one connection, no comeback
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.reconnect_s)


async def _read_response(reader: asyncio.StreamReader) -> None:
    """Read one HTTP/1.1 response with a Content-Length body."""
    length = 0
    while (line := await asyncio.wait_for(reader.readline(), 30)) not in (b"\r\n", b""):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    await reader.readexactly(length)


def slow_body_opening(host: str, key: str) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        "Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n{"
    ).encode()


def keep_alive_opening(host: str) -> bytes:
    return f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: keep-alive\r\n\r\n".encode()


async def bystander(http: httpx.AsyncClient, key: str, body: dict[str, Any]) -> dict[str, Any]:
    """One stream: its text, gaps between content chunks (s) and any error event."""
    text, gaps, errors = [], [], []
    last = None
    async with http.stream(
        "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        if resp.status_code != 200:
            return {"text": "", "gaps": [], "errors": [resp.status_code]}
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"])
                continue
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    text.append(choice["delta"]["content"])
    return {"text": "".join(text), "gaps": gaps, "errors": errors}


async def bystanders(
    url: str, key: str, body: dict[str, Any], streams: int, concurrency: int
) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        results: list[dict[str, Any]] = []
        for start in range(0, streams, concurrency):
            batch = range(start, min(streams, start + concurrency))
            results += await asyncio.gather(*(bystander(http, key, body) for _ in batch))
    gaps = [g for r in results for g in r["gaps"]]
    return {
        "texts": [r["text"] for r in results],
        "errors": [e for r in results for e in r["errors"]],
        "itl_p50_ms": round(1000 * statistics.median(gaps), 2) if gaps else None,
        "itl_p99_ms": round(1000 * _pct(gaps, 0.99), 2) if gaps else None,
    }


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def poll_health(url: str, stop: asyncio.Event, every_s: float = 0.5) -> list[int]:
    statuses = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while not stop.is_set():
            try:
                statuses.append((await http.get("/health")).status_code)
            except httpx.HTTPError:
                statuses.append(0)
            await asyncio.sleep(every_s)
    return statuses


async def hold_attack(
    url: str, key: str, slow: int, idle: int, ramp_s: float, reconnect_s: float
) -> None:
    """The attacker process: ramp up, print `{"open": n}`, hold until a line arrives on stdin,
    then print `{"open": n, "outcomes": {...}}` and stop."""  # fmt: skip
    raise_nofile(2 * (slow + idle) + 256)
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    attack = Attack(host, port, reconnect_s)
    tasks = [asyncio.create_task(attack.ticker())]
    for i in range(slow + idle):
        if i < slow:
            opening, trickle, kind = slow_body_opening(host, key), True, "slow_body"
        else:
            opening, trickle, kind = keep_alive_opening(host), False, "idle_keepalive"
        tasks.append(asyncio.create_task(attack.attacker(opening, trickle, kind)))
        if i % 100 == 99:
            await asyncio.sleep(ramp_s * 100 / (slow + idle))
    await asyncio.sleep(1.0)
    print(json.dumps({"open": attack.open}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    opened = attack.open
    attack.stop.set()
    await asyncio.gather(*tasks)
    answers = attack.answer_s
    print(
        json.dumps(
            {
                "open": opened,
                "outcomes": dict(sorted(attack.outcomes.items())),
                "slow_body_answer_p50_s": round(statistics.median(answers), 2) if answers else None,
                "slow_body_answer_p99_s": round(_pct(answers, 0.99), 2) if answers else None,
            }
        )
    )


async def run(
    url: str,
    keys: dict[str, str],
    *,
    slow: int,
    idle: int,
    body: dict[str, Any],
    streams: int = 6,
    concurrency: int = 2,
    ramp_s: float = 5.0,
    reconnect_s: float = 2.0,
) -> dict[str, Any]:
    """Baseline bystanders, then the same under `slow` trickling and `idle` keep-alive
    connections held by a separate attacker process (so its work never delays the bystander's
    own client); `keys` has the bystander's (`acme`) and the attacker's (`evil`)."""
    await bystanders(url, keys["acme"], body, concurrency, concurrency)  # warm
    baseline = await bystanders(url, keys["acme"], body, streams, concurrency)
    args = json.dumps([url, keys["evil"], slow, idle, ramp_s, reconnect_s])
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.slow_connections", "--attack", args,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    try:
        ready = json.loads(await asyncio.wait_for(child.stdout.readline(), ramp_s + 120))
        stop_health = asyncio.Event()
        health = asyncio.create_task(poll_health(url, stop_health))
        started = time.monotonic()
        attacked = await bystanders(url, keys["acme"], body, streams, concurrency)
        attack_s = time.monotonic() - started
        stop_health.set()
        statuses = await health
        child.stdin.write(b"stop\n")
        await child.stdin.drain()
        final = json.loads(await asyncio.wait_for(child.stdout.readline(), 120))
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()
    ratio = (
        attacked["itl_p99_ms"] / baseline["itl_p99_ms"]
        if attacked["itl_p99_ms"] and baseline["itl_p99_ms"]
        else None
    )
    equal = attacked["texts"] == baseline["texts"] and not attacked["errors"]
    return {
        "connections": {"slow_body": slow, "idle_keepalive": idle},
        "open_when_bystanders_started": ready["open"],
        "open_when_bystanders_ended": final["open"],
        "attack_s": round(attack_s, 1),
        "outcomes": final["outcomes"],
        "slow_body_answer_s": {
            "p50": final["slow_body_answer_p50_s"],
            "p99": final["slow_body_answer_p99_s"],
        },
        "health": dict(Counter(statuses)),
        "baseline": {k: v for k, v in baseline.items() if k != "texts"},
        "attacked": {k: v for k, v in attacked.items() if k != "texts"},
        "texts_equal": equal,
        "itl_p99_ratio": round(ratio, 2) if ratio else None,
        "within_bounds": bool(
            equal and ratio is not None and ratio <= ITL_BOUND and set(statuses) == {200}
        ),
    }


def launch(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="molora-slowconn-"))
    assets = make_assets(work)
    keys = issue_keys(work / "keys.json", [("acme", "acme", False), ("evil", "evil", False)])
    serve_args = shipped_args(
        assets,
        engine={"max_num_seqs": 4, "max_queue_len": 16, "max_model_len": 512},
        server={
            "auth": auth_on(work / "keys.json"),
            "admission": {"body_timeout_s": args.body_timeout_s},
            "quotas": {"keys": {keys["evil_id"]: {"max_concurrent": 4}}},
        },
    )
    if args.proxy_cap:  # the proxy reads it from the environment it inherits
        os.environ[CAP_ENV] = str(args.proxy_cap)
    cluster = start_local_cluster(num_cpus=8)
    body = {"model": "code", "messages": MESSAGES, "max_tokens": args.max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    try:
        with deployed(cluster.url, serve_args, replicas=1, max_ongoing=64):
            modes = {}
            for mode, reconnect_s in (("hold", 0.0), ("reconnect", args.reconnect_s)):
                print(
                    f"[{mode}] {args.slow} slow bodies + {args.idle} idle keep-alives", flush=True
                )
                modes[mode] = asyncio.run(
                    run(
                        cluster.url, keys, slow=args.slow, idle=args.idle, body=body,
                        streams=args.streams, reconnect_s=reconnect_s,
                    )
                )  # fmt: skip
            return modes
    finally:
        stop_local_cluster(cluster)
        shutil.rmtree(work, ignore_errors=True)


def table(modes: dict[str, dict[str, Any]]) -> str:
    head = ("mode", "ITL p50 alone", "ITL p50 attacked", "ITL p99 alone", "ITL p99 attacked",
            "p99 ratio", "texts equal", "/health", "open", "slow-body answer p50 s")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode, r in modes.items():
        row = (mode, r["baseline"]["itl_p50_ms"], r["attacked"]["itl_p50_ms"],
               r["baseline"]["itl_p99_ms"], r["attacked"]["itl_p99_ms"], r["itl_p99_ratio"],
               r["texts_equal"], r["health"],
               f"{r['open_when_bystanders_started']} -> {r['open_when_bystanders_ended']}",
               r["slow_body_answer_s"]["p50"])  # fmt: skip
        lines.append("| " + " | ".join(map(str, row)) + " |")
    lines.append(f"(ITL in ms; bound: p99 ratio <= {ITL_BOUND})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--connections", type=int, default=2000, help="attacker connections")
    parser.add_argument("--idle-share", type=float, default=0.25, help="of them idle keep-alives")
    parser.add_argument("--streams", type=int, default=12, help="bystander streams per phase")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--body-timeout-s", type=float, default=10.0)
    parser.add_argument("--reconnect-s", type=float, default=5.0, help="in reconnect mode")
    parser.add_argument(
        "--proxy-cap", type=int, default=64, help="MOLORA_PROXY_MAX_OPEN_PER_KEY (0 = off)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--attack", help=argparse.SUPPRESS)  # the attacker process's arguments
    args = parser.parse_args(argv)
    if args.attack:
        asyncio.run(hold_attack(*json.loads(args.attack)))
        return 0
    args.idle = int(args.connections * args.idle_share)
    args.slow = args.connections - args.idle
    soft, hard = raise_nofile(2 * args.connections + 1024)
    modes = launch(args)
    result = {
        "modes": modes,
        "nofile": {"soft": soft, "hard": hard},
        "load": {k: v for k, v in vars(args).items() if k not in ("out", "attack")},
    }
    print(table(modes))
    write_json(args.out, result)
    return 0 if all(m["within_bounds"] for m in modes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
