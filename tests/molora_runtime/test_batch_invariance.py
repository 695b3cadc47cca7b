"""A request's greedy output is the same alone and inside a batch of 16 mixed-route requests, and
requests joining and leaving mid-decode (driven through `add_request`/`step`) change nothing."""

from __future__ import annotations

import pytest

from molora_runtime.routes import LearnedRoute, MixRoute, VocabRoute
from tests.molora_runtime.rt_util import random_prompts, request, run_to_completion

VOCAB = VocabRoute(
    ranges=[{"start": 0, "end": 128, "adapter": "b"}, {"start": 128, "end": 256, "adapter": "c"}]
)
ROUTES = [
    "a",
    "b",
    "c",
    None,
    MixRoute(weights={"a": 0.5, "c": 0.5}),
    VOCAB,
    LearnedRoute(composition="moe"),
    LearnedRoute(composition="moe", top_k=1),
    MixRoute(weights={"b": 1.2, "a": -0.3, "c": 0.4}),
    "a",
    None,
    VOCAB,
    LearnedRoute(composition="moe", temperature=2.0),
    "c",
    MixRoute(weights={"a": 0.9}),
    "b",
]
LENGTHS = [5, 19, 8, 33, 12, 7, 26, 10, 15, 4, 21, 9, 30, 6, 17, 11]
MAX_TOKENS = [8, 3, 12, 6, 9, 1, 10, 7, 5, 11, 2, 8, 6, 9, 4, 10]


@pytest.fixture(scope="module")
def alone(tiny_engine_factory) -> dict[int, list[int]]:
    """Every request run by itself on a fresh engine."""
    prompts = random_prompts(16, 256, LENGTHS, seed=7)
    out = {}
    for i, (p, r, m) in enumerate(zip(prompts, ROUTES, MAX_TOKENS, strict=True)):
        res = run_to_completion(tiny_engine_factory(), [request("solo", p, r, m)])
        assert res["solo"]["finish_reason"] == "length"
        out[i] = res["solo"]["tokens"]
        assert len(out[i]) == m
    return out


def test_sixteen_mixed_routes_in_one_batch(tiny_engine_factory, alone) -> None:
    prompts = random_prompts(16, 256, LENGTHS, seed=7)
    engine = tiny_engine_factory(max_num_seqs=16, max_num_batched_tokens=512)
    reqs = [
        request(f"r{i}", p, r, m)
        for i, (p, r, m) in enumerate(zip(prompts, ROUTES, MAX_TOKENS, strict=True))
    ]
    sizes = []

    def check(step: int, eng) -> None:
        if step == 0:  # everyone was admitted and prefilled together in the first step
            sizes.append(len(eng.running))

    got = run_to_completion(engine, reqs, after_step=check)
    for i in range(16):
        assert got[f"r{i}"]["tokens"] == alone[i], f"request {i} route {ROUTES[i]}"
    assert sizes == [15]  # 16 minus the max_tokens=1 request, finished by that step


def test_join_and_leave_mid_decode(tiny_engine_factory, alone) -> None:
    """Requests arrive at different steps with different max_tokens; a small token budget makes
    prefill chunks of newcomers share steps with decodes of older requests; only 6 KV rows, so
    later requests also wait for rows freed by finished ones."""
    prompts = random_prompts(16, 256, LENGTHS, seed=7)
    engine = tiny_engine_factory(max_num_seqs=6, max_num_batched_tokens=24)
    reqs = [
        request(f"r{i}", p, r, m)
        for i, (p, r, m) in enumerate(zip(prompts, ROUTES, MAX_TOKENS, strict=True))
    ]
    schedule = {0: reqs[:3], 2: reqs[3:6], 3: reqs[6:7], 5: reqs[7:11], 9: reqs[11:14]}
    schedule[14] = reqs[14:]
    got = run_to_completion(engine, schedule=schedule)
    for i in range(16):
        assert got[f"r{i}"]["tokens"] == alone[i], f"request {i} route {ROUTES[i]}"
        assert got[f"r{i}"]["finish_reason"] == "length"
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    assert not engine.hot_set.in_use()


def test_abort_mid_decode_does_not_disturb_others(tiny_engine_factory, alone) -> None:
    prompts = random_prompts(16, 256, LENGTHS, seed=7)
    engine = tiny_engine_factory()
    keep = [0, 4, 6, 13]
    for i in [*keep, 2, 12]:
        engine.add_request(request(f"r{i}", prompts[i], ROUTES[i], MAX_TOKENS[i]))
    results: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    step = 0
    while engine.has_work():
        if step == 3:
            engine.abort("r2")
            engine.abort("r12")
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
        step += 1
    assert finish["r2"] == finish["r12"] == "abort"
    for i in keep:
        assert results[f"r{i}"] == alone[i]
        assert finish[f"r{i}"] == "length"
