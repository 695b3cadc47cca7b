"""The chaos benchmark's flood and fuzz.

Flood: globex's quota-limited key (max_concurrent 4) at 10x its quota: 40 concurrent streams of
n=16 choices, abort storms (streams dropped after their first event) and slow bodies (a body sent
a few bytes at a time), while acme streams as it did alone; acme's p99 TTFT against its solo
baseline and `/health` latency throughout.

Fuzz: schemathesis (its CLI) over the served OpenAPI document, every operation, once with each
of acme's, globex's and the admin's keys; the HAR it records is read back for 5xx answers and for
answers to one tenant that name the other tenant's private adapter.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from benchmarks.chaos_setup import FLOOD_QUOTA, PRIVATE, Bench
from benchmarks.chaos_streams import completion_body, run_stream


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


async def _victim(bench: Bench, models: list[str], n: int, conc: int) -> list[float]:
    """acme's streams: `n` requests of 16 tokens at `conc` at a time; their TTFTs."""
    ttfts: list[float] = []
    todo = list(range(n))
    async with httpx.AsyncClient(base_url=bench.url, timeout=120) as http:

        async def worker() -> None:
            while todo:
                i = todo.pop()
                r = await run_stream(
                    http, "acme", bench.keys["acme"], models[i % len(models)], i % 4, 16
                )
                if r.ttft is not None and r.end == "complete":
                    ttfts.append(r.ttft)

        await asyncio.gather(*(worker() for _ in range(conc)))
    return ttfts


async def _health(bench: Bench, stop: asyncio.Event, out: list[float], errors: list[str]) -> None:
    async with httpx.AsyncClient(base_url=bench.url, timeout=10) as http:
        while not stop.is_set():
            t = time.monotonic()
            try:
                r = await http.get("/health")
                if r.status_code != 200:
                    errors.append(str(r.status_code))
            except httpx.HTTPError as exc:
                errors.append(type(exc).__name__)
            out.append(time.monotonic() - t)
            await asyncio.sleep(0.25)


async def _flooder(
    bench: Bench, stop: asyncio.Event, statuses: dict[str, int], models: list[str], i: int
) -> None:
    key = bench.keys["globex_flood"]
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=bench.url, timeout=60) as http:
        k = 0
        while not stop.is_set():
            k += 1
            mode = ("n16", "abort", "slow")[(i + k) % 3]
            body = completion_body(models[(i + k) % len(models)], k % 4, 24)
            tag = mode
            try:
                if mode == "n16":
                    body.update(n=16, stream=False, logprobs=None, stream_options=None)
                    body = {k2: v for k2, v in body.items() if v is not None}
                    r = await http.post("/v1/completions", json=body, headers=headers)
                    tag += f" {r.status_code}"
                elif mode == "abort":
                    async with http.stream(
                        "POST", "/v1/completions", json=body, headers=headers
                    ) as r:
                        tag += f" {r.status_code}"
                        async for _ in r.aiter_lines():
                            break  # hang up after the first line
                else:
                    raw = json.dumps(body).encode()

                    async def slow(raw: bytes = raw):
                        for j in range(0, len(raw), 64):
                            yield raw[j : j + 64]
                            await asyncio.sleep(0.05)

                    r = await http.post(
                        "/v1/completions",
                        content=slow(),
                        headers={**headers, "content-type": "application/json"},
                    )
                    tag += f" {r.status_code}"
            except httpx.HTTPError as exc:
                tag += f" {type(exc).__name__}"
            statuses[tag] = statuses.get(tag, 0) + 1


