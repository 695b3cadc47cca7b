"""The calibration's answer check: how much of the new row's bias drop can be given back while
the old composition's greedy answers on held-out old-domain prompts stay what they were.

A prompt routes exactly as under the old composition when the new row enters no token's top-k
in any adapted layer (by induction over layers the gate inputs are then the old ones too), so
one pass under the old composition records the answers and, per layer and token, how far the
new logit sits below the old k-th one; for each candidate bias only the prompts where it enters
somewhere are run again. That keeps a check set large enough to resolve a 98% share cheap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from molora_runtime.model.attention_meta import DenseAttention
from molora_runtime.model.decoder import CausalLM
from molora_runtime.training.batching import IGNORE
from molora_runtime.training.data import Example, domain_examples
from molora_runtime.training.experts import Gates, TrainableGates, learned_context
from molora_runtime.training.grown_gates import GrownGates
from molora_runtime.training.router import TokenBatch

# Shares of the quantile bound's bias shift tried, loosest first (1.0, the bound, always holds).
RELAX_SCALES = (0.0, 0.25, 0.5, 0.625, 0.75, 0.875)
# Seed offset of the answer check's prompts (apart from the training and calibration draws).
CHECK_SEED = 10_007


def adapted_layers(lm: CausalLM) -> list[int]:
    """Layers where some expert has weights (routing elsewhere changes nothing)."""
    return sorted({lin.layer for lin in lm.lora_linears() if lin.lora is not None})


def check_examples(old: list[str], per_domain: int, seed: int) -> list[Example]:
    """`per_domain` one-task prompts of each old domain, drawn apart from the training data."""
    return [e for d in old for e in domain_examples(d, per_domain, seed + CHECK_SEED, "train", 1)]


def _answers(
    lm: CausalLM,
    gates: TrainableGates,
    batch: TokenBatch,
    top_k: int,
    temperature: float,
    inputs: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Greedy predictions [B, T] at the answer positions (-1 elsewhere); appends each layer's
    gate input [B*T, d] to `inputs` when given."""
    B, T = batch.input_ids.shape
    ctx = learned_context(gates, B * T, top_k=top_k, temperature=temperature)
    if inputs is not None:
        serve = ctx.begin_layer

        def capture(layer: int, normed: torch.Tensor) -> None:
            inputs.append(normed.float())
            serve(layer, normed)

        ctx.begin_layer = capture  # type: ignore[method-assign]
    positions = torch.arange(T, device=batch.input_ids.device).repeat(B)
    meta = DenseAttention(batch=B, seq_len=T, positions=positions)
    hidden = lm.hidden_states(batch.input_ids.reshape(-1), meta, None, ctx)
    answer = (batch.labels != IGNORE).reshape(-1)
    out = torch.full((B * T,), -1, dtype=torch.long, device=hidden.device)
    out[answer] = lm.logits(hidden[answer]).argmax(-1)
    return out.reshape(B, T)


@torch.no_grad()
def answer_predictions(
    lm: CausalLM, gates: TrainableGates, batch: TokenBatch, top_k: int, temperature: float = 1.0
) -> torch.Tensor:
    """Greedy next-token predictions [B, T] on `batch` (teacher-forced) routed by `gates`, at
    the answer positions (-1 elsewhere: the LM head runs only where an answer is predicted)."""
    return _answers(lm, gates, batch, top_k, temperature)


@dataclass
class Probe:
    """One check batch under the old composition: its answers and, per layer and token, the new
    row's logit (before any bias drop) minus the old k-th logit."""

    batch: TokenBatch
    reference: torch.Tensor  # [B, T]
    gap: torch.Tensor  # [L, B*T]


