"""Per-row logits processing before sampling: bias, masks, penalties, and the logprobs reported.

Order (vLLM's): a grammar mask and `min_tokens` (EOS and stop ids banned until enough tokens),
then `logit_bias`, then the penalties — `repetition_penalty` over prompt and output tokens
(divides positive logits, multiplies negative ones, as Hugging Face/vLLM), then
`frequency_penalty` × count and `presence_penalty` × [count > 0] over output tokens only (as
OpenAI defines them) — then temperature.

Reported logprobs are the log-softmax of exactly those processed logits divided by the
temperature (1 when decoding greedily): the distribution sampling draws from *before* top-k /
top-p truncation, so values stay finite for every token the masks allow and `top_logprobs` always
lists k alternatives. Masked tokens report -inf (the API layer writes -9999.0, as vLLM does).

Rows that ask for none of this take the plain path of `sampler.sample_tokens`, untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from molora_runtime.engine.sampling.sampler import (
    SAMPLING_EPS,
    accept_or_resample,
    sample_one,
    sample_tokens,
)
from molora_runtime.engine.types import SamplingParams, TokenLogprob
from molora_runtime.errors import NonFiniteLogitsError


@dataclass
class RowInput:
    """What sampling one row needs beyond its logits."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    banned: Sequence[int] = ()  # masked this step (min_tokens: EOS and stop ids)
    allowed: torch.Tensor | None = None  # bool [V] from a grammar; None = every token
    processing: bool = field(init=False)

    def __post_init__(self) -> None:
        self.processing = (
            self.params.needs_processing() or bool(self.banned) or self.allowed is not None
        )


def take_rows(t: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """Rows `rows` of `t` [n, V]: `t` itself when that is every row in order, else one
    `index_select` (indexing with a list, `t[rows]`, runs the much slower aten::index)."""
    if len(rows) == t.shape[0] and all(i == r for i, r in enumerate(rows)):
        return t
    return t.index_select(0, torch.tensor(list(rows), dtype=torch.long, device=t.device))


def process_row(row: torch.Tensor, inp: RowInput) -> torch.Tensor:
    """The processed logits of one row [V] (float32, a new tensor): masks, bias, penalties."""
    p = inp.params
    out = row.float().clone()
    vocab = out.shape[-1]
    if inp.allowed is not None:
        out = out.masked_fill(~inp.allowed.to(out.device)[:vocab], float("-inf"))
    if inp.banned:
        out[torch.tensor(list(inp.banned), dtype=torch.long, device=out.device)] = float("-inf")
    if p.logit_bias:
        ids = [t for t in p.logit_bias if t < vocab]
        if ids:
            idx = torch.tensor(ids, dtype=torch.long, device=out.device)
            bias = torch.tensor([p.logit_bias[t] for t in ids], device=out.device)
            out.index_add_(0, idx, bias)
    if p.repetition_penalty != 1.0:
        seen = list(inp.prompt_ids) + list(inp.output_ids)
        if seen:
            idx = torch.tensor(sorted(set(seen)), dtype=torch.long, device=out.device)
            vals = out[idx]
            out[idx] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
    if (p.frequency_penalty or p.presence_penalty) and inp.output_ids:
        ids = torch.tensor(list(inp.output_ids), dtype=torch.long, device=out.device)
        counts = torch.bincount(ids, minlength=vocab)[:vocab].to(out.dtype)
        out -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(out.dtype)
    return out


def row_logprobs(processed: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities [V] of the distribution sampled from (before top-k/top-p)."""
    t = params.temperature if params.temperature >= SAMPLING_EPS else 1.0
    return torch.log_softmax(processed / t, dim=-1)


def token_logprob(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if k:
        values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token_id=token, logprob=float(logprobs[token]), top=top)


def sample_rows(
    logits: torch.Tensor, rows: list[RowInput], greedy: list[int]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row of `logits` [n, V], and its logprobs where the row asked for them
    (`greedy`: each row's greedy token on its raw logits, from `sampler.scan_rows`)."""
    plain = [i for i, r in enumerate(rows) if not r.processing]
    tokens: list[int] = [0] * len(rows)
    logprobs: list[TokenLogprob | None] = [None] * len(rows)
    if plain:
        picked = sample_tokens(
            take_rows(logits, plain),
            [rows[i].params for i in plain],
            [rows[i].generator for i in plain],
            [greedy[i] for i in plain],
        )
        for i, tok in zip(plain, picked, strict=True):
            tokens[i] = tok
    for i, inp in enumerate(rows):
        if not inp.processing:
            continue
        processed = process_row(logits[i], inp)
        if not bool(torch.isfinite(processed).any()):
            raise ValueError("every token is masked for this request (grammar or min_tokens)")
        if inp.params.temperature < SAMPLING_EPS:
            tok = int(processed.argmax())
        else:
            tok = sample_one(processed, inp.params, inp.generator)
        tokens[i] = tok
        if inp.params.logprobs is not None:
            lp = row_logprobs(processed, inp.params)
            logprobs[i] = token_logprob(lp, tok, inp.params.logprobs)
    return tokens, logprobs


def verify_row(
    logits: torch.Tensor, inp: RowInput, draft: int | None
) -> tuple[int, TokenLogprob | None]:
    """The token one verified row [V] yields, and its logprob if asked: greedy rows take their
    processed argmax (the draft is kept when it is that token); sampled rows keep `draft` by
    the rejection rule, and the row after a fully accepted draft samples as usual."""
    if not bool(torch.isfinite(logits.amax())):
        raise NonFiniteLogitsError("the model produced NaN/Inf logits for this request")
    processed = process_row(logits, inp) if inp.processing else logits.float()
    if not bool(torch.isfinite(processed).any()):
        raise ValueError("every token is masked for this request (grammar or min_tokens)")
    p = inp.params
    if p.temperature < SAMPLING_EPS:
        token = int(processed.argmax())
    elif draft is None or not bool(torch.isfinite(processed[draft])):
        token = sample_one(processed, p, inp.generator)
    else:
        token = accept_or_resample(processed, p, inp.generator, draft)
    if p.logprobs is None:
        return token, None
    return token, token_logprob(row_logprobs(processed, p), token, p.logprobs)


def prompt_logprobs(
    logits: torch.Tensor, prompt_ids: Sequence[int], k: int
) -> list[TokenLogprob | None]:
    """Logprobs of each prompt token given the ones before it (`logits` [P-1, V] for positions
    0..P-2, raw model logits: no sampling parameter applies to the prompt); the first token has
    none (None), as in OpenAI's echo."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out: list[TokenLogprob | None] = [None]
    for pos, tok in enumerate(list(prompt_ids)[1:]):
        out.append(token_logprob(lp[pos], int(tok), k))
    return out
