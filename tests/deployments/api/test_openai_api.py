"""The OpenAI client against the running app (real Ray, real engine, tiny model, real store)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from deployments.telemetry import metric_names
from tests.deployments.serve_helpers import (
    model_handle,
    open_stream,
    serving,
    shipped_args,
    whole_chat_seconds,
)

MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def app_url(ray_cluster, tiny_assets):
    args = shipped_args(
        tiny_assets,
        # a KV budget below max_model_len: 240 tokens of fp32 K/V (2 layers x 2 heads x 16 dims),
        # still room for the 33-token chat prompt + 200 tokens the disconnect test asks for
        engine={
            "max_num_seqs": 2,
            "max_queue_len": 2,
            "max_model_len": 256,
            "kv_cache_bytes": 240 * 512,
        },
        server={"default_max_tokens": 16},
        expose={
            "routes": {
                "math-then-code": {
                    "kind": "vocab",
                    "ranges": [{"start": 0, "end": 30000, "adapter": "math"}],
                    "default": "code",
                }
            }
        },
    )
    yield from serving(ray_cluster, args, replicas=1, max_ongoing=16)


def test_models_lists_the_registry(client):
    cards = {m.id: m for m in client.models.list().data}
    assert {"tiny-base", "math", "code", "poem", "chat", "mathcode", "math-then-code"} <= set(cards)
    extra = cards["mathcode"].model_extra["molora"]
    assert extra["kind"] == "composition"
    assert [a.split("@")[0] for a in extra["adapters"]] == ["math", "code"]
    assert cards["math"].model_extra["molora"]["versions"] == ["v1"]


@pytest.mark.parametrize(
    "model", ["math", "math@v1", "math:0.7+code:0.3", "mathcode", "tiny-base", "math-then-code"]
)
def test_chat_completion(client, model):
    resp = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=6, temperature=0
    )
    assert resp.model == model
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert 0 < resp.usage.completion_tokens <= 6
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    kind = {
        "math": "single",
        "math@v1": "single",
        "mathcode": "learned",
        "tiny-base": "base",
        "math-then-code": "vocab",
    }
    assert resp.model_extra["molora"]["route_kind"] == kind.get(model, "mix")


def test_adapters_change_the_output(client):
    outs = {
        m: client.completions.create(
            model=m, prompt="The", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for m in ("tiny-base", "math", "code")
    }
    assert len(set(outs.values())) == 3


@pytest.mark.parametrize("model", ["code", "math:0.5+poem:0.5", "mathcode"])
def test_streaming_chat(client, model):
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 8
    # Same text as the non-streaming call (greedy).
    full = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert text == full.choices[0].message.content


def test_completions_streaming_and_not(client):
    full = client.completions.create(
        model="poem",
        prompt="Once upon",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert full.object == "text_completion" and full.usage.completion_tokens == 5
    parts = list(
        client.completions.create(
            model="poem",
            prompt="Once upon",
            max_tokens=5,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(p.choices[0].text for p in parts) == full.choices[0].text
    ids = client.completions.create(model="poem", prompt=[1, 2, 3, 4], max_tokens=3)
    assert ids.usage.prompt_tokens == 4


def test_attribution_per_token(client):
    resp = client.chat.completions.create(
        model="math:0.75+code:0.25", messages=MESSAGES, max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True, "molora": {"return_attribution": True}},
    )  # fmt: skip
    attribution = resp.model_extra["molora"]["attribution"]
    assert len(attribution) == 4
    # Attribution names the exact versions the router pinned the mix to.
    assert attribution[0]["adapters"] == {"math@v1": 0.75, "code@v1": 0.25}
    assert resp.model_extra["molora"]["versions"] == ["math@v1", "code@v1"]
    learned = client.chat.completions.create(
        model="tiny-base", messages=MESSAGES, max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True, "molora": {"route": {"kind": "learned", "composition": "mathcode"}, "return_attribution": True}},
    )  # fmt: skip
    assert learned.model_extra["molora"]["route_kind"] == "learned"
    for token in learned.model_extra["molora"]["attribution"]:
        assert {a.split("@")[0] for a in token["adapters"]} <= {"math", "code"}


def _post(url, path, body, raw=None):
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(
        f"{url}{path}", content=content, headers={"content-type": "application/json"}, timeout=60
    )


@pytest.mark.parametrize(
    ("body", "status", "param", "needle"),
    [
        ({"model": "ghost", "prompt": "x"}, 404, "model", "does not exist"),
        ({"model": "math@v7", "prompt": "x"}, 404, "model", "no version"),
        ({"model": "math:0.5+ghost:0.5", "prompt": "x"}, 404, "model", "ghost"),
        ({"model": "math:abc", "prompt": "x"}, 400, "model", "not a number"),
        (
            {"model": "math", "prompt": "x", "max_tokens": 0},
            400,
            "max_tokens",
            "greater than or equal to 1",
        ),
        (
            {"model": "math", "prompt": "x", "temperature": 5},
            400,
            "temperature",
            "less than or equal",
        ),
        ({"model": "math", "prompt": "x", "n": 17}, 400, "n", ""),
        ({"model": "math", "prompt": "x", "frobnicate": 1}, 400, "frobnicate", "unknown parameter"),
        ({"model": "math", "prompt": ""}, 400, "prompt", "empty"),
        ({"model": "math", "prompt": [1, 99999999]}, 400, None, "vocabulary"),
        ({"prompt": "x"}, 400, "model", "Field required"),
        (
            {
                "model": "tiny-base",
                "prompt": "x",
                "molora": {"route": {"kind": "single", "adapter": "ghost"}},
            },
            404,
            "molora.route",
            "ghost",
        ),
        (
            {"model": "tiny-base", "prompt": "x", "molora": {"route": {"kind": "telepathy"}}},
            400,
            None,
            "kind",
        ),
    ],
)
def test_bad_inputs_get_openai_errors(app_url, body, status, param, needle):
    resp = _post(app_url, "/v1/completions", body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if param is not None:
        assert err["param"] == param
    assert needle in err["message"]


def test_malformed_json_and_bad_messages(app_url):
    resp = _post(app_url, "/v1/chat/completions", None, raw=b"{not json")
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]
    resp = _post(
        app_url,
        "/v1/chat/completions",
        {"model": "math", "messages": [{"role": "wizard", "content": "x"}]},
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"].startswith("messages.0.role")
    resp = _post(app_url, "/v1/chat/completions", {"model": "math", "messages": []})
    assert resp.status_code == 400
    assert httpx.get(f"{app_url}/v1/nothing").status_code == 404


def test_too_long_prompt_names_the_limit(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="math", prompt="word " * 400, max_tokens=4)
    assert "limit is 256 tokens" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="math", messages=[{"role": "user", "content": "word " * 400}], stream=True
        )


def test_request_longer_than_the_kv_budget_is_a_400(client):
    """Within max_model_len but past the whole KV budget: refused up front, never admitted."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="math", prompt="word " * 180, max_tokens=70)
    assert "whole KV budget holds 240 tokens" in info.value.body["message"]
    ok = client.completions.create(model="math", prompt="word " * 100, max_tokens=8)
    assert ok.choices[0].finish_reason in ("stop", "length")


