"""response_format: a random tiny model under the grammar mask still emits valid JSON that
validates against the schema (greedy and sampled, with n > 1 siblings), and a bad schema fails
before queueing. Compiling has a time budget and a fair per-tenant queue."""

from __future__ import annotations

import asyncio
import json
import time

import jsonschema
import pytest

from molora_runtime.config import GrammarConfig
from molora_runtime.engine.structured.grammar_compiler import GrammarCompiler
from molora_runtime.engine.structured.response_format import ResponseFormat
from molora_runtime.engine.types import GenerationRequest, SamplingParams
from molora_runtime.errors import EngineOverloadedError, InvalidRequestError
from tests.molora_runtime.rt_util import build_engine, run_to_completion

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["ok", "color", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def chat_engine(tiny_chat_model):
    return lambda: build_engine(tiny_chat_model)


def _req(rid: str, fmt: ResponseFormat, **sampling) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid,
        messages=[{"role": "user", "content": "Give me JSON."}],
        sampling=SamplingParams(max_tokens=120, **sampling),
        response_format=fmt,
    )


@pytest.mark.parametrize(
    "sampling",
    [{}, {"temperature": 1.0, "seed": 3}, {"temperature": 0.8, "seed": 9, "presence_penalty": 1.0}],
)
def test_json_schema_outputs_validate(chat_engine, sampling) -> None:
    fmt = ResponseFormat(type="json_schema", json_schema=SCHEMA)
    reqs = [
        _req(f"r{i}", fmt, **{**sampling, "seed": sampling.get("seed", 0) + i}) for i in range(3)
    ]
    got = run_to_completion(chat_engine(), reqs)
    for res in got.values():
        assert res["finish_reason"] == "stop", res
        jsonschema.validate(json.loads(res["text"]), SCHEMA)


def test_json_object_is_valid_json(chat_engine) -> None:
    fmt = ResponseFormat(type="json_object")
    got = run_to_completion(chat_engine(), [_req("j", fmt, temperature=0.7, seed=1)])["j"]
    if got["finish_reason"] == "stop":
        assert isinstance(json.loads(got["text"]), dict)
    else:  # out of tokens: still a valid JSON prefix, starting an object
        assert got["text"].lstrip().startswith("{")


def test_invalid_schema_is_refused_before_queueing(chat_engine) -> None:
    engine = chat_engine()
    bad = ResponseFormat(type="json_schema", json_schema={"type": "frobnicate"})
    with pytest.raises(InvalidRequestError, match="invalid response_format schema"):
        engine.add_request(_req("x", bad))
    assert not engine.has_work()


def test_huge_schema_is_refused_within_the_compile_budget(chat_engine) -> None:
    """A 640 KB enum would take xgrammar tens of seconds: it is refused before compiling, and a
    json_object request of another tenant is served right after."""
    engine = chat_engine()
    enum = [f"value-{i:06d}" for i in range(40_000)]
    bomb = ResponseFormat(type="json_schema", json_schema={"enum": enum})
    with pytest.raises(InvalidRequestError, match="over the 65536 this server compiles"):
        engine.add_request(_req("bomb", bomb))
    assert not engine.has_work()
    got = run_to_completion(engine, [_req("j", ResponseFormat(type="json_object"))])["j"]
    assert got["error"] is None and got["text"].lstrip().startswith("{")


def _enum_schema(tag: str, n: int = 3500) -> ResponseFormat:
    """A schema near the size cap whose compile takes a noticeable time (a unique `tag` each)."""
    return ResponseFormat(
        type="json_schema",
        json_schema={"type": "object", "properties": {"k": {"enum": [f"{tag}-{i:05d}" for i in range(n)]}},
                     "required": ["k"]},
    )  # fmt: skip


def test_a_schema_over_the_time_budget_is_a_400_and_costs_nothing_else(chat_engine) -> None:
    engine = chat_engine()
    grammars = GrammarCompiler(
        engine.tokenizer, engine.grammars.vocab_size, engine.grammars.stop_ids,
        GrammarConfig(compile_budget_s=0.01),
    )  # fmt: skip
    slow = _enum_schema("slow")
    with pytest.raises(InvalidRequestError, match=r"takes longer than 0\.01 s to compile"):
        grammars.compile(slow, "evil")
    # Refused at once from then on, before any queueing.
    with pytest.raises(InvalidRequestError, match="takes longer than"):
        grammars.check(slow)
    # The engine with its default budget still serves json_object requests of anyone.
    got = run_to_completion(engine, [_req("j", ResponseFormat(type="json_object"))])["j"]
    assert got["error"] is None and got["text"].lstrip().startswith("{")


async def test_one_tenants_costly_schemas_do_not_delay_another(chat_engine) -> None:
    """evil queues six costly schemas; acme's json_object starts at the next free worker (after
    evil's first), and evil never runs two compiles at once."""
    engine = chat_engine()
    grammars = GrammarCompiler(
        engine.tokenizer, engine.grammars.vocab_size, engine.grammars.stop_ids,
        GrammarConfig(workers=2, compile_budget_s=600),
    )  # fmt: skip
    evil = [
        asyncio.create_task(grammars.compile_async(_enum_schema(f"e{i}"), "evil")) for i in range(6)
    ]
    await asyncio.sleep(0.05)  # evil's first is running, five are queued behind it
    started = len(grammars.queue.started_order)
    compiled = await grammars.compile_async(ResponseFormat(type="json_object"), "acme")
    pending = sum(not t.done() for t in evil)
    await asyncio.gather(*evil)
    order = [tenant for tenant, _ in grammars.queue.started_order]
    # acme starts at once on the free worker, or at most after one more of evil's compiles.
    assert order.index("acme") <= started + 1, (started, order)
    assert pending >= 6 - started - 1, (started, pending)
    assert grammars.new_state(compiled).allowed().any()


def test_a_tenants_queue_is_bounded(chat_engine) -> None:
    engine = chat_engine()
    grammars = GrammarCompiler(
        engine.tokenizer, engine.grammars.vocab_size, engine.grammars.stop_ids,
        GrammarConfig(workers=1, queue_per_tenant=2, compile_budget_s=600),
    )  # fmt: skip
    running = grammars.queue.submit("evil", "k0", lambda: time.sleep(0.5))
    while running.started is None:
        time.sleep(0.01)
    jobs = [running, *(grammars.queue.submit("evil", f"k{i}", lambda: None) for i in (1, 2))]
    with pytest.raises(EngineOverloadedError):
        grammars.queue.submit("evil", "k9", lambda: None)
    other = grammars.queue.submit("acme", "a", lambda: "ok")
    assert grammars.queue.wait(other, 600) == "ok"
    for job in jobs:
        grammars.queue.wait(job, 600)
