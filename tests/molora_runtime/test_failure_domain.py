"""Per-sequence failure domain: whatever one sequence's data does inside a step (Inf/NaN logits,
an exception in the forward, a sampler error), that sequence fails with its own clear error and
its batch-mates produce exactly the tokens they produce alone; the engine's state stays clean."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch

from molora_runtime.engine.async_engine import AsyncEngine
from molora_runtime.engine.sampling.isolation import sample_isolated
from molora_runtime.engine.types import GenerationRequest, SamplingParams
from molora_runtime.errors import NonFiniteLogitsError, SequenceStepError
from molora_runtime.lora.source import DirectorySource
from molora_runtime.routes import VocabRange, VocabRoute
from tests.molora_runtime.rt_util import (
    GOOD_ROUTES,
    engine_config,
    random_prompts,
    request,
    run_to_completion,
)

WEIGHTS = "adapter_model.safetensors"

GOOD = GOOD_ROUTES


@pytest.fixture(scope="module")
def huge(tiny_adapters: dict[str, Path], tmp_path_factory) -> Path:
    """A copy of adapter `a` under its own name; the test makes its slot's A Inf in place."""
    folder = tmp_path_factory.mktemp("huge") / "huge"
    shutil.copytree(tiny_adapters["a"], folder)
    return folder


def _poison(engine, name: str) -> None:
    """Make the shrink of `name`'s slot Inf, as a corrupted slot would (writes are bounded, so
    no adapter file can do this): its own rows' logits go non-finite, no other row reads it."""
    slot = engine.hot_set.ensure([name])[name]
    for buf in engine.hot_set.slots.buffers.values():
        (buf.A[:, slot] if buf.stacked else buf.A[slot]).fill_(float("inf"))


@pytest.fixture(scope="module")
def factory(tiny_engine_factory, tiny_adapters, huge):
    def make(**kw):
        return tiny_engine_factory(adapters={**tiny_adapters, "huge": huge}, **kw)

    return make


def _good_requests() -> list[GenerationRequest]:
    prompts = random_prompts(len(GOOD), 256, [7, 12, 9, 15], seed=99)
    return [request(rid, p, r, 10) for (rid, r), p in zip(GOOD.items(), prompts, strict=True)]


@pytest.fixture(scope="module")
def alone(factory) -> dict[str, list[int]]:
    """Each good request's tokens when it runs alone on a fresh engine."""
    out = {}
    for req in _good_requests():
        out[req.request_id] = run_to_completion(factory(), [req])[req.request_id]["tokens"]
    return out


def _assert_clean(engine, results, alone) -> None:
    for rid, tokens in alone.items():
        assert results[rid]["tokens"] == tokens, rid
        assert results[rid]["finish_reason"] == "length"
        assert results[rid]["error"] is None
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    assert not engine.hot_set.in_use()
    assert not engine.running and not engine.waiting


def _unchecked_vocab(end: int) -> VocabRoute:
    """A vocab route past every bound (as a buggy caller could build with model_construct)."""
    rng = VocabRange.model_construct(start=0, end=end, adapter="a")
    return VocabRoute.model_construct(kind="vocab", ranges=[rng], default=None)


def _run(engine, bad: list[GenerationRequest], at_step: int = 3) -> dict[str, dict]:
    """Good requests from the start, `bad` ones before step `at_step`, enqueued past
    `validate_request` (prompt ids given), as data that slipped through every bound would be."""
    results: dict[str, dict] = {}
    for req in _good_requests():
        engine.add_request(req)
    step = 0
    while engine.has_work() or step <= at_step:
        if step == at_step:
            for req in bad:
                engine.add_request(req, list(req.prompt_token_ids or []))
        for out in engine.step():
            res = results.setdefault(
                out.request_id, {"tokens": [], "outputs": [], "finish_reason": None}
            )
            assert res["finish_reason"] is None
            res["tokens"] += out.new_token_ids
            res["outputs"].append(out)
            res.update(finish_reason=out.finish_reason, error=out.error)
        step += 1
        assert step < 1000
    return results


def test_non_finite_logits_fail_only_their_sequence(factory, alone) -> None:
    engine = factory()
    _poison(engine, "huge")
    bad = [request("bad", [1, 2, 3, 4], "huge", 10)]
    results = _run(engine, bad)
    assert results["bad"]["finish_reason"] == "error"
    assert "NaN/Inf logits" in results["bad"]["error"]
    assert isinstance(results["bad"]["outputs"][-1].exception, NonFiniteLogitsError)
    _assert_clean(engine, results, alone)


