"""`AsyncEngine`: streamed increments concatenate to the offline result; closing the stream early
frees the KV row and hot-set refs; per-token attribution lists the adapters behind each token."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from molora_runtime.engine.async_engine import AsyncEngine
from molora_runtime.engine.types import StepOutputs
from molora_runtime.lora.source import DirectorySource
from molora_runtime.routes import LearnedRoute, MixRoute
from tests.molora_runtime.rt_util import build_engine, engine_config, request, run_to_completion


@pytest.fixture
async def chat_async(tiny_chat_model: Path, tmp_path: Path):
    from tests.molora_runtime.rt_util import make_peft_adapter

    ad = {"a": make_peft_adapter(tiny_chat_model, tmp_path / "a", r=4, alpha=8, seed=1)}
    eng = AsyncEngine(engine_config(tiny_chat_model, max_num_seqs=4), DirectorySource(ad))
    yield eng, ad
    await eng.shutdown()


@pytest.fixture
async def tiny_async(tiny_llama: Path, tiny_adapters, tiny_composition: Path):
    eng = AsyncEngine(
        engine_config(tiny_llama, max_num_seqs=4),
        DirectorySource(tiny_adapters, {"moe": tiny_composition}),
    )
    yield eng
    await eng.shutdown()


async def test_stream_concatenates_to_offline_result(chat_async, tiny_chat_model: Path) -> None:
    eng, ad = chat_async
    reqs = [
        request("x", None, "a", 16, prompt="Streaming works like"),
        request("y", None, None, 12, messages=[{"role": "user", "content": "Hi!"}]),
    ]

    async def consume(req):
        outs = [out async for out in eng.generate(req)]
        return outs

    streams = await asyncio.gather(*(consume(r) for r in reqs))
    offline = run_to_completion(build_engine(tiny_chat_model, ad, max_num_seqs=4), reqs)
    for req, outs in zip(reqs, streams, strict=True):
        assert outs[-1].finished and sum(o.finished for o in outs) == 1
        assert "".join(o.text_delta for o in outs) == offline[req.request_id]["text"]
        assert [t for o in outs for t in o.new_token_ids] == offline[req.request_id]["tokens"]
        assert outs[-1].finish_reason == offline[req.request_id]["finish_reason"]


async def _wait_idle(eng: AsyncEngine) -> None:
    for _ in range(2000):
        if not eng.engine.has_work():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the engine never became idle")


async def test_closing_the_stream_frees_row_and_refs(tiny_async) -> None:
    eng = tiny_async
    core = eng.engine
    blocks = core.block_manager
    for route in ("a", MixRoute(weights={"b": 0.5, "c": 0.5}), LearnedRoute(composition="moe")):
        gen = eng.generate(request("x", [1, 2, 3, 4], route, 200))
        got = 0
        async for out in gen:
            got += len(out.new_token_ids)
            assert any(s.request_id == "x" for s in core.running)
            assert blocks.num_used == 1  # 4 prompt tokens + a few outputs: one block
            assert core.hot_set.in_use()
            if got >= 3:
                break
        await gen.aclose()
        await _wait_idle(eng)
        assert not core.running and not core.waiting
        assert blocks.num_used == 0 and blocks.num_free == blocks.num_blocks
        assert not core.hot_set.in_use()
        assert eng.stats().running == 0 and eng.stats().waiting == 0
    # the engine still serves afterwards
    outs = [o async for o in eng.generate(request("z", [5, 6], "a", 3))]
    assert outs[-1].finish_reason == "length"


async def _attribution(eng: AsyncEngine, route, n: int = 6):
    req = request("att", [3, 1, 4, 1, 5], route, n, return_attribution=True)
    outs = [o async for o in eng.generate(req)]
    att = [a for o in outs for a in (o.attribution or [])]
    assert [a.token_id for a in att] == [t for o in outs for t in o.new_token_ids]
    assert len(att) == n
    return att


async def test_attribution_per_token(tiny_async) -> None:
    eng = tiny_async
    for a in await _attribution(eng, "b"):
        assert a.adapters == {"b": 1.0}
    for a in await _attribution(eng, MixRoute(weights={"a": 0.7, "c": 0.3})):
        assert a.adapters == pytest.approx({"a": 0.7, "c": 0.3})
    for a in await _attribution(eng, None):
        assert a.adapters == {}
    seen: set[str] = set()
    for a in await _attribution(eng, LearnedRoute(composition="moe"), n=10):
        assert set(a.adapters) <= {"a", "b", "c"} and a.adapters
        assert sum(a.adapters.values()) == pytest.approx(1.0, abs=1e-3)
        assert all(0 <= w <= 1 for w in a.adapters.values()), a.adapters  # 4-digit rounding
        seen |= set(a.adapters)
    assert len(seen) >= 2  # top-2 of 3: more than one expert serves the tokens
    gate_stats = eng.pop_gate_stats()
    assert set(gate_stats) == {"moe"}
    assert len(gate_stats["moe"]) == eng.engine.arch.num_layers


class _Recorder:
    """A step sink that keeps every batch it was handed (what the replica's fanout gets)."""

    def __init__(self) -> None:
        self.steps: list[StepOutputs] = []
        self.failures: list[BaseException] = []

    def on_step(self, step: StepOutputs) -> None:
        self.steps.append(step)

    def on_failure(self, exc: BaseException) -> None:
        self.failures.append(exc)


async def test_a_sink_gets_each_step_as_one_batch(chat_async, tiny_chat_model: Path) -> None:
    eng, ad = chat_async
    sink = _Recorder()
    eng.add_sink(sink)
    reqs = [
        request("s1", None, "a", 10, prompt="Batches carry"),
        request("s2", None, None, 14, messages=[{"role": "user", "content": "Hi!"}]),
    ]
    await eng.submit(reqs)
    await _wait_idle(eng)
    for _ in range(200):  # the last step's callback runs on the loop after the thread idles
        if sum(o.finished for s in sink.steps for o in s) == 2:
            break
        await asyncio.sleep(0.01)
    assert all(isinstance(s, StepOutputs) for s in sink.steps)
    # one object per step for every request: while both decode, each step holds both
    assert any({o.request_id for o in s} == {"s1", "s2"} for s in sink.steps)
    assert all(len({o.request_id for o in s}) == len(s) for s in sink.steps)
    offline = run_to_completion(build_engine(tiny_chat_model, ad, max_num_seqs=4), reqs)
    for req in reqs:
        outs = [o for s in sink.steps for o in s if o.request_id == req.request_id]
        assert sum(o.finished for o in outs) == 1 and outs[-1].finished
        assert "".join(o.text_delta for o in outs) == offline[req.request_id]["text"]
        assert [t for o in outs for t in o.new_token_ids] == offline[req.request_id]["tokens"]
    assert not sink.failures


async def test_submit_refuses_a_bad_request_and_queues_none(chat_async) -> None:
    eng, _ = chat_async
    good = request("g", None, None, 4, prompt="fine")
    bad = request("b", None, "no-such-adapter", 4, prompt="fine")
    with pytest.raises(Exception, match="no-such-adapter"):
        await eng.submit([good, bad])
    assert not eng.engine.waiting and not eng.engine.running