@torch.no_grad()
def probe(
    lm: CausalLM, grown: GrownGates, batch: TokenBatch, top_k: int, temperature: float = 1.0
) -> Probe:
    """The old composition's pass over `batch`, kept as a `Probe`."""
    old = Gates(grown.old_weight, grown.old_bias)  # type: ignore[arg-type]
    inputs: list[torch.Tensor] = []
    reference = _answers(lm, old, batch, top_k, temperature, inputs)
    x = torch.stack(inputs)  # [L, N, d]
    olds = torch.einsum("lnd,lkd->lnk", x, grown.old_weight) + grown.old_bias[:, None]
    kth = olds.topk(min(top_k, grown.new_index), dim=-1).values[..., -1]
    new = torch.einsum("lnd,ld->ln", x, grown.new_weight.detach()[:, 0])
    return Probe(batch, reference, new + grown.new_bias.detach()[:, 0, None] - kth)


def entered_rows(p: Probe, drop: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """[B] prompts of `p` where the new row, its bias lowered by `drop` [L], enters some valid
    token's top-k in one of `layers` (elsewhere they route as under the old composition)."""
    B, T = p.batch.input_ids.shape
    inside = (p.gap[layers] - drop[layers, None] >= 0).any(0).reshape(B, T)
    return (inside & p.batch.valid).any(-1)


def unchanged_shares(
    batches: list[TokenBatch], old: list[torch.Tensor], new: list[torch.Tensor], new_index: int
) -> dict[int, float]:
    """Per old domain, the share of its held-out prompts without the new domain whose answer
    predictions are all the same under `new` as under `old` ([B, T] per batch)."""
    same: dict[int, list[bool]] = {}
    for batch, ref, got in zip(batches, old, new, strict=True):
        assert batch.route_labels is not None
        for row in range(batch.input_ids.shape[0]):
            labels = batch.route_labels[row]
            answer = batch.labels[row] != IGNORE
            if bool((labels == new_index).any()) or not bool(answer.any()):
                continue
            equal = bool(torch.equal(got[row][answer], ref[row][answer]))
            for domain in labels[answer & (labels != IGNORE)].unique().tolist():
                same.setdefault(int(domain), []).append(equal)
    return {d: sum(v) / len(v) for d, v in same.items()}


def _rows(batch: TokenBatch, rows: torch.Tensor) -> TokenBatch:
    routes = None if batch.route_labels is None else batch.route_labels[rows]
    return TokenBatch(batch.input_ids[rows], batch.labels[rows], batch.valid[rows], routes)


@torch.no_grad()
def relaxed_scale(
    lm: CausalLM,
    grown: GrownGates,
    batches: list[TokenBatch],
    top_k: int,
    shift: torch.Tensor,
    keep: float,
    temperature: float = 1.0,
) -> float:
    """The smallest share of `shift` (per-layer bias drop, [L]) from `RELAX_SCALES` under which
    every old domain keeps the old composition's greedy answer predictions on at least `keep` of
    its held-out prompts in `batches`, found by bisection (answers that hold at one share are
    taken to hold at larger ones); 1.0 (the whole shift) when none does."""
    probes = [probe(lm, grown, b, top_k, temperature) for b in batches]
    layers = adapted_layers(lm)
    refs = [p.reference for p in probes]

    def holds(scale: float) -> bool:
        drop = scale * shift
        bias = torch.cat([grown.old_bias, grown.new_bias.detach() - drop[:, None]], 1)
        gates = Gates(grown.weight.detach(), bias)  # type: ignore[arg-type]
        got = []
        for p in probes:
            rows = entered_rows(p, drop, layers)
            pred = p.reference.clone()
            if bool(rows.any()):
                pred[rows] = _answers(lm, gates, _rows(p.batch, rows), top_k, temperature)
            got.append(pred)
        shares = unchanged_shares(batches, refs, got, grown.new_index)
        return bool(shares) and min(shares.values()) >= keep

    low, high = 0, len(RELAX_SCALES)  # bisection: a larger share of the drop moves fewer answers
    while low < high:
        mid = (low + high) // 2
        if holds(RELAX_SCALES[mid]):
            high = mid
        else:
            low = mid + 1
    return RELAX_SCALES[low] if low < len(RELAX_SCALES) else 1.0
