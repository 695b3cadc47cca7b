"""Streamed chunks are built as plain dicts; the protocol's pydantic models stay their definition.

Many randomized streams (chat and completions; text, logprobs with top alternatives, echo, n > 1,
attribution, tool calls, images, usage, stop reasons) go through the Shaper; every chunk it writes
is rendered both ways, the dict path and its typed twin (`chunks.typed_chunk`), and the SSE bytes
must be the same and parse back into the protocol's chunk model. The plain text fast path is held
to the same bytes."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from deployments.api.chunks import ChunkFields, chunk, typed_chunk, typed_usage_chunk, usage_chunk
from deployments.api.request_models import ChatCompletionRequest, CompletionRequest
from deployments.api.response_models import ChatCompletionChunk, CompletionChunk
from deployments.api.response_shape import ResponseShape
from deployments.api.shaping import Shaper, sse
from deployments.catalog.model_names import Resolved
from deployments.protocol.wire import DeltaItem, InfoItem, UsageItem, decode
from molora_runtime.multimodal.tokens import BOI, CODE0, EOI
from molora_runtime.routes import BaseRoute, SingleRoute

WORDS = ["a", " word", "é", " ✓", "\U0001f600", '"q"', "\\", "\n", "</script>", "\u2028", ""]
TOOL_TEXT = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


class TwinShaper(Shaper):
    """Renders every chunk both ways and keeps the pairs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pairs: list[tuple[str, str]] = []

    def render(self, f: ChunkFields) -> dict[str, Any]:  # type: ignore[override]
        fast, typed = chunk(f), typed_chunk(f)
        self.pairs.append((sse(fast), sse(typed)))
        return fast

    def render_usage(self, *args: Any) -> dict[str, Any]:  # type: ignore[override]
        fast, typed = usage_chunk(*args), typed_usage_chunk(*args)
        self.pairs.append((sse(fast), sse(typed)))
        return fast


def _body(rng: random.Random, chat: bool) -> tuple[Any, bool]:
    body: dict[str, Any] = {"model": "base", "stream": True, "n": rng.choice([1, 1, 2, 3])}
    if rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.4:
        body["molora"] = {"return_attribution": True}
    if rng.random() < 0.3:
        body["molora"] = {**body.get("molora", {}), "gate_summary": True}
    images = False
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
        if rng.random() < 0.5:
            body["logprobs"] = True
            body["top_logprobs"] = rng.choice([0, 1, 3])
        if rng.random() < 0.3:
            body["tools"] = TOOLS
        images = rng.random() < 0.3
        return ChatCompletionRequest.model_validate(body), images
    body["prompt"] = rng.choice(["hi", "two words", "é ✓"])
    if rng.random() < 0.5:
        body["logprobs"] = rng.choice([0, 1, 3])
    if rng.random() < 0.3:
        body["echo"] = True
    return CompletionRequest.model_validate(body), False


def _logprob(rng: random.Random, tops: int, first_prompt: bool = False) -> dict[str, Any]:
    value = None if first_prompt else rng.choice([-0.25, -1e-9, float("-inf"), -3.5, 0.0])
    top = [
        {"token_id": rng.randrange(100), "token": rng.choice(WORDS), "logprob": -rng.random()}
        for _ in range(0 if first_prompt else tops)
    ]
    return {"token_id": rng.randrange(100), "token": rng.choice(WORDS), "logprob": value,
            "top": top}  # fmt: skip


def _delta(rng: random.Random, index: int, k: int, last: bool, opts: dict) -> dict[str, Any]:
    ids = [rng.randrange(1000) for _ in range(rng.choice([1, 1, 2]))]
    if opts["images"] and rng.random() < 0.4:
        ids = [BOI, *(CODE0 + rng.randrange(16) for _ in range(rng.choice([3, 16]))), EOI]
    text = "".join(rng.choice(WORDS) for _ in ids)
    if opts["tools"] and k == 1:
        text = TOOL_TEXT
    raw: dict[str, Any] = {"type": "delta", "index": index, "text": text, "token_ids": ids,
                           "finish_reason": None}  # fmt: skip
    if last:
        raw["finish_reason"] = rng.choice(["stop", "length", "abort"])
        stop = rng.choice([None, "END", 7])
        if raw["finish_reason"] == "stop" and stop is not None:
            raw["stop_reason"] = stop
    if last and opts["gate_summary"]:
        raw["gate_summary"] = {
            "composition": "acme~moe@v2", "experts": ["acme~e0@v1", "e1@v3"], "tokens": k + 1,
            "layers": 2, "share": [0.625, 0.375], "mean_weight": [0.5, 0.25],
            "mean_entropy": rng.random(),
            "layer_top1_share": rng.choice([None, [[1.0, 0.0], [0.5, 0.5]]]),
        }  # fmt: skip
    if opts["attribution"]:
        raw["attribution"] = [{"token_id": t, "adapters": {"math": 0.75, "code": 0.25}}
                              for t in ids]  # fmt: skip
    if opts["logprobs"]:
        raw["logprobs"] = [_logprob(rng, opts["tops"]) for _ in ids]
    if opts["echo"] and k == 0:
        raw["prompt_logprobs"] = [_logprob(rng, opts["tops"], i == 0) for i in range(3)]
    return raw


