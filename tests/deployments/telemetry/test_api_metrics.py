"""`GET /metrics` on the API port: the router's and replicas' series merged from Ray's exporter,
vLLM's names where the meaning is vLLM's, bounded labels (1,000 distinct mixes add no label
value), nothing of Ray's own."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter

import httpx
import pytest

from tests.deployments.serve_helpers import openai_client, serving, shipped_args

MESSAGES = [{"role": "user", "content": "Count from one to twenty, slowly please."}]
E2E_COUNT = "vllm:e2e_request_latency_seconds_count"
LABEL = re.compile(r'(\w+)="([^"]*)"')
VLLM_SERIES = (
    "vllm:num_requests_running{",
    "vllm:num_requests_waiting{",
    "vllm:kv_cache_usage_perc{",
    "vllm:prefix_cache_queries_total{",
    "vllm:prefix_cache_hits_total{",
    "vllm:request_queue_time_seconds_bucket{",
    "vllm:e2e_request_latency_seconds_bucket{",
    "vllm:time_to_first_token_seconds_bucket{",
    "vllm:inter_token_latency_seconds_bucket{",
    "vllm:prompt_tokens_total{",
    "vllm:generation_tokens_total{",
    "molora_requests_total{",
    "molora_tokens_total{",
)


@pytest.fixture(scope="module")
def app_url(ray_cluster, tiny_assets):
    args = shipped_args(tiny_assets, engine={"max_num_seqs": 8}, server={"default_max_tokens": 4})
    yield from serving(ray_cluster, args, replicas=1, max_ongoing=64)


def _scrape_until(url: str, done, timeout: float = 90) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        resp = httpx.get(f"{url}/metrics", timeout=10)
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
        text = resp.text
        if done(text):
            return text
        time.sleep(2)
    return text


def _lora_counts(text: str) -> Counter[str]:
    """The e2e histogram's count per `lora_name`, summed over its series (a router that an
    earlier module's app ran keeps its own series beside this one's)."""
    counts: Counter[str] = Counter()
    for labels, value in _samples(text, E2E_COUNT):
        counts[labels["lora_name"]] += value
    return counts


def _samples(text: str, prefix: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        if line.startswith(prefix + "{"):
            labels, value = line[len(prefix) :].rsplit(" ", 1)
            out.append((dict(LABEL.findall(labels)), float(value)))
    return out


def test_vllm_named_series_on_the_api_port(app_url) -> None:
    client = openai_client(app_url)

    def exported(t: str) -> bool:  # Ray exports in windows: wait for every series and count
        counts = _lora_counts(t)
        return (
            all(s in t for s in VLLM_SERIES)
            and counts["math"] >= before + 2
            and counts["mathcode"] >= 1
        )

    first = httpx.get(f"{app_url}/metrics", timeout=10).text
    before = _lora_counts(first)["math"]
    counted = {tuple(sorted(labels.items())): v for labels, v in _samples(first, E2E_COUNT)}
    for _ in range(2):  # the same prompt twice: the second hits the prefix cache
        client.chat.completions.create(model="math", messages=MESSAGES, max_tokens=6)
    stream = client.chat.completions.create(
        model="mathcode", messages=MESSAGES, max_tokens=6, stream=True
    )
    assert sum(1 for _ in stream) > 2
    text = _scrape_until(app_url, exported)
    missing = [s for s in VLLM_SERIES if s not in text]
    assert not missing, (missing, text[:3000])
    assert "ray_" not in text  # Ray's prefix and Ray's own families stay on Ray's exporter
    types = dict(ln.split(" ")[2:4] for ln in text.splitlines() if ln.startswith("# TYPE"))
    assert types["vllm:e2e_request_latency_seconds"] == "histogram"
    assert types["vllm:num_requests_running"] == "gauge"
    assert types["vllm:prompt_tokens_total"] == "counter"
    helps = [ln.split(" ")[2] for ln in text.splitlines() if ln.startswith("# HELP")]
    assert len(helps) == len(set(helps))  # one family header however many nodes / processes
    e2e = _samples(text, E2E_COUNT)
    by_lora = _lora_counts(text)
    assert by_lora["math"] >= before + 2 and by_lora["mathcode"] >= 1, e2e
    # The series these requests moved name this app's served base model (earlier modules' apps
    # on the shared cluster keep their own series, with their own labels, beside them).
    moved = [lab for lab, v in e2e if v > counted.get(tuple(sorted(lab.items())), 0.0)]
    ours = [lab for lab in moved if lab.get("lora_name") in ("math", "mathcode")]
    assert all(lab.get("model_name") for lab in ours), moved
    assert any(lab["model_name"] == "tiny-base" for lab in ours), moved
    hits = sum(v for _, v in _samples(text, "vllm:prefix_cache_hits_total"))
    assert hits > 0
    kv = _samples(text, "vllm:kv_cache_usage_perc")
    assert kv and all(0.0 <= v <= 1.0 for _, v in kv)


def _count(text: str, family: str, **labels: str) -> float:
    """A histogram's `_count` summed over the series whose labels include `labels`."""
    return sum(
        v
        for lab, v in _samples(text, family + "_count")
        if all(lab.get(k) == want for k, want in labels.items())
    )


