"""The attack suite: one request must never hurt another.

Against a real Serve app (Ray, engine, tiny model, a store holding broken adapters), every
hostile request is answered 4xx in the OpenAI error shape while three bystander streams run in
the same engine batch; the bystanders must finish intact (the tokens they produce alone) and
/health must stay 200. Then Hypothesis throws the worst numbers at every numeric field and route
kind, and schemathesis fuzzes the published request schemas: no 5xx, ever.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from safetensors.torch import load_file, save_file

from deployments.telemetry import metric_names
from tests.deployments.serve_assets import make_adapter
from tests.deployments.serve_helpers import serving, shipped_args

MESSAGES = [{"role": "user", "content": "Say something."}]
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
DOWN_B = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
BYSTANDERS = [
    {"model": "math"},
    {"model": "math:0.5+code:0.5"},
    {"model": "mathcode"},
]
BYSTANDER_TOKENS = 120


# ----- the app under attack ---------------------------------------------------------------------


def _legacy_publish(registry: Any, folder: Path, name: str) -> None:
    """Publish without the rulebook's checks: what a store written before the rules (or by
    another tool) may hold. Checksums are real, so only the runtime can refuse it."""
    from adapter_store.manifest import AdapterManifest, utcnow
    from adapter_store.staging import file_entries, new_blob_dir

    files = sorted(p for p in folder.iterdir() if p.is_file())
    entries, sources = file_entries(files)
    manifest = AdapterManifest(
        name=name, version="v1", base_model="tiny", files=entries, blob_dir=new_blob_dir(),
        created=utcnow(), rank=4, alpha=8.0, target_modules=["q_proj"], num_layers=2, dtype="F32",
    )  # fmt: skip
    registry._upload(manifest, sources, None).commit()


def _edit(folder: Path, key: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    tensors[key] = fn(tensors[key].clone())
    save_file(tensors, str(path))


@pytest.fixture(scope="module")
def attack_store(tiny_assets: dict[str, Path], tmp_path_factory) -> Path:
    """The tiny store plus adapters that cannot be served: NaN weights and wrong shapes
    (legacy-published), a declared foreign base and a rank above the hot-set's max_rank."""
    from adapter_store import open_registry
    from adapter_store.source import AdapterStoreSource

    root = tmp_path_factory.mktemp("attack-store")
    store = Path(shutil.copytree(tiny_assets["store"], root / "store"))
    registry = open_registry(str(store))
    math = AdapterStoreSource(str(store), root / "cache").adapter_path("math@v1")
    for name, key, fn in (
        ("nanad", DOWN_B, lambda t: t.fill_(float("nan"))),
        ("shapes", Q_A, lambda t: torch.cat([t, t[:, :1]], dim=1)),
    ):
        folder = Path(shutil.copytree(math, root / name))
        _edit(folder, key, fn)
        _legacy_publish(registry, folder, name)
    foreign = Path(shutil.copytree(math, root / "foreign"))
    cfg = json.loads((foreign / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "Qwen/Qwen3-8B"
    (foreign / "adapter_config.json").write_text(json.dumps(cfg))
    registry.publish_adapter(foreign, "foreign", "v1")  # push cannot know the served base
    big = make_adapter(tiny_assets["model"], root / "bigrank", seed=5, rank=32)
    registry.publish_adapter(big, "bigrank", "v1")
    return store


@pytest.fixture(scope="module")
def app_url(ray_cluster, tiny_assets, attack_store, tmp_path_factory):
    args = shipped_args(
        tiny_assets,
        engine={"max_num_seqs": 8, "max_queue_len": 16, "max_model_len": 256},
        server={"default_max_tokens": 8},
        store={"url": str(attack_store), "cache_dir": str(tmp_path_factory.mktemp("cache"))},
    )
    yield from serving(ray_cluster, args, replicas=1, max_ongoing=32)


# ----- bystanders -------------------------------------------------------------------------------


def _bystander_body(i: int, stream: bool) -> dict[str, Any]:
    return {
        **BYSTANDERS[i],
        "messages": MESSAGES,
        "max_tokens": BYSTANDER_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


@pytest.fixture(scope="module")
def alone(app_url) -> list[str]:
    """Each bystander's text when it runs alone."""
    texts = []
    for i in range(len(BYSTANDERS)):
        resp = httpx.post(
            f"{app_url}/v1/chat/completions", json=_bystander_body(i, False), timeout=120
        )
        assert resp.status_code == 200, resp.text
        texts.append(resp.json()["choices"][0]["message"]["content"])
    return texts


async def _stream_once(http: httpx.AsyncClient, i: int, started: asyncio.Event) -> dict[str, Any]:
    got: dict[str, Any] = {"text": "", "finish": None, "errors": [], "done": False}
    async with http.stream("POST", "/v1/chat/completions", json=_bystander_body(i, True)) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                got["done"] = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                got["errors"].append(chunk["error"])
                continue
            for choice in chunk["choices"]:
                got["text"] += choice["delta"].get("content") or ""
                got["finish"] = choice.get("finish_reason") or got["finish"]
            started.set()
    return got


async def _bystander(
    http: httpx.AsyncClient, i: int, started: asyncio.Event, stop: asyncio.Event
) -> list[dict[str, Any]]:
    """Stream bystander `i` again and again until `stop`: one is always running."""
    runs = []
    while not stop.is_set():
        runs.append(await _stream_once(http, i, started))
    return runs


async def under_fire(url: str, alone: list[str], attack: Callable[[], Awaitable[None]]) -> None:
    """Run `attack` while three bystanders stream; each of their streams must come out as if
    alone (same text, finish "length", no error) and /health must answer 200 after."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        events = [asyncio.Event() for _ in BYSTANDERS]
        stop = asyncio.Event()
        tasks = [asyncio.create_task(_bystander(http, i, e, stop)) for i, e in enumerate(events)]
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
            await attack()
            stop.set()
            results = await asyncio.gather(*tasks)
        finally:
            stop.set()
            for t in tasks:
                t.cancel()
        health = await http.get("/health")
    assert health.status_code == 200, health.text
    for i, runs in enumerate(results):
        assert runs
        for got in runs:
            assert got["errors"] == [], got["errors"]
            assert got["done"] and got["finish"] == "length"
            assert got["text"] == alone[i], f"bystander {i} was disturbed"


def _assert_openai_error(resp: httpx.Response, status: int, needle: str = "") -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["type"] == "invalid_request_error"
    assert needle in err["message"], err["message"]
    return err


# ----- the attacks ------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
LEARNED = {"kind": "learned", "composition": "mathcode"}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "math", "messages": MESSAGES, "max_tokens": 4, **fields}


def _route(route: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return _chat(model="tiny-base", molora={"route": route}, **fields)


def _deep(depth: int) -> bytes:
    return b'{"model": "math", "messages": ' + b"[" * depth + b"]" * depth + b"}"


# name → (body or raw bytes, status, fragment of the message)
ATTACKS: dict[str, tuple[dict[str, Any] | bytes, int, str]] = {
    # mix weights: float32 overflow, huge, negative beyond the bound, NaN literal
    "mix-1e308": (_chat(model="math:1e308"), 400, "invalid mix"),
    "mix-1e30-sampled": (_chat(model="math:1e30", temperature=1), 400, "invalid mix"),
    "mix-over-bound": (_chat(model="math:2.5"), 400, "max_abs_mix_weight"),
    "mix-negative-huge": (_chat(model="math:0.5+code:-1e9"), 400, "invalid mix"),
    "mix-nan": (_route({"kind": "mix", "weights": {"math": "NaN"}}), 400, "weights"),
    "mix-nan-literal": (b'{"model": "math:nan", "messages": [{"role": "user", "content": "x"}]}', 400, "invalid mix"),
    "mix-inf-json": (b'{"model": "tiny-base", "messages": [{"role": "user", "content": "x"}], "molora": {"route": {"kind": "mix", "weights": {"math": Infinity}}}}', 400, "weights"),
    # learned routes: temperature underflow with sampling, top_k past the experts / the table
    "learned-temp-1e-300": (_route({**LEARNED, "temperature": 1e-300}, temperature=1), 400, "temperature"),
    "learned-temp-huge": (_route({**LEARNED, "temperature": 1e300}), 400, "temperature"),
    "learned-topk-huge": (_route({**LEARNED, "top_k": 2**63}), 400, "top_k"),
    "learned-topk-experts": (_route({**LEARNED, "top_k": 3}), 400, "top_k=3"),
    # vocab routes: int64 overflow, outside the vocabulary, overlap, negative
    "vocab-2**63": (_route({"kind": "vocab", "ranges": [{"start": 0, "end": 2**63, "adapter": "math"}]}), 400, "end"),
    "vocab-past-vocab": (_route({"kind": "vocab", "ranges": [{"start": 0, "end": 10**6, "adapter": "math"}]}), 400, "vocabulary"),
    "vocab-overlap": (_route({"kind": "vocab", "ranges": [{"start": 0, "end": 10, "adapter": "math"}, {"start": 5, "end": 20, "adapter": "code"}]}), 400, "overlap"),
    "vocab-negative": (_route({"kind": "vocab", "ranges": [{"start": -5, "end": 10, "adapter": "math"}]}), 400, "start"),
    # sampling numbers
    "seed-2**64": (_chat(seed=2**64, temperature=1), 400, "seed"),
    "seed-negative": (_chat(seed=-1, temperature=1), 400, "seed"),
    "top-k-2**100": (_chat(top_k=2**100), 400, "top_k"),
    "top-p-zero": (_chat(temperature=1, top_p=0), 400, "top_p"),
    "temperature-nan": (b'{"model": "math", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, "temperature"),
    "max-tokens-2**63": (_chat(max_tokens=2**63), 400, "max_tokens"),
    "stop-token-out-of-vocab": (_chat(stop_token_ids=[10**9]), 400, "stop_token_ids"),
    "stop-token-in-int32-but-not-vocab": (_chat(stop_token_ids=[2**31 - 1]), 400, "vocabulary"),
    "prompt-ids-huge": ({"model": "math", "prompt": [1, 2**64]}, 400, "prompt"),
    # context: prompt + max_tokens past 256 names both numbers
    "context-overflow": (_chat(messages=[{"role": "user", "content": "word " * 200}], max_tokens=100), 400, "in max_tokens"),
    # strict JSON types, body shape, Unicode
    "stream-yes": (_chat(stream="yes"), 400, "stream"),
    "max-tokens-string": (_chat(max_tokens="5"), 400, "max_tokens"),
    "temperature-bool": (_chat(temperature=True), 400, "temperature"),
    "message-name": (_chat(messages=[{"role": "user", "content": "x", "name": "eve"}]), 400, "names are not supported"),
    "deep-json": (_deep(3000), 400, "nesting"),
    "deep-json-just-over": (_deep(40), 400, "nesting"),
    "lone-surrogate": (_chat(messages=[{"role": "user", "content": "\ud800"}]), 400, "Unicode"),
    "surrogate-in-key": (b'{"model": "math", "messages": [], "\\udfff": 1}', 400, "Unicode"),
    "bad-utf8": (b'{"model": "math", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "JSON"),
    "not-an-object": (b"[1, 2, 3]", 400, "object"),
    # echo x logprobs x choices too large to send back: refused before it reaches a replica
    "echo-logprobs-n": ({"model": "math", "prompt": "word " * 2000, "echo": True, "logprobs": 20, "n": 16, "max_tokens": 1}, 400, "prompt logprob entries"),
    # adapters that cannot be served: 4xx naming the adapter and the reason, never a 200
    "adapter-nan": (_chat(model="nanad"), 400, "'nanad@v1'"),
    "adapter-nan-in-mix": (_chat(model="math:0.5+nanad:0.5"), 400, "NaN or Inf"),
    "adapter-shapes": (_chat(model="shapes"), 400, "(4, 65)"),
    "adapter-foreign-base": (_chat(model="foreign"), 400, "Qwen/Qwen3-8B"),
    "adapter-rank": (_chat(model="bigrank"), 400, "max_rank=16"),
}  # fmt: skip


async def _fire(http: httpx.AsyncClient, name: str) -> None:
    body, status, needle = ATTACKS[name]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else CHAT
    resp = await http.post(path, content=raw, headers={"content-type": "application/json"})
    err = _assert_openai_error(resp, status, needle)
    assert "engine failure" not in err["message"] and "internal" not in err["message"]
    if isinstance(body, dict) and name.startswith("adapter-"):
        stream = await http.post(path, json={**body, "stream": True})  # same status, streamed
        _assert_openai_error(stream, status, needle)


async def test_attacks_answered_4xx_while_bystanders_stream(app_url, alone) -> None:
    async def attack() -> None:
        async with httpx.AsyncClient(base_url=app_url, timeout=120) as http:
            for name in ATTACKS:
                await _fire(http, name)

    await under_fire(app_url, alone, attack)


async def test_concurrent_attacks_share_the_batch(app_url, alone) -> None:
    """The adapter failures reach the engine's admission in the bystanders' batch, at once."""

    async def attack() -> None:
        async with httpx.AsyncClient(base_url=app_url, timeout=120) as http:
            names = [n for n in ATTACKS if n.startswith("adapter-")] * 2
            await asyncio.gather(*(_fire(http, n) for n in names))

    await under_fire(app_url, alone, attack)


def test_valid_edges_are_served(app_url) -> None:
    """The bounds are not off by one: the extreme valid values answer 200."""
    for body in (
        _chat(seed=2**64 - 1, temperature=1),
        _chat(seed=0, temperature=2, top_p=1e-9),
        _chat(temperature=1e-300, top_p=1e-300),  # below 1e-5 is greedy, no overflow
        _chat(model="math:2+code:-2"),  # negative weights are a feature, within the bound
        _route({"kind": "vocab", "ranges": [{"start": 0, "end": 49152, "adapter": "math"}]}),
        _route({**LEARNED, "temperature": 0.01, "top_k": 2}, temperature=1),
        _chat(stop_token_ids=[0, 49151]),
        _chat(messages=[{"role": "user", "content": "word " * 200}], max_tokens=100,
              molora={"allow_truncation": True}),
        _chat(messages=[{"role": "user", "content": "emoji 🧪 and 中文"}]),
    ):  # fmt: skip
        resp = httpx.post(f"{app_url}{CHAT}", json=body, timeout=120)
        assert resp.status_code == 200, (body, resp.text)
        assert resp.json()["choices"][0]["finish_reason"] in ("stop", "length")


async def test_large_echo_logprobs_served_beside_bystanders(app_url, alone) -> None:
    """8 choices (the engine's whole batch) each echoing a near-full context with 20
    alternatives per token: megabytes of items in one step travel split, and neither the
    request nor a bystander fails."""
    body = {"model": "math", "prompt": "word " * 230, "echo": True, "logprobs": 20, "n": 8,
            "max_tokens": 2, "temperature": 1, "seed": 1}  # fmt: skip

    async def attack() -> None:
        async with httpx.AsyncClient(base_url=app_url, timeout=300) as http:
            resps = await asyncio.gather(
                *(http.post("/v1/completions", json=body) for _ in range(2))
            )
        for resp in resps:
            assert resp.status_code == 200, resp.text[:300]
            choices = resp.json()["choices"]
            assert len(choices) == 8
            assert all(len(c["logprobs"]["top_logprobs"]) > 230 for c in choices)

    await under_fire(app_url, alone, attack)


def test_adapter_errors_counted_as_errors(ray_cluster, app_url) -> None:
    for model in ("nanad", "foreign"):
        resp = httpx.post(f"{app_url}{CHAT}", json=_chat(model=model), timeout=60)
        _assert_openai_error(resp, 400)
    wanted = metric_names.scraped(metric_names.REQUESTS)
    deadline = time.monotonic() + 60
    lines: list[str] = []
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{ray_cluster['metrics_port']}/metrics", timeout=10).text
        lines = [ln for ln in text.splitlines() if ln.startswith(wanted)]
        if all(
            any(f'adapter="{m}"' in ln and 'status="400"' in ln for ln in lines)
            for m in ("nanad", "foreign")
        ):
            break
        time.sleep(2)
    for model in ("nanad", "foreign"):
        mine = [ln for ln in lines if f'adapter="{model}"' in ln]
        assert mine and all('status="ok"' not in ln for ln in mine), mine


# ----- Hypothesis: the worst numbers in every numeric field and every route kind ----------------

WORST_INTS = [0, 1, -1, 255, 49151, 49152, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63,
              2**64 - 1, 2**64, -(2**63) - 1, 10**30]  # fmt: skip
WORST_FLOATS = [0.0, -0.0, 5e-324, 1e-300, 1e-5, 0.01, 0.5, 1.0, 2.0, 2.0000001, 100.0, 1e30,
                1e308, -1e308, float("nan"), float("inf"), float("-inf")]  # fmt: skip
numbers = st.one_of(
    st.sampled_from(WORST_INTS),
    st.sampled_from(WORST_FLOATS),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["5", True, None, [], {}]),
)
names = st.sampled_from(["math", "code", "mathcode", "ghost", "nanad", None])
routes = st.one_of(
    st.fixed_dictionaries({"kind": st.just("mix"), "weights": st.dictionaries(st.sampled_from(["math", "code"]), numbers, min_size=1)}),
    st.fixed_dictionaries(
        {"kind": st.just("vocab"), "ranges": st.lists(st.fixed_dictionaries({"start": numbers, "end": numbers, "adapter": names}), min_size=1, max_size=3)},
        optional={"default": names},
    ),
    st.fixed_dictionaries({"kind": st.just("learned"), "composition": st.just("mathcode")}, optional={"top_k": numbers, "temperature": numbers}),
    st.fixed_dictionaries({"kind": st.sampled_from(["single", "base"]), "adapter": names}),
)  # fmt: skip
bodies = st.fixed_dictionaries(
    {
        "model": st.sampled_from(["math", "tiny-base", "mathcode", "math:0.5+code:0.5", "nanad"]),
        "messages": st.just(MESSAGES),
    },
    optional={
        "max_tokens": numbers, "temperature": numbers, "top_p": numbers, "top_k": numbers,
        "seed": numbers, "stop_token_ids": st.lists(numbers, max_size=3), "stream": st.booleans(),
        "min_p": numbers, "include_stop_str_in_output": st.sampled_from([True, False, 1, None]),
        "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "messages", "__class__", "x" * 65]), numbers, max_size=2),
        "molora": st.fixed_dictionaries({}, optional={"route": routes, "allow_truncation": st.booleans()}),
    },
)  # fmt: skip


completion_bodies = st.fixed_dictionaries(
    {
        "model": st.sampled_from(["math", "tiny-base", "math:0.5+code:0.5"]),
        "prompt": st.one_of(st.text(max_size=40), st.lists(numbers, min_size=1, max_size=4), st.lists(st.text(max_size=8), max_size=2)),
    },
    optional={"max_tokens": numbers, "seed": numbers, "temperature": numbers, "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=10))},
)  # fmt: skip


def _check_answer(resp: httpx.Response, body: dict[str, Any]) -> None:
    assert resp.status_code < 500, (body, resp.text[:500])
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == resp.status_code
    elif body.get("stream") is True:
        for line in resp.text.splitlines():
            if line.startswith("data: {"):
                assert json.loads(line[6:]).get("error", {}).get("code", 200) < 500, line
    else:
        assert resp.json()["choices"][0]["finish_reason"] in ("stop", "length")


async def test_hypothesis_worst_numbers(app_url, alone) -> None:
    @settings(
        max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None
    )
    @given(body=bodies)
    def one(body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()  # NaN/Infinity literals included, as a hostile client may
        resp = httpx.post(
            f"{app_url}{CHAT}",
            content=raw,
            headers={"content-type": "application/json"},
            timeout=120,
        )
        _check_answer(resp, body)

    async def attack() -> None:
        await asyncio.to_thread(one)

    await under_fire(app_url, alone, attack)


# ----- schemathesis over /openapi.json ----------------------------------------------------------


def test_openapi_documents_the_request_bodies(app_url) -> None:
    doc = httpx.get(f"{app_url}/openapi.json", timeout=30).json()
    for path, required in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")):
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert {"model", required} <= set(schema["required"])
        assert schema["properties"]["seed"]["anyOf"][0]["maximum"] >= 2**63  # JSON: a float
        assert "$ref" not in json.dumps(schema)


async def test_schemathesis_finds_no_5xx(app_url, alone) -> None:
    import schemathesis

    doc = httpx.get(f"{app_url}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(doc)
    operations = [result.ok() for result in schema.get_all_operations()]
    failures: list[str] = []
    statuses: list[int] = []
    deadline = time.monotonic() + 120

    def fuzz(operation: Any, mode: Any) -> None:
        @settings(
            max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def one(case: Any) -> None:
            if time.monotonic() > deadline:
                return
            # Sent with httpx: schemathesis's requests transport trips on this urllib3.
            kw = case.as_transport_kwargs(base_url=app_url)
            resp = httpx.request(
                kw["method"], kw["url"], headers=kw.get("headers"), params=kw.get("params") or None,
                json=kw.get("json"), content=kw.get("data"), timeout=120,
            )  # fmt: skip
            statuses.append(resp.status_code)
            if resp.status_code >= 500:
                failures.append(
                    f"{case.method} {case.path} {case.body!r} -> {resp.status_code} {resp.text[:300]}"
                )

        try:
            one()
        except Unsatisfiable:
            # Nothing sendable breaks this operation's schema (e.g. enum path parameters):
            # there is no negative case to try.
            assert mode != schemathesis.GenerationMode.POSITIVE, operation

    async def attack() -> None:
        modes = schemathesis.GenerationMode
        for operation in operations:  # valid bodies, then (POST) bodies that break the schema
            await asyncio.to_thread(fuzz, operation, modes.POSITIVE)
            if operation.method.upper() == "POST":
                await asyncio.to_thread(fuzz, operation, modes.NEGATIVE)

    await under_fire(app_url, alone, attack)
    assert not failures, failures[:5]
    assert len(statuses) >= 40 and any(400 <= c < 500 for c in statuses), statuses
