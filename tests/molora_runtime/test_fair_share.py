"""Fair share between tenants: one tenant's burst (n > 1 siblings filling every sequence slot, or
every KV block) never locks another tenant's new request out. The bystander starts within a step
and every request, preempted or not, still gets exactly its greedy tokens."""

from __future__ import annotations

import pytest
import torch

from molora_runtime.config import EngineConfig
from molora_runtime.model.attention_meta import KVCache
from tests.molora_runtime.rt_util import random_prompts, request, run_to_completion

SLOTS = 8


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(3, 256, [12, 9, 10], seed=31)


def burst(prompts, tenant: str = "acme", n: int = SLOTS, max_tokens: int = 40) -> list:
    """Two requests with `n` choices each, as the API expands them (siblings of a leader)."""
    out = []
    for r in range(2):
        for i in range(n):
            lead = f"{tenant}-{r}.0" if i else None
            out.append(
                request(
                    f"{tenant}-{r}.{i}", prompts[r], None, max_tokens, prefill_from=lead
                ).model_copy(update={"tenant": tenant})
            )
    return out


def serve_with_bystander(engine, prompts, bystander_tenant: str) -> tuple[dict, int, int]:
    """Run the burst; two steps in, a bystander arrives. Its result, the step it was admitted
    and the step its first token came."""
    by = request("by", prompts[2], None, 8, tenant=bystander_tenant)
    seen: dict[str, int] = {}

    def watch(step: int, eng) -> None:
        if any(s.request_id == "by" for s in eng.running):
            seen.setdefault("admitted", step)
        if any(s.request_id == "by" and s.output_ids for s in eng.running):
            seen.setdefault("token", step)

    out = run_to_completion(engine, burst(prompts), schedule={2: [by]}, after_step=watch)
    assert all(o["error"] is None for o in out.values())
    return out, seen.get("admitted", 10**9), seen.get("token", 10**9)


def solo(factory, reqs) -> dict:
    return {r.request_id: run_to_completion(factory(), [r])[r.request_id]["tokens"] for r in reqs}


def test_a_burst_cannot_starve_another_tenant(tiny_engine_factory, prompts) -> None:
    engine = tiny_engine_factory(max_num_seqs=SLOTS)
    out, admitted, first = serve_with_bystander(engine, prompts, "evil")
    assert admitted == 2 and first <= 3  # starts in the step it arrives
    assert engine.scheduler.fair_preemptions >= 1
    # everyone's greedy tokens are what they are alone (preempted siblings recompute)
    expected = solo(
        lambda: tiny_engine_factory(max_num_seqs=1),
        [request("by", prompts[2], None, 8), request("lead0", prompts[0], None, 40),
         request("lead1", prompts[1], None, 40)],
    )  # fmt: skip
    assert out["by"]["tokens"] == expected["by"]
    for rid, res in out.items():
        if rid != "by":
            assert res["tokens"] == expected[f"lead{rid.split('-')[1][0]}"], rid


def test_same_tenant_waits_its_turn(tiny_engine_factory, prompts) -> None:
    """The contrast: a newcomer of the bursting tenant itself is FIFO behind the burst."""
    engine = tiny_engine_factory(max_num_seqs=SLOTS)
    _, admitted, _ = serve_with_bystander(engine, prompts, "acme")
    assert admitted > 30
    assert engine.scheduler.fair_preemptions == 0


def test_a_burst_that_fills_the_kv_blocks_cannot_starve_another_tenant(
    tiny_engine_factory, prompts
) -> None:
    arch = tiny_engine_factory(max_num_seqs=1, kv_cache_bytes=1 << 20).arch
    per_block = 4 * KVCache.bytes_per_token(
        arch.num_layers, arch.num_kv_heads, arch.head_dim, torch.float32
    )

    # 40 blocks of 4 tokens: the burst's 16 sequences (up to 13 blocks each) run out of KV long
    # before they run out of the 32 sequence slots
    def tight():
        return tiny_engine_factory(max_num_seqs=32, kv_block_size=4, kv_cache_bytes=40 * per_block)

    _, admitted, _ = serve_with_bystander(tight(), prompts, "acme")
    assert admitted > 30  # the contrast: the bursting tenant's own newcomer waits for blocks
    engine = tight()
    out, admitted, first = serve_with_bystander(engine, prompts, "evil")
    assert engine.block_manager.num_blocks == 40
    assert admitted <= 3 and first <= 4
    assert engine.scheduler.fair_preemptions >= 1
    alone = run_to_completion(tiny_engine_factory(), [request("by", prompts[2], None, 8)])
    assert out["by"]["tokens"] == alone["by"]["tokens"]


def test_weights_divide_the_slots(tiny_engine_factory, prompts) -> None:
    """Both tenants flood: weighted 3:1, they hold 6 and 2 of the 8 slots."""
    engine = tiny_engine_factory(max_num_seqs=SLOTS, tenant_weights={"acme": 3.0})
    reqs = [
        request(f"{t}-{i}", prompts[i % 2], None, 30, tenant=t)
        for i in range(SLOTS)
        for t in ("evil", "acme")
    ]
    held: list[dict[str, int]] = []

    def count(step: int, eng) -> None:
        held.append({t: sum(s.request.tenant == t for s in eng.running) for t in ("acme", "evil")})

    run_to_completion(engine, reqs, after_step=count)
    assert held[0] == {"acme": 6, "evil": 2}


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf"), 1e9])
def test_bad_weights_are_refused(weight) -> None:
    with pytest.raises(ValueError):
        EngineConfig(tenant_weights={"acme": weight})
