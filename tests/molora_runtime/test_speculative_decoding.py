"""Speculative decoding is lossless: greedy outputs are the ones plain decoding gives, for every
route kind, in mixed batches, with stops, logprobs, grammars and n > 1; drafts are accepted;
rejected drafts leave no KV blocks held and nothing in the prefix cache; sampling follows the
target distribution."""

from __future__ import annotations

import collections

import pytest
import torch

from molora_runtime.config import SpeculativeConfig
from molora_runtime.engine.sampling.sampler import accept_or_resample
from molora_runtime.engine.speculation.ngram_index import NgramIndex
from molora_runtime.engine.types import SamplingParams
from molora_runtime.routes import LearnedRoute, MixRoute, VocabRoute
from tests.molora_runtime.rt_util import random_prompts, request, run_to_completion
from tests.molora_runtime.test_structured_output import SCHEMA

VOCAB = VocabRoute(
    ranges=[{"start": 0, "end": 128, "adapter": "b"}, {"start": 128, "end": 256, "adapter": "c"}]
)
ROUTES = [None, "a", MixRoute(weights={"a": 0.6, "c": 0.4}), VOCAB, LearnedRoute(composition="moe")]
MIX = MixRoute(weights={"a": 0.5, "c": 0.5})
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts holding a repeated phrase, so the tiny model's continuations find n-grams."""
    out = []
    for p in random_prompts(n, 256, [12] * n, seed=seed):
        out.append(p + p[:8] + p + p[:5])
    return out


def run(factory, reqs, spec: dict | None, **kwargs):
    engine = factory(speculative=spec, **kwargs)
    got = run_to_completion(engine, reqs)
    return got, engine


@pytest.mark.parametrize("route", ROUTES, ids=["base", "single", "mix", "vocab", "learned"])
def test_greedy_outputs_equal_plain_decoding(tiny_engine_factory, route) -> None:
    prompts = repetitive_prompts(3, seed=11)
    reqs = [request(f"r{i}", p, route, 40) for i, p in enumerate(prompts)]
    plain, _ = run(tiny_engine_factory, reqs, None, max_num_seqs=4)
    reqs = [request(f"r{i}", p, route, 40) for i, p in enumerate(prompts)]
    spec, engine = run(tiny_engine_factory, reqs, SPEC, max_num_seqs=4)
    for rid in plain:
        assert spec[rid]["tokens"] == plain[rid]["tokens"], rid
        assert spec[rid]["finish_reason"] == "length"
    counters = engine.drafter.counters
    assert counters.total.drafts > 0 and counters.total.accepted > 0
    assert counters.total.accepted <= counters.total.draft_tokens
    assert counters.by_route[route_kind(route)].drafts == counters.total.drafts
    assert engine.block_manager.num_used == 0  # every block, drafts' included, went back


def route_kind(route) -> str:
    return "base" if route is None else "single" if isinstance(route, str) else route.kind


def test_a_mixed_batch_with_and_without_drafts(tiny_engine_factory) -> None:
    """Speculating and plain sequences share steps (and the batch splits drafts off above
    `max_batch`); every output equals plain decoding."""
    prompts = repetitive_prompts(3, seed=3) + random_prompts(3, 256, [9, 17, 5], seed=4)
    routes = ["a", None, VOCAB, "c", LearnedRoute(composition="moe"), "b"]
    lengths = [30, 7, 25, 12, 33, 18]

    def reqs():
        return [
            request(f"r{i}", p, r, m)
            for i, (p, r, m) in enumerate(zip(prompts, routes, lengths, strict=True))
        ]

    plain, _ = run(tiny_engine_factory, reqs(), None, max_num_seqs=6)
    for max_batch in (6, 3):
        spec, engine = run(
            tiny_engine_factory, reqs(), {**SPEC, "max_batch": max_batch}, max_num_seqs=6
        )
        assert {k: v["tokens"] for k, v in spec.items()} == {
            k: v["tokens"] for k, v in plain.items()
        }
        assert engine.drafter.counters.total.accepted > 0


def test_stops_logprobs_and_n_siblings_match(tiny_engine_factory) -> None:
    prompts = repetitive_prompts(2, seed=5)
    plain_out, _ = run(tiny_engine_factory, [request("x", prompts[0], "a", 60)], None)
    stop_at = plain_out["x"]["tokens"][20]

    def reqs():
        return [
            request(
                "stop",
                prompts[0],
                "a",
                sampling=SamplingParams(max_tokens=60, stop_token_ids=[stop_at], logprobs=3),
            ),
            request("len", prompts[1], None, 17),
        ]

    plain, _ = run(tiny_engine_factory, reqs(), None, max_num_seqs=4)
    spec, _ = run(tiny_engine_factory, reqs(), SPEC, max_num_seqs=4)
    assert spec["stop"]["finish_reason"] == plain["stop"]["finish_reason"] == "stop"
    for rid in plain:
        assert spec[rid]["tokens"] == plain[rid]["tokens"]
    lp = lambda res: [  # noqa: E731
        (t.token_id, round(t.logprob, 3), [i for i, _ in t.top])
        for o in res["outputs"]
        for t in o.logprobs or []
    ]
    assert lp(spec["stop"]) == lp(plain["stop"])
    assert len(lp(spec["stop"])) == len(spec["stop"]["tokens"])