def _stream(rng: random.Random, shaper: Shaper, body: Any, images: bool) -> list[Any]:
    """A stream as the router sees it: the head typed (info, the first delta), the rest wire
    dicts, choices interleaved, usage last."""
    tops = body.top_logprobs_wanted() or 0
    opts = {"images": images, "tools": shaper.tools is not None, "tops": tops,
            "attribution": shaper.attribution, "logprobs": shaper.want_logprobs,
            "echo": shaper.echo, "gate_summary": body.molora.gate_summary}  # fmt: skip
    lengths = {i: rng.randrange(1, 7) for i in range(shaper.best_of)}
    seen = dict.fromkeys(lengths, 0)
    items: list[Any] = [InfoItem(replica="r1", hot_set_hit=rng.random() < 0.5, tier="slot")]
    while any(seen[i] < lengths[i] for i in lengths):
        i = rng.choice([i for i in lengths if seen[i] < lengths[i]])
        raw = _delta(rng, i, seen[i], seen[i] == lengths[i] - 1, opts)
        seen[i] += 1
        items.append(decode(raw) if len(items) == 1 else raw)
    items.append(UsageItem(prompt_tokens=3, completion_tokens=sum(lengths.values())))
    return items


@pytest.mark.parametrize("seed", range(300))
def test_dict_chunks_are_the_typed_chunks(seed: int) -> None:
    rng = random.Random(seed)
    chat = seed % 2 == 0
    body, images = _body(rng, chat)
    route = SingleRoute(adapter="math@3") if rng.random() < 0.5 else BaseRoute()
    resolved = Resolved(route=route, placement_adapters=())
    shaper = TwinShaper(
        ResponseShape.of(body, resolved, chat, f"cmpl-{seed}", images, rng.random() < 0.5)
    )
    shaper.plain = False  # every chunk through the renderers (the fast path: below)
    written = [shaper.sse(item) for item in _stream(rng, shaper, body, images)]
    if shaper.include_usage:
        written.append(sse(shaper.usage_chunk()))
    assert shaper.pairs and len(shaper.pairs) == sum(1 for w in written if w)
    model = ChatCompletionChunk if chat else CompletionChunk
    for fast, typed in shaper.pairs:
        assert fast == typed
        assert fast.startswith("data: ") and fast.endswith("\n\n")
        assert model.model_validate_json(fast[6:]).id == f"cmpl-{seed}"
    assert [w for w in written if w] == [fast for fast, _ in shaper.pairs]


@pytest.mark.parametrize("chat", [True, False])
def test_the_plain_path_writes_the_typed_bytes(chat: bool) -> None:
    rng = random.Random(7)
    body = {"model": "base", "stream": True}
    if chat:
        req: Any = ChatCompletionRequest.model_validate(
            {**body, "messages": [{"role": "user", "content": "x"}]}
        )
    else:
        req = CompletionRequest.model_validate({**body, "prompt": "x"})
    resolved = Resolved(route=BaseRoute(), placement_adapters=())
    shape = ResponseShape.of(req, resolved, chat, "cmpl-p")
    fast, twin = Shaper(shape), TwinShaper(shape)
    twin.created = fast.created
    twin.plain = False
    head = DeltaItem(text="first", token_ids=[1])
    assert fast.sse(head) == twin.sse(head)
    for _ in range(200):
        text = "".join(rng.choice(WORDS) for _ in range(rng.randrange(3)))
        raw = {"type": "delta", "index": 0, "text": text, "token_ids": [5], "finish_reason": None}
        assert fast.sse(raw) == twin.sse(raw)
    json.loads(fast.sse(head)[6:])  # still one JSON event