async def flood(bench: Bench, models: list[str], quick: bool) -> dict[str, Any]:
    n, conc = (16, 4) if quick else (96, 4)
    health: list[float] = []
    health_err: list[str] = []
    stop = asyncio.Event()
    watcher = asyncio.create_task(_health(bench, stop, health, health_err))
    base = await _victim(bench, models, n, conc)
    flooders_n = 10 * FLOOD_QUOTA["max_concurrent"]
    statuses: dict[str, int] = {}
    fstop = asyncio.Event()
    flooders = [
        asyncio.create_task(_flooder(bench, fstop, statuses, models, i)) for i in range(flooders_n)
    ]
    await asyncio.sleep(3)
    loaded = await _victim(bench, models, n, conc)
    fstop.set()
    await asyncio.gather(*flooders, return_exceptions=True)
    stop.set()
    await watcher
    b99, l99 = _pct(base, 0.99), _pct(loaded, 0.99)
    return {
        "flood_clients": flooders_n,
        "flood_quota": FLOOD_QUOTA,
        "flood_answers": dict(sorted(statuses.items())),
        "flood_5xx": sum(v for k, v in statuses.items() if k.split()[-1].startswith("5")),
        "victim_requests": n,
        "victim_completed_solo": len(base),
        "victim_completed_flooded": len(loaded),
        "victim_ttft_p99_solo_ms": round(1000 * b99, 1),
        "victim_ttft_p99_flooded_ms": round(1000 * l99, 1),
        "victim_ttft_p99_ratio": round(l99 / b99, 2) if b99 else None,
        "health_checks": len(health),
        "health_max_ms": round(1000 * max(health, default=0), 1),
        "health_p99_ms": round(1000 * _pct(health, 0.99), 1),
        "health_errors": len(health_err),
        "not_done": "100k-token grammars in the flood",
    }


def _send(http: httpx.Client, case: Any, base_url: str, key: str) -> httpx.Response:
    """One generated case over HTTP (httpx: the CLI's requests transport breaks where
    urllib3-future replaces urllib3, as in this environment)."""
    kw = case.as_transport_kwargs(base_url=base_url)
    headers = {str(k): str(v) for k, v in (kw.get("headers") or {}).items()}
    headers["Authorization"] = f"Bearer {key}"
    body: dict[str, Any] = {}
    if "json" in kw:
        body["json"] = kw["json"]
    elif kw.get("data") is not None:
        data = kw["data"]
        body["content" if isinstance(data, bytes | str) else "data"] = data
    return http.request(kw["method"], kw["url"], headers=headers, params=kw.get("params"), **body)


ABSENT = "no-such-adapter-x"


def probe_other_tenant(http: httpx.Client, bench: Bench, examples: list[str]) -> int:
    """Each key names the other tenant's private adapter where a model name goes (alone, in a
    mix, pinned, by id, in admin and runtime-LoRA calls): every answer must be the answer for a
    name that does not exist (status and body, the name itself replaced). Returns how many
    differ (existence oracles)."""
    differ = 0
    for holder, tenant in (("acme", "acme"), ("globex", "globex"), ("admin", "acme")):
        other = PRIVATE["globex" if tenant == "acme" else "acme"]
        headers = {"Authorization": f"Bearer {bench.keys[holder]}"}
        calls = [
            ("GET", "/v1/models/{}", None),
            ("POST", "/v1/completions", {"model": "{}", "prompt": "hi", "max_tokens": 2}),
            ("POST", "/v1/completions", {"model": "{}@v1", "prompt": "hi", "max_tokens": 2}),
            (
                "POST",
                "/v1/completions",
                {"model": "r4-a00:0.5+{}:0.5", "prompt": "hi", "max_tokens": 2},
            ),
            (
                "POST",
                "/v1/chat/completions",
                {"model": "{}", "messages": [{"role": "user", "content": "hi"}]},
            ),
            ("POST", "/v1/admin/adapters/{}/yank", {}),
            ("POST", "/v1/load_lora_adapter", {"lora_name": "x1", "lora_path": "store:{}"}),
            ("POST", "/v1/unload_lora_adapter", {"lora_name": "{}"}),
        ]
        for method, path, body in calls:
            answers = []
            for name in (other, ABSENT):
                url = bench.url + path.format(name)
                data = json.loads(json.dumps(body).replace("{}", name)) if body else None
                r = http.request(method, url, headers=headers, json=data)
                answers.append((r.status_code, r.text.replace(name, "NAME")))
            if answers[0] != answers[1]:
                differ += 1
                if len(examples) < 12:
                    examples.append(
                        f"{holder} {method} {path} with {other!r}: {answers[0]} vs "
                        f"absent: {answers[1]}"[:400]
                    )
    return differ