async def test_overload_gets_429_with_retry_after(app_url):
    # 2 running + 2 waiting fit; the rest are refused by the engine's queue bound.
    body = {"model": "math", "prompt": "go", "max_tokens": 120, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=app_url, timeout=120) as http:
        responses = await asyncio.gather(
            *(http.post("/v1/completions", json=body) for _ in range(10))
        )
    statuses = [r.status_code for r in responses]
    assert statuses.count(200) >= 4
    refused = [r for r in responses if r.status_code == 429]
    assert refused, statuses
    # Estimated from this ingress' queue and recent request times, in whole seconds.
    assert 1 <= int(refused[0].headers["retry-after"]) <= 60
    assert refused[0].json()["error"]["type"] == "rate_limit_error"


async def _engine_idle(timeout: float = 30) -> dict:
    handle = model_handle()
    deadline = time.monotonic() + timeout
    while True:
        stats = await handle.stats.remote()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still busy: {stats}")
        await asyncio.sleep(0.2)


async def test_client_disconnect_frees_the_request(app_url):
    await _engine_idle()
    body = {"model": "code", "messages": MESSAGES, "max_tokens": 200, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=app_url, timeout=60) as http:
        full_s = await whole_chat_seconds(http, body, 200)
        async with open_stream(http, body):
            pass
        # The connection is closed mid-stream: the engine must drop the request at once.
        closed = time.monotonic()
    await _engine_idle(timeout=2 * full_s)
    freed_s = time.monotonic() - closed
    # Left running, the request would need about full_s more; freed, it ends within a few steps.
    assert freed_s < 0.8 * full_s, (freed_s, full_s)


async def test_streams_come_through_the_routers_channel_unchanged(app_url):
    """Once a request has met the replica, the router's stream channel is attached there and
    later streams ride it: token for token what the same request answers unstreamed."""
    body = {
        "model": "math",
        "messages": MESSAGES,
        "max_tokens": 24,
        "ignore_eos": True,
        "temperature": 0,
    }
    async with httpx.AsyncClient(base_url=app_url, timeout=60) as http:
        full = (await http.post("/v1/chat/completions", json=body)).json()
        deadline = time.monotonic() + 30
        while (await model_handle().stats.remote())["stream_channels"] < 1:
            assert time.monotonic() < deadline, "no stream channel attached"
            await asyncio.sleep(0.1)
        text, chunks = "", 0
        async with http.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True}
        ) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[6:])["choices"]
                    text += "".join(c["delta"].get("content") or "" for c in choices)
                    chunks += 1
    assert text == full["choices"][0]["message"]["content"]
    assert chunks >= 10  # token by token, not one lump at the end


def test_health(app_url):
    resp = httpx.get(f"{app_url}/health")
    assert resp.status_code == 200 and resp.json()["status"] == "ok"


def test_metrics_are_exported(ray_cluster, client):
    client.chat.completions.create(
        model="mathcode", messages=MESSAGES, max_tokens=4, stream=True
    ).close()
    client.chat.completions.create(model="mathcode", messages=MESSAGES, max_tokens=4)
    wanted = [
        metric_names.scraped(n)
        for n in (
            metric_names.REQUESTS,
            metric_names.TOKENS,
            metric_names.TTFT,
            metric_names.HOTSET_LOADS,
            metric_names.QUEUE_LENGTH,
            metric_names.GATE_TOKENS,
            metric_names.PLACEMENTS,
        )
    ]
    deadline = time.monotonic() + 60
    text = ""
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{ray_cluster['metrics_port']}/metrics", timeout=10).text
        if all(w in text for w in wanted):
            break
        time.sleep(2)
    missing = [w for w in wanted if w not in text]
    assert not missing, missing
    assert 'route_kind="learned"' in text
