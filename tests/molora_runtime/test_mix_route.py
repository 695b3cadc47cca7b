"""A `mix` route equals PEFT's `add_weighted_adapter(..., combination_type="cat")` adapter:
greedy tokens and prefill logits."""

from __future__ import annotations

import pytest
import torch

from molora_runtime.routes import MixRoute
from tests.molora_runtime.rt_util import (
    engine_prefill_logits,
    random_prompts,
    request,
    run_to_completion,
)

MIXES = {
    "ab": {"a": 0.7, "b": 0.3},
    "abc-negative": {"a": 0.6, "b": 0.5, "c": -0.4},
    "ca": {"c": 1.5, "a": 0.25},
}


@pytest.fixture(scope="module")
def peft_mixes(peft_abc):
    """This module's PEFT model (a, b, c) with the mixes added as weighted adapters."""
    pm = peft_abc
    for name, weights in MIXES.items():
        pm.add_weighted_adapter(
            adapters=list(weights),
            weights=list(weights.values()),
            adapter_name=name,
            combination_type="cat",
        )
    return pm.eval()


@pytest.mark.parametrize("mix", list(MIXES))
def test_mix_equals_peft_cat(mix: str, tiny_engine_factory, peft_mixes) -> None:
    engine = tiny_engine_factory()
    route = MixRoute(weights=MIXES[mix])
    prompts = random_prompts(3, 256, [6, 17, 11], seed=21)

    peft_mixes.set_adapter(mix)
    for prompt in prompts:
        with torch.no_grad():
            ref_logits = peft_mixes(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(
            engine_prefill_logits(engine, route, prompt), ref_logits, atol=1e-4, rtol=0
        )

    got = run_to_completion(engine, [request(f"m{i}", p, route, 10) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = peft_mixes.generate(
                torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0
            )
        assert got[f"m{i}"]["tokens"] == ref[0, len(prompt) :].tolist()


def test_mix_differs_from_its_parts(tiny_engine_factory) -> None:
    """Sanity: the weighted mix is not silently one of its adapters or the base model."""
    engine = tiny_engine_factory()
    prompt = random_prompts(1, 256, [12], seed=3)[0]
    mix = engine_prefill_logits(engine, MixRoute(weights=MIXES["ab"]), prompt)
    for other in (None, "a", "b"):
        assert (mix - engine_prefill_logits(engine, other, prompt)).abs().max() > 1e-2
