"""The offline `LLM.generate` takes any number of prompts, beyond the engine's queue bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from molora_runtime.engine.llm import LLM
from molora_runtime.engine.types import SamplingParams
from molora_runtime.errors import InvalidRequestError


def test_more_prompts_than_the_queue_holds(tiny_llama: Path, tiny_adapters: dict) -> None:
    llm = LLM(
        model=tiny_llama,
        adapters=tiny_adapters,
        device="cpu",
        dtype="float32",
        max_num_seqs=2,
        max_num_batched_tokens=64,
        max_model_len=64,
        max_queue_len=3,  # 2 running + 3 waiting, but 12 prompts in one call
        hot_set={"num_slots": 4},
    )
    prompts = [[(7 * i + j) % 200 + 1 for j in range(5 + i % 3)] for i in range(12)]
    routes = [None, "a", "b", "c:0.5+a:0.5"] * 3
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    together = llm.generate(prompts, sp, routes)
    alone = [llm.generate([p], sp, [r])[0] for p, r in zip(prompts, routes, strict=True)]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert all(len(r.token_ids) == 4 for r in together)


def test_a_bad_prompt_fails_the_call_before_anything_runs(tiny_llama: Path) -> None:
    llm = LLM(model=tiny_llama, device="cpu", dtype="float32", max_queue_len=1)
    with pytest.raises(InvalidRequestError):
        llm.generate([[1, 2, 3], [1, 10_000]], SamplingParams(max_tokens=2))
    assert not llm.engine.has_work()
