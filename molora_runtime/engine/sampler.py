"""Token sampling: greedy, temperature, top-k, top-p, each request with its own seeded generator."""

from __future__ import annotations

import torch

from molora_runtime.engine.types import SamplingParams

# Below this temperature sampling is greedy (as vLLM): 1/T would overflow float32 into Inf/NaN.
SAMPLING_EPS = 1e-5


def _argmax_chunk(vocab: int) -> int:
    """The largest power-of-two block (32..256 tokens) that tiles the vocabulary; 0 if none."""
    for size in (256, 128, 64, 32):
        if vocab % size == 0:
            return size
    return 0


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of `logits` [n, V] -> [n], the first index of each row's maximum exactly
    as `torch.argmax` picks it.

    On CPU `argmax` over a wide row is a scalar loop, while `amax` is vectorised: each row's
    maximum is found block by block with `amax`, and `argmax` runs only inside the first block
    holding it (the same first index). Rows with a NaN take `torch.argmax` as they are.
    """
    n, vocab = logits.shape
    chunk = _argmax_chunk(vocab)
    if logits.device.type != "cpu" or not chunk or not logits.is_contiguous() or n == 0:
        return logits.argmax(dim=-1)
    blocks = logits.view(n, vocab // chunk, chunk)
    block_max = blocks.amax(dim=-1)
    row_max = block_max.amax(dim=-1, keepdim=True)
    if bool(row_max.isnan().any()):
        return logits.argmax(dim=-1)
    first = (block_max == row_max).to(torch.uint8).argmax(dim=-1)
    inner = blocks[torch.arange(n), first].argmax(dim=-1)
    return first * chunk + inner


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """Pick one token per row of `logits` [n, V] (float32)."""
    greedy = greedy_tokens(logits).tolist()
    out: list[int] = []
    for i, p in enumerate(params):
        if p.temperature < SAMPLING_EPS:
            out.append(int(greedy[i]))
            continue
        out.append(sample_one(logits[i], p, generators[i]))
    return out


def sample_one(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """Temperature, top-k, top-p, then one draw from `gen` (a row of -inf-masked logits too)."""
    row = row.float() / p.temperature
    if p.top_k and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = cumulative - sorted_probs > p.top_p  # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    total = probs.sum()
    if not bool(torch.isfinite(total)) or float(total) <= 0.0:
        raise ValueError("sampling probabilities are not finite (NaN/Inf logits)")
    probs = probs / total
    # Generators live on the CPU so a seed gives the same tokens on any device.
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))