def test_latency_histograms_count_every_token(app_url) -> None:
    """Inter-token latencies are recorded in bulk, yet one per token: after streams of known
    length, TTFT counts one per request and ITL one per token after the first."""
    families = (
        ("vllm:time_to_first_token_seconds", {"lora_name": "code"}),
        ("vllm:inter_token_latency_seconds", {"lora_name": "code"}),
        ("molora_ttft_seconds", {"route_kind": "single"}),
        ("molora_inter_token_latency_seconds", {"route_kind": "single"}),
    )
    before = _scrape_until(app_url, lambda t: "vllm:inter_token_latency_seconds_count{" in t)
    base = [_count(before, f, **lab) for f, lab in families]
    client = openai_client(app_url)
    requests, tokens = 3, 0
    for _ in range(requests):
        stream = client.chat.completions.create(
            model="code", messages=MESSAGES, max_tokens=9, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        usage = [c.usage for c in stream if c.usage is not None]
        tokens += usage[-1].completion_tokens
    assert tokens > requests
    want = [requests, tokens - requests, requests, tokens - requests]

    def added(text: str) -> list[float]:
        return [_count(text, f, **lab) - b for (f, lab), b in zip(families, base, strict=True)]

    def counted(text: str) -> bool:
        # `code` is this test's alone; route kind `single` may still take in earlier tests'
        # requests that Ray had not exported yet
        got = added(text)
        return got[:2] == want[:2] and all(g >= w for g, w in zip(got[2:], want[2:], strict=True))

    after = _scrape_until(app_url, counted)
    assert counted(after), (added(after), want)


async def _mixes(url: str, count: int) -> list[int]:
    sem = asyncio.Semaphore(8)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(i: int) -> int:
            w = (i + 1) / (count + 2)
            body = {
                "model": f"math:{w:.6f}+code:{1 - w:.6f}",
                "prompt": "1 2 3",
                "max_tokens": 1,
            }
            async with sem:
                return (await client.post("/v1/completions", json=body)).status_code

        return await asyncio.gather(*(one(i) for i in range(count)))


def test_a_thousand_mixes_add_no_label_values(app_url) -> None:
    def label_values(text: str) -> set[str]:
        return {lab["adapter"] for lab, _ in _samples(text, "molora_requests_total")}

    before = _scrape_until(app_url, lambda t: "molora_requests_total{" in t)
    statuses = asyncio.run(_mixes(app_url, 1000))
    assert statuses.count(200) == 1000, {s: statuses.count(s) for s in set(statuses)}

    def counted(text: str) -> bool:
        mix = [v for lab, v in _samples(text, "molora_requests_total") if lab["adapter"] == "mix"]
        return sum(mix) >= 1000

    after = _scrape_until(app_url, counted)
    assert counted(after)
    # The cluster is shared: earlier modules' adapter names can reach Ray's exporter after
    # `before` was read, so the check is that the 1,000 mixes add no value of their own (a mix's
    # name holds a `+`) and far fewer values than mixes.
    _few_and_no_mix(label_values(after) - label_values(before))
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total"):
        added = {lab["lora_name"] for lab, _ in _samples(after, name)} - {
            lab["lora_name"] for lab, _ in _samples(before, name)
        }
        _few_and_no_mix(added - {""})


def _few_and_no_mix(added: set[str]) -> None:
    assert not any("+" in value or ":" in value for value in added), added
    assert len(added - {"mix"}) < 100, added  # per-mix values would be ~1,000
