"""The gate summary's way from an engine output to the response, without a cluster: wire round
trip, its size bound, the tenant namespace kept out of names, and where the shaper puts it."""

from __future__ import annotations

import json

from deployments.api.request_models import CompletionRequest
from deployments.api.response_shape import ResponseShape
from deployments.api.shaping import Shaper
from deployments.catalog.model_names import Resolved
from deployments.protocol.wire import DeltaItem, approx_size, decode
from deployments.replica.fanout import delta_wire
from molora_runtime.engine.types import GateSummary, GenerationOutput
from molora_runtime.routes import LearnedRoute

L, K = 24, 8  # a big composition: the wire item stays small and bounded


def summary(composition: str = "acme~moe@v3") -> GateSummary:
    experts = [f"acme~e{i}@v1" for i in range(K)]
    top1 = [[1.0 / K] * K for _ in range(L)]
    return GateSummary(composition, experts, 40, L, [1 / K] * K, [1 / K] * K, 0.5, top1)


def finished(index_summary: GateSummary | None) -> GenerationOutput:
    return GenerationOutput(
        request_id="r", new_token_ids=[7], text_delta="x", finished=True,
        finish_reason="length", completion_tokens=40, gate_summary=index_summary,
    )  # fmt: skip


def test_wire_round_trip_and_size_bound() -> None:
    raw = delta_wire(finished(summary()), index=1)
    item = decode(raw)
    assert isinstance(item, DeltaItem) and item.gate_summary is not None
    assert item.gate_summary.experts[0] == "acme~e0@v1"
    assert item.gate_summary.layer_top1_share == summary().layer_top1_share
    assert len(json.dumps(raw)) <= approx_size(raw) < 64 * 1024
    assert "gate_summary" not in delta_wire(finished(None))


def shaper(stream: bool) -> Shaper:
    body = CompletionRequest.model_validate(
        {"model": "moe", "prompt": "hi", "n": 2, "stream": stream, "molora": {"gate_summary": True}}
    )
    resolved = Resolved(route=LearnedRoute(composition="acme~moe@v3"), placement_adapters=())
    return Shaper(ResponseShape.of(body, resolved, chat=False, request_id="cmpl-1"))


def test_whole_response_lists_each_choice_without_namespaces() -> None:
    items = [decode(delta_wire(finished(summary()), index=i)) for i in (1, 0)]
    out = shaper(False).full(items)
    got = out["molora"]["gate_summary"]
    assert [s["index"] for s in got] == [0, 1]
    assert got[0]["composition"] == "moe" and got[0]["version"] == "v3"
    assert [e["adapter"] for e in got[0]["experts"]] == [f"e{i}@v1" for i in range(K)]
    assert "acme" not in json.dumps(out)


def test_stream_puts_it_on_the_finishing_chunk_only() -> None:
    s = shaper(True)
    first = GenerationOutput(request_id="r", new_token_ids=[5], text_delta="a")
    head = s.delta_chunk(delta_wire(first, index=1))
    assert head is not None and "gate_summary" not in head.get("molora", {})
    last = s.delta_chunk(delta_wire(finished(summary()), index=1))
    assert last is not None
    assert last["choices"][0]["finish_reason"] == "length"
    (only,) = last["molora"]["gate_summary"]
    assert only["index"] == 1 and only["tokens"] == 40
