"""Token sampling: greedy, temperature, min-p, top-k, top-p, each request with its own seeded
generator (vLLM's order: temperature, then min-p, then top-k/top-p)."""

from __future__ import annotations

from typing import NamedTuple

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


class RowScan(NamedTuple):
    """One read of a step's logits [n, V]: each row's greedy token (the first index of its
    maximum, as `torch.argmax` picks it) and whether that maximum is finite. A row holding a
    NaN or +Inf, or nothing but -Inf, has no finite maximum and nothing to sample from."""

    greedy: list[int]
    finite: list[bool]


def scan_rows(logits: torch.Tensor) -> RowScan:
    """Every row's greedy token and finiteness from one pass over `logits` [n, V] (one host sync).

    On CPU `argmax` over a wide row is a scalar loop, while `amax` is vectorised: each row's
    maximum is found block by block with `amax`, and `argmax` runs only inside the first block
    holding it. The same maxima screen the rows for NaN/Inf (`amax` propagates NaN), so the
    failure screen and greedy sampling share one read of the logits.
    """
    n, vocab = logits.shape
    if n == 0:
        return RowScan([], [])
    chunk = _argmax_chunk(vocab)
    if logits.device.type != "cpu" or not chunk or not logits.is_contiguous():
        row_max, tokens = logits.amax(dim=-1), logits.argmax(dim=-1)
    else:
        blocks = logits.view(n, vocab // chunk, chunk)
        block_max = blocks.amax(dim=-1)
        row_max = block_max.amax(dim=-1)
        if bool(row_max.isnan().any()):
            tokens = logits.argmax(dim=-1)
        else:
            first = (block_max == row_max.unsqueeze(-1)).to(torch.uint8).argmax(dim=-1)
            tokens = first * chunk + blocks[torch.arange(n), first].argmax(dim=-1)
    greedy, finite = torch.stack([tokens, torch.isfinite(row_max).long()]).tolist()
    return RowScan(greedy, [bool(f) for f in finite])


def min_p_filter(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Temperature-scaled logits [n, V] with every token whose probability is below
    `min_p` [n] times its row's top probability set to -inf, all rows at once (min_p 0 keeps
    the row as it is)."""
    probs = torch.softmax(scaled, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.to(probs.dtype).unsqueeze(-1)
    return scaled.masked_fill(probs < threshold, float("-inf"))


def min_p_filter_reference(scaled: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """`min_p_filter`'s twin, row by row in float64, for tests."""
    out = scaled.clone()
    for i, m in enumerate(min_p):
        probs = torch.softmax(scaled[i].double(), dim=-1)
        out[i] = scaled[i].masked_fill(probs < m * probs.max(), float("-inf"))
    return out


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    greedy: list[int],
) -> list[int]:
    """Pick one token per row of `logits` [n, V] (float32): greedy rows take `greedy` (each
    row's `scan_rows` token); the sampled rows are scaled and min-p filtered as one batch."""
    out = list(greedy)
    rows = [i for i, p in enumerate(params) if p.temperature >= SAMPLING_EPS]
    if not rows:
        return out
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    temps = torch.tensor([params[i].temperature for i in rows], device=logits.device)
    scaled = logits.index_select(0, index).float() / temps.unsqueeze(-1)
    min_p = [params[i].min_p for i in rows]
    if any(min_p):
        scaled = min_p_filter(scaled, torch.tensor(min_p, device=logits.device))
    for j, i in enumerate(rows):
        out[i] = sample_scaled(scaled[j], params[i], generators[i])
    return out


def sample_one(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """Temperature, min-p, top-k, top-p, then one draw from `gen` (a -inf-masked row too)."""
    return sample_scaled(scaled_row(row, p), p, gen)


def scaled_row(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row [V] divided by the temperature, then min-p filtered."""
    row = row.float() / p.temperature
    if p.min_p:
        row = min_p_filter(row.unsqueeze(0), torch.tensor([p.min_p], device=row.device))[0]
    return row


def sample_scaled(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """Top-k, top-p and one draw from a temperature-scaled (and min-p filtered) row."""
    # Generators live on the CPU so a seed gives the same tokens on any device.
    return int(torch.multinomial(truncated_probs(row, p).cpu(), 1, generator=gen))


def accept_or_resample(
    row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None, draft: int
) -> int:
    """Speculative sampling's rule for a draft proposed with certainty (a lookup, not a
    model): keep `draft` with the probability the target gives it, else draw from the target
    with `draft` removed. The token returned follows the target's distribution exactly."""
    probs = truncated_probs(scaled_row(row, p), p).cpu()
    if float(torch.rand((), generator=gen)) < float(probs[draft]):
        return draft
    probs[draft] = 0.0
    total = probs.sum()
    if float(total) <= 0.0:  # the target gives `draft` everything: it was kept above
        return draft
    return int(torch.multinomial(probs / total, 1, generator=gen))


def truncated_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution one draw samples from: a temperature-scaled row after top-k and top-p."""
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
    return probs / total
