"""`molora.gate_summary` through the default test app (real Ray, real engine, tiny model, real store)."""

from __future__ import annotations

import json

import httpx
import pytest

MESSAGES = [{"role": "user", "content": "Say something."}]
SUMMARY = {"gate_summary": True, "gate_summary_layers": True}


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def stream(url: str, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def check_summary(summary: dict, index: int, tokens: int, layers: bool = True) -> None:
    assert summary["index"] == index
    assert summary["composition"] == "mathcode" and summary["version"] == "v1"
    assert summary["tokens"] == tokens
    assert [e["adapter"].split("@")[0] for e in summary["experts"]] == ["math", "code"]
    assert sum(e["share"] for e in summary["experts"]) == pytest.approx(1.0, abs=1e-5)
    assert sum(e["mean_weight"] for e in summary["experts"]) == pytest.approx(1.0, abs=1e-5)
    assert 0.0 <= summary["mean_entropy"] <= 1.0
    if not layers:
        assert "layer_top1_share" not in summary
        return
    assert len(summary["layer_top1_share"]) == summary["layers"] > 0
    for row in summary["layer_top1_share"]:
        assert len(row) == 2 and sum(row) == pytest.approx(1.0, abs=1e-5)


def test_per_choice_summaries_not_streaming(app_url):
    body = {
        "model": "mathcode", "messages": MESSAGES, "max_tokens": 5, "n": 2, "seed": 3,
        "temperature": 0.9, "ignore_eos": True, "molora": SUMMARY,
    }  # fmt: skip
    resp = post(app_url, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    summaries = data["molora"]["gate_summary"]
    assert [s["index"] for s in summaries] == [0, 1]
    for s in summaries:
        check_summary(s, s["index"], 5)
    assert data["usage"]["completion_tokens"] == 10


def test_streaming_puts_each_choice_summary_on_its_last_chunk(app_url):
    body = {
        "model": "mathcode", "prompt": "Once upon", "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "n": 2, "stream_options": {"include_usage": True},
        "molora": {"gate_summary": True},
    }  # fmt: skip
    chunks = stream(app_url, "/v1/completions", body)
    finishing = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert sorted(c["choices"][0]["index"] for c in finishing) == [0, 1]
    for chunk in finishing:
        (summary,) = chunk["molora"]["gate_summary"]
        check_summary(summary, chunk["choices"][0]["index"], 6, layers=False)
    others = [c for c in chunks if c not in finishing]
    assert all("gate_summary" not in (c.get("molora") or {}) for c in others)
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    # greedy: the streamed summary is the one the same request gets whole
    full = post(app_url, "/v1/completions", {**body, "n": 1, "stream_options": None})
    assert full.status_code == 200, full.text
    (whole,) = full.json()["molora"]["gate_summary"]
    assert whole == finishing[0]["molora"]["gate_summary"][0] | {"index": 0}


def test_explicit_learned_route_and_no_summary_unasked(app_url):
    body = {
        "model": "tiny-base", "messages": MESSAGES, "max_tokens": 3, "ignore_eos": True,
        "molora": {"route": {"kind": "learned", "composition": "mathcode", "top_k": 1},
                   "gate_summary": True},
    }  # fmt: skip
    resp = post(app_url, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    (summary,) = resp.json()["molora"]["gate_summary"]
    check_summary(summary, 0, 3, layers=False)
    experts = summary["experts"]
    assert [e["mean_weight"] for e in experts] == pytest.approx([e["share"] for e in experts])
    plain = post(
        app_url, "/v1/chat/completions", {**body, "molora": {"route": body["molora"]["route"]}}
    )
    assert plain.status_code == 200 and "gate_summary" not in plain.json()["molora"]


@pytest.mark.parametrize(
    ("model", "molora", "param", "needle"),
    [
        ("math", {"gate_summary": True}, "molora.gate_summary", "routes as 'single'"),
        ("math:0.5+code:0.5", {"gate_summary": True}, "molora.gate_summary", "'mix'"),
        ("tiny-base", {"gate_summary": True}, "molora.gate_summary", "'base'"),
        ("mathcode", {"gate_summary": "yes"}, "molora.gate_summary", "boolean"),
        ("mathcode", {"gate_summary": 1}, "molora.gate_summary", "boolean"),
        ("mathcode", {"gate_summary_layers": True}, "molora", "needs gate_summary: true"),
        ("mathcode", {"gate_summary_layer": True}, "molora.gate_summary_layer", ""),
    ],
)
def test_bad_gate_summary_requests_are_400(app_url, model, molora, param, needle):
    for stream_it in (False, True):
        body = {"model": model, "prompt": "x", "max_tokens": 2, "molora": molora}
        resp = post(app_url, "/v1/completions", {**body, "stream": stream_it})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param, error
        assert needle in error["message"], error