def test_forward_exception_is_bisected_to_the_culprit(factory, alone) -> None:
    engine = factory()
    # int64 overflow while building the routing table: the batched forward raises.
    bad = [request("bad1", [5, 6, 7], _unchecked_vocab(2**63), 10)]
    bad.append(request("bad2", [8, 9], _unchecked_vocab(2**64), 10))
    results = _run(engine, bad)
    for rid in ("bad1", "bad2"):
        assert results[rid]["finish_reason"] == "error"
        assert results[rid]["error"].startswith("the request failed inside the model step")
        assert isinstance(results[rid]["outputs"][-1].exception, SequenceStepError)
    _assert_clean(engine, results, alone)


def test_culprit_in_prefill_and_decode_both_isolated(factory, alone) -> None:
    engine = factory(max_num_batched_tokens=16)  # prompts are chunked: prefill + decodes mix
    bad = [request("bad", list(range(1, 40)), _unchecked_vocab(2**63), 4)]
    results = _run(engine, bad, at_step=0)
    assert results["bad"]["finish_reason"] == "error"
    _assert_clean(engine, results, alone)


def test_sampling_error_fails_its_row_only() -> None:
    logits = torch.randn(4, 16)
    logits[2, 5] = float("nan")
    failed: dict[str, BaseException] = {}

    def sample(lg: torch.Tensor, rows: list[int], greedy: list[int]) -> list[int]:
        if 1 in rows:
            raise ValueError("row 1 is broken")
        assert greedy == lg[rows].argmax(-1).tolist()
        return greedy

    picks = sample_isolated(logits, ["s0", "s1", "s2", "s3"], sample, failed.__setitem__)
    assert [r for r, _ in picks] == [0, 3]
    assert picks == [(0, int(logits[0].argmax())), (3, int(logits[3].argmax()))]
    assert isinstance(failed["s2"], NonFiniteLogitsError)
    assert isinstance(failed["s1"], SequenceStepError) and "row 1 is broken" in str(failed["s1"])


def test_tiny_temperatures_are_greedy(factory) -> None:
    prompt = [3, 1, 4, 1, 5]
    greedy = run_to_completion(factory(), [request("g", prompt, "a", 6)])["g"]["tokens"]
    tiny = SamplingParams(max_tokens=6, temperature=1e-30, seed=1)
    got = run_to_completion(factory(), [request("t", prompt, "a", 6, sampling=tiny)])["t"]
    assert got["tokens"] == greedy and got["error"] is None


async def test_async_loop_survives_and_hides_other_errors(
    tiny_llama: Path, tiny_adapters, tiny_composition: Path, huge: Path, alone
) -> None:
    eng = AsyncEngine(
        engine_config(tiny_llama, max_num_seqs=8),
        DirectorySource({**tiny_adapters, "huge": huge}, {"moe": tiny_composition}),
    )
    try:

        async def consume(req: GenerationRequest):
            return [out async for out in eng.generate(req)]

        bad = request("bad-vocab", [4, 5, 6], _unchecked_vocab(2**63), 10)
        eng.engine.validate_request = lambda req: list(req.prompt_token_ids)  # let it through
        _poison(eng.engine, "huge")  # the loop is idle: nothing else touches the hot-set yet
        reqs = [*_good_requests(), request("bad-nan", [1, 2, 3], "huge", 10), bad]
        streams = await asyncio.gather(*(consume(r) for r in reqs))
        by_id = {outs[-1].request_id: outs for outs in streams}
        for rid, tokens in alone.items():
            outs = by_id[rid]
            assert [t for o in outs for t in o.new_token_ids] == tokens
            assert all(o.error is None for o in outs)
        assert by_id["bad-nan"][-1].finish_reason == "error"
        assert "NaN/Inf" in (by_id["bad-nan"][-1].error or "")
        assert "overflow" in (by_id["bad-vocab"][-1].error or "").lower()
        assert eng.healthy
        again = await consume(_good_requests()[0])
        assert [t for o in again for t in o.new_token_ids] == alone["g-a"]
    finally:
        await eng.shutdown()


async def test_loop_survives_a_step_that_fails_outside_any_sequence(
    tiny_llama: Path, tiny_adapters, tiny_composition: Path, alone
) -> None:
    """A bug outside every sequence (here: batch formation raising once) ends the requests in
    flight with a generic message, and the very next request is served normally."""
    eng = AsyncEngine(
        engine_config(tiny_llama, max_num_seqs=8),
        DirectorySource(tiny_adapters, {"moe": tiny_composition}),
    )
    form = eng.engine._form_batch
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("secret detail of some other request")
        return form()

    eng.engine._form_batch = flaky
    try:
        outs = [out async for out in eng.generate(_good_requests()[0])]
        assert outs[-1].finish_reason == "error"
        assert outs[-1].error == "internal engine error; the request was stopped"
        assert eng.healthy
        again = [out async for out in eng.generate(_good_requests()[0])]
        assert [t for o in again for t in o.new_token_ids] == alone["g-a"]
    finally:
        await eng.shutdown()
