"""A KV budget far below max_num_seqs x max_model_len: admission waits for free blocks, running
decodes that run out of blocks preempt the newest sequence (recompute), and every request still
gets exactly its greedy tokens; a request longer than the whole budget is a clear 400."""

from __future__ import annotations

import pytest

from molora_runtime.engine.types import SamplingParams
from molora_runtime.errors import InvalidRequestError
from molora_runtime.model.attention_meta import KVCache
from molora_runtime.routes import LearnedRoute, MixRoute
from tests.molora_runtime.rt_util import random_prompts, request, run_to_completion

BS = 4
ROUTES = ["a", None, MixRoute(weights={"b": 0.6, "c": 0.4}), LearnedRoute(composition="moe"), "c"]
LENGTHS = [9, 14, 5, 11, 7]
MAX_TOKENS = [14, 9, 16, 10, 12]


def budget(engine_factory, blocks: int) -> int:
    arch = engine_factory(max_num_seqs=1, kv_cache_bytes=1 << 20).arch
    per_token = KVCache.bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim, _f32())
    return blocks * BS * per_token


def _f32():
    import torch

    return torch.float32


@pytest.fixture(scope="module")
def reqs():
    prompts = random_prompts(len(ROUTES), 256, LENGTHS, seed=21)
    return [
        request(f"r{i}", p, r, m)
        for i, (p, r, m) in enumerate(zip(prompts, ROUTES, MAX_TOKENS, strict=True))
    ]


def test_preemption_under_a_tight_budget_keeps_greedy_tokens(tiny_engine_factory, reqs) -> None:
    roomy = run_to_completion(tiny_engine_factory(kv_block_size=BS), reqs)
    # 12 blocks = 48 tokens for five sequences that reach 23-26 tokens each
    tight = tiny_engine_factory(
        kv_block_size=BS, kv_cache_bytes=budget(tiny_engine_factory, 12), max_num_seqs=5
    )
    assert tight.block_manager.num_blocks == 12
    peak = []
    got = run_to_completion(
        tight, reqs, after_step=lambda step, eng: peak.append(eng.block_manager.num_used)
    )
    for req in reqs:
        rid = req.request_id
        assert got[rid]["tokens"] == roomy[rid]["tokens"], rid
        assert got[rid]["finish_reason"] == "length" and got[rid]["error"] is None
    stats = tight.stats().kv
    assert stats.preemptions > 0
    assert max(peak) <= 12 and stats.blocks_used == 0
    assert not tight.hot_set.in_use()


def test_max_num_seqs_is_independent_of_max_model_len(tiny_engine_factory, reqs) -> None:
    """64 sequence slots and a 2048-token context over a 48-token budget: it just works."""
    engine = tiny_engine_factory(
        kv_block_size=BS,
        kv_cache_bytes=budget(tiny_engine_factory, 12),
        max_num_seqs=64,
        max_model_len=2048,
        max_num_batched_tokens=1024,
    )
    got = run_to_completion(engine, reqs)
    assert all(got[r.request_id]["finish_reason"] == "length" for r in reqs)


def test_a_request_longer_than_the_whole_budget_is_refused(tiny_engine_factory) -> None:
    engine = tiny_engine_factory(kv_block_size=BS, kv_cache_bytes=budget(tiny_engine_factory, 12))
    exact = SamplingParams(max_tokens=9, clamp_to_context=False)
    with pytest.raises(InvalidRequestError, match="whole KV budget holds 48 tokens"):
        engine.add_request(request("long", list(range(40)), "a", sampling=exact))
    with pytest.raises(InvalidRequestError, match="whole KV budget holds 48 tokens"):
        engine.add_request(request("longer", list(range(48)), None, 1))  # clamped: still too long
    # a clamped request stops at the budget like at max_model_len
    got = run_to_completion(engine, [request("fits", list(range(40)), "a", 20)])["fits"]
    assert got["finish_reason"] == "length" and len(got["tokens"]) == 8
