"""Prefix-cache isolation: a request's tenant and `cache_salt` enter every KV block's hash, so a
prompt cached for one tenant (or salt) is never a hit for another, while the same tenant and salt
still share blocks; the greedy tokens are the same either way."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from molora_runtime.engine.scheduling.route_key import cache_identity
from molora_runtime.engine.types import GenerationRequest
from tests.molora_runtime.rt_util import random_prompts, request, run_to_completion

BS = 4


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return random_prompts(1, 256, [21], seed=11)[0]  # 5 full blocks + 1 token


def _hits(engine) -> int:
    return engine.stats().kv.prefix_hit_tokens


def _run_one(engine, rid: str, prompt: list[int], **kwargs) -> tuple[list[int], int]:
    """Serve one request alone; its tokens and the prefix-cache hit tokens it got."""
    before = _hits(engine)
    out = run_to_completion(engine, [request(rid, prompt, None, 6, **kwargs)])[rid]
    assert out["error"] is None
    return out["tokens"], _hits(engine) - before


def test_tenants_never_hit_each_others_blocks(tiny_engine_factory, prompt) -> None:
    engine = tiny_engine_factory(kv_block_size=BS)
    first, hit = _run_one(engine, "acme-1", prompt, tenant="acme")
    assert hit == 0
    tokens, hit = _run_one(engine, "evil-1", prompt, tenant="evil")
    assert hit == 0 and tokens == first  # no hit across tenants, same greedy text
    tokens, hit = _run_one(engine, "anon-1", prompt)
    assert hit == 0 and tokens == first  # nor for a request without a tenant
    tokens, hit = _run_one(engine, "acme-2", prompt, tenant="acme")
    assert hit == 20 and tokens == first  # the same tenant reuses its 5 full blocks
    tokens, hit = _run_one(engine, "evil-2", prompt, tenant="evil")
    assert hit == 20 and tokens == first


def test_cache_salt_separates_requests_of_one_tenant(tiny_engine_factory, prompt) -> None:
    engine = tiny_engine_factory(kv_block_size=BS)
    first, _ = _run_one(engine, "s1", prompt, tenant="acme", cache_salt="x" * 43)
    tokens, hit = _run_one(engine, "s2", prompt, tenant="acme", cache_salt="y" * 43)
    assert hit == 0 and tokens == first
    tokens, hit = _run_one(engine, "s3", prompt, tenant="acme")
    assert hit == 0 and tokens == first  # unsalted does not hit salted blocks
    tokens, hit = _run_one(engine, "s4", prompt, tenant="acme", cache_salt="x" * 43)
    assert hit == 20 and tokens == first
    # a salt is no way into another tenant's blocks either
    tokens, hit = _run_one(engine, "s5", prompt, tenant="evil", cache_salt="x" * 43)
    assert hit == 0 and tokens == first


def test_concurrent_tenants_hold_disjoint_blocks(tiny_engine_factory, prompt) -> None:
    """Running at once, two tenants' copies of one prompt share no KV block; two requests of
    one tenant share the prompt's full blocks."""
    engine = tiny_engine_factory(kv_block_size=BS)
    run_to_completion(engine, [request("warm", prompt, None, 2, tenant="acme")])
    reqs = [
        request("a1", prompt, None, 6, tenant="acme"),
        request("e1", prompt, None, 6, tenant="evil"),
        request("a2", prompt, None, 6, tenant="acme"),
    ]
    tables: dict[str, set[int]] = {}

    def snapshot(step: int, eng) -> None:
        for seq in eng.running:
            tables.setdefault(seq.request_id, set()).update(seq.block_table)

    out = run_to_completion(engine, reqs, after_step=snapshot)
    assert len({tuple(o["tokens"]) for o in out.values()}) == 1
    assert not tables["e1"] & (tables["a1"] | tables["a2"])
    assert len(tables["a1"] & tables["a2"]) >= 5


def test_identity_salting_is_unambiguous() -> None:
    route = b"r" * 32
    assert cache_identity(route, None, None) == route
    keys = {
        cache_identity(route, t, s)
        for t, s in [("a", None), (None, "a"), ("a", "b"), ("ab", None), ("a", "b" * 2), ("b", "a")]
    }
    assert len(keys) == 6 and route not in keys


@pytest.mark.parametrize(
    "fields",
    [{"cache_salt": ""}, {"tenant": ""}, {"tenant": "t" * 257}, {"cache_salt": "s" * 1025}],
)
def test_bad_tenant_or_salt_is_refused(fields) -> None:
    with pytest.raises(ValidationError):
        GenerationRequest(request_id="x", prompt_token_ids=[1, 2], **fields)
