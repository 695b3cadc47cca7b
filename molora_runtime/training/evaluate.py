"""Scoring harness: run a generator over examples and report exact-match per domain / mixed.

A generator maps rendered prompt texts to completions. The quality benchmark uses the engine
(`LLM.generate` with a RouteSpec) so what is measured is what is served; `hf_generator` is the
PEFT/transformers cross-check used while developing adapters.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

from molora_runtime.training.batching import render_prompt
from molora_runtime.training.data import Example, score_completion

Generator = Callable[[list[str]], list[str]]


def score(
    examples: Sequence[Example], completions: Sequence[str]
) -> tuple[list[list[float]], dict[str, float]]:
    """Per-example sub-scores and accuracy by domain (single) and for mixed prompts."""
    per_example = [score_completion(e, c) for e, c in zip(examples, completions, strict=True)]
    buckets: dict[str, list[float]] = defaultdict(list)
    for example, subs in zip(examples, per_example, strict=True):
        key = "mixed" if example.kind == "mixed" else example.tasks[0].domain
        buckets[key].extend(subs)
    return per_example, {k: 100.0 * sum(v) / len(v) for k, v in buckets.items()}


@torch.no_grad()
def hf_generate(model, tokenizer, prompts: list[str], max_new_tokens: int, batch: int = 32):
    """Greedy batched generation with transformers (left padding)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    out: list[str] = []
    for i in range(0, len(prompts), batch):
        enc = tokenizer(
            prompts[i : i + batch], return_tensors="pt", padding=True, add_special_tokens=False
        ).to(model.device)
        gen = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        texts = tokenizer.batch_decode(
            gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True
        )
        out.extend(texts)
    return out


def render_all(tokenizer, examples: Sequence[Example]) -> list[str]:
    return [render_prompt(tokenizer, e) for e in examples]