def _cases(strategy: Any, max_examples: int, on_case: Any) -> None:
    """`on_case` on up to `max_examples` cases hypothesis draws from `strategy`."""
    from hypothesis import HealthCheck, Phase, given, settings

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case: Any) -> None:
        on_case(case)

    run()


def fuzz(bench: Bench, max_examples: int, max_time_s: float) -> dict[str, Any]:
    """schemathesis's generated cases (positive and negative) for every operation of
    /openapi.json, sent with each key; 5xx answers and answers naming the other tenant's
    private adapter are counted."""
    import schemathesis
    from hypothesis.errors import Unsatisfiable

    schema = schemathesis.openapi.from_url(f"{bench.url}/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    per: dict[str, Any] = {}
    examples: list[str] = []
    total = fivexx = leaks = errors = 0
    started = time.monotonic()
    budget = max_time_s / (3 * len(ops) * 2)  # seconds per (key, operation, mode)
    with httpx.Client(timeout=60) as http:
        for holder, tenant in (("acme", "acme"), ("globex", "globex"), ("admin", "acme")):
            other = PRIVATE["globex" if tenant == "acme" else "acme"]
            stats = {"cases": 0, "5xx": 0, "cross_tenant": 0, "transport_errors": 0}
            for op in ops:
                for mode in (
                    schemathesis.GenerationMode.POSITIVE,
                    schemathesis.GenerationMode.NEGATIVE,
                ):
                    until = time.monotonic() + budget

                    def on_case(
                        case: Any,
                        until: float = until,
                        other: str = other,
                        stats: dict[str, int] = stats,
                        holder: str = holder,
                    ) -> None:
                        if time.monotonic() > until:
                            return
                        stats["cases"] += 1
                        try:
                            r = _send(http, case, bench.url, bench.keys[holder])
                        except httpx.HTTPError as exc:
                            stats["transport_errors"] += 1
                            if len(examples) < 8:
                                examples.append(f"{holder} {case.method} {case.path}: {exc!r}")
                            return
                        if r.status_code >= 500:
                            stats["5xx"] += 1
                            if len(examples) < 8:
                                examples.append(
                                    f"{holder} {case.as_curl_command()[:300]} -> "
                                    f"{r.status_code}: {r.text[:200]}"
                                )
                        # A name the case itself sent comes back in its echo (Hypothesis draws
                        # strings from the code's constants, this file's tenant names included);
                        # whether such a name exists is probe_other_tenant's question.
                        sent = repr(case.as_transport_kwargs(base_url=bench.url))
                        if other in r.text and other not in sent:
                            stats["cross_tenant"] += 1
                            if len(examples) < 8:
                                examples.append(f"{holder} got {other!r} from {case.path}")

                    try:
                        _cases(op.as_strategy(generation_mode=mode), max_examples, on_case)
                    except Unsatisfiable:  # no invalid input exists (no parameters, no body)
                        continue
                    except Exception as exc:  # a generation error: reported, not fatal
                        errors += 1
                        if len(examples) < 8:
                            examples.append(
                                f"{holder} {op.method} {op.path}: generation "
                                f"{type(exc).__name__}: {str(exc)[:160]}"
                            )
            per[holder] = stats
            total += stats["cases"]
            fivexx += stats["5xx"]
            leaks += stats["cross_tenant"]
        oracles = probe_other_tenant(http, bench, examples)
    return {
        "operations": len(ops),
        "existence_oracles": oracles,
        "cases": total,
        "5xx": fivexx,
        "cross_tenant_names": leaks,
        "generation_errors": errors,
        "by_key": per,
        "examples": examples,
        "seconds": round(time.monotonic() - started, 1),
        "how": "schemathesis Python API (cases) sent with httpx; the schemathesis CLI's "
        "requests transport fails here (urllib3-future installed over urllib3)",
    }