def test_prefix_cache_holds_only_accepted_tokens(tiny_engine_factory) -> None:
    """Every cached block's tokens are the tokens of a finished sequence at that place: a
    rejected draft never reaches the index; a repeat of the request hits the cache and gives
    the same output."""
    prompt = repetitive_prompts(1, seed=9)[0]
    engine = tiny_engine_factory(speculative=SPEC, kv_block_size=4)
    first = run_to_completion(engine, [request("one", prompt, "a", 40)])
    full = prompt + first["one"]["tokens"]
    bm = engine.block_manager
    for bid, block in enumerate(bm.blocks):
        if block.hash is not None:
            assert block.token_ids in [full[i : i + 4] for i in range(0, len(full) - 3, 4)], bid
    hits = bm.counters.prefix_hit_tokens
    again = run_to_completion(engine, [request("two", prompt, "a", 40)])
    assert again["two"]["tokens"] == first["one"]["tokens"]
    assert bm.counters.prefix_hit_tokens > hits
    assert bm.num_used == 0


def test_ngram_index_finds_the_longest_latest_match() -> None:
    index = NgramIndex(1, 3)
    stream = [5, 6, 7, 8, 1, 6, 7, 9, 2, 5, 6, 7]
    index.extend(stream)
    n, start = index.match(stream)
    assert n == 3 and stream[start] == 8  # [5, 6, 7] seen once, followed by 8
    assert index.match([4, 4]) == (0, -1)
    index.extend([*stream, 3])
    n, start = index.match([*stream, 3])
    assert n == 0  # 3 never appeared before


def test_rejection_rule_keeps_the_target_distribution() -> None:
    """Whatever the draft, the token drawn follows the target's (temperature, top-k) law."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=0.8, top_k=5)
    target = torch.softmax(logits / 0.8, dim=-1)
    target[5] = 0.0
    target /= target.sum()
    gen = torch.Generator().manual_seed(0)
    draws = 20_000
    for draft in (0, 3, 5):
        counts = collections.Counter(
            accept_or_resample(logits, params, gen, draft) for _ in range(draws)
        )
        assert counts[5] == 0  # outside top-k: never, even when drafted
        for token in range(5):
            assert abs(counts[token] / draws - float(target[token])) < 0.015, (draft, token)


def test_speculative_config_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=5, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="need method 'eagle'"):
        SpeculativeConfig(model="some/eagle-head")
    with pytest.raises(ValueError, match="needs 'model'"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError):
        SpeculativeConfig(num_speculative_tokens=0)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 4}])
def test_the_grammar_masks_every_verified_row(tiny_chat_model, sampling) -> None:
    """Under response_format, drafts the grammar refuses are cut and what is kept still
    validates; greedy output equals plain decoding."""
    import json

    import jsonschema

    from molora_runtime.engine.structured.response_format import ResponseFormat
    from molora_runtime.engine.types import GenerationRequest
    from tests.molora_runtime.rt_util import build_engine

    fmt = ResponseFormat(type="json_schema", json_schema=SCHEMA)

    def reqs():
        return [
            GenerationRequest(
                request_id=f"g{i}",
                messages=[{"role": "user", "content": 'Give me JSON like {"ok": true}.'}],
                sampling=SamplingParams(max_tokens=120, **{**sampling, "seed": i}),
                response_format=fmt,
            )
            for i in range(2)
        ]

    plain = run_to_completion(build_engine(tiny_chat_model), reqs())
    spec = run_to_completion(build_engine(tiny_chat_model, speculative=SPEC), reqs())
    for rid, res in spec.items():
        assert res["finish_reason"] == "stop", res
        jsonschema.validate(json.loads(res["text"]), SCHEMA)
        if not sampling:
            assert res["tokens"] == plain[rid]["tokens"]


def test_n_siblings_attribution_and_abort(tiny_engine_factory) -> None:
    """n > 1 siblings (one shared prefill), per-token attribution on a mix and an abort
    mid-draft all behave as without speculation; the aborted request's blocks come back."""
    prompt = repetitive_prompts(1, seed=21)[0]

    def reqs():
        return [
            request("lead", prompt, "b", 30),
            request("sib", prompt, "b", 30, prefill_from="lead"),
            request("attr", prompt, MIX, 20, return_attribution=True),
        ]

    plain = run_to_completion(tiny_engine_factory(max_num_seqs=4), reqs())
    engine = tiny_engine_factory(max_num_seqs=4, speculative=SPEC)
    spec = run_to_completion(engine, reqs())
    for rid in plain:
        assert spec[rid]["tokens"] == plain[rid]["tokens"], rid
    assert len(spec["attr"]["attribution"]) == len(spec["attr"]["tokens"])
    assert spec["attr"]["attribution"] == plain["attr"]["attribution"]

    def abort_later(step: int, eng) -> None:
        if step == 3:
            eng.abort("gone")

    got = run_to_completion(engine, [request("gone", prompt, "a", 60)], after_step=abort_later)
    assert got["gone"]["finish_reason"] == "abort"
    assert engine.block_manager.num_used == 0
