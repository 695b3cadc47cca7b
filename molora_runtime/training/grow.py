"""Growing a trained composition by one expert: only the new expert's gate rows train.

The composition's old gate rows, its experts and the base model stay frozen (the old rows are
plain tensors, not parameters, so nothing can move them); each layer's gate gains one row
(weight [d] and bias) for the new expert. The data mixes the new domain (alone and paired with
each old one) with a replay of the old domains, so the route supervision teaches the new row
where to fire and, on replay tokens, where not to; a hinge keeps its logit below the old
top-k on those tokens (every token of a replay prompt, template included). Serving mixes only
the top-k experts' logits, so wherever the new row stays out of the top-k a token routes exactly
as before; a last calibration on held-out prompts lowers each layer's new bias until that holds
on all but a set quantile of the old domains' tokens, then gives back as much of that shift as
leaves the old composition's greedy answers on held-out old-domain prompts unchanged (a domain
the gate cannot tell from the new one would otherwise shut the new expert out of its own).
"""

from __future__ import annotations

import random

import torch

from molora_runtime.model.attention_meta import DenseAttention
from molora_runtime.model.decoder import CausalLM
from molora_runtime.training.answer_check import adapted_layers, relaxed_scale
from molora_runtime.training.batching import IGNORE
from molora_runtime.training.data import (
    Example,
    Task,
    domain_examples,
    generate_tasks,
    mixed_examples,
)
from molora_runtime.training.experts import Gates, TrainableGates, learned_context
from molora_runtime.training.grown_gates import GrownGates
from molora_runtime.training.router import TokenBatch

# Seeds of the new-domain tasks paired with old ones (apart from the single-domain draws).
PAIR_SEED = 7_919


def gate_inputs(
    lm: CausalLM, gates: TrainableGates, batch: TokenBatch, top_k: int, temperature: float = 1.0
) -> torch.Tensor:
    """Every layer's gate input [L, B*T, d] on `batch`, routed by `gates` at `top_k`."""
    B, T = batch.input_ids.shape
    device = batch.input_ids.device
    ctx = learned_context(gates, B * T, top_k=top_k, temperature=temperature)
    inputs: list[torch.Tensor] = []
    serve = ctx.begin_layer

    def capture(layer: int, normed: torch.Tensor) -> None:
        inputs.append(normed.float())
        serve(layer, normed)

    ctx.begin_layer = capture  # type: ignore[method-assign]
    meta = DenseAttention(batch=B, seq_len=T, positions=torch.arange(T, device=device).repeat(B))
    lm.hidden_states(batch.input_ids.reshape(-1), meta, None, ctx)
    return torch.stack(inputs)


def stay_out_mask(route_labels: torch.Tensor, valid: torch.Tensor, new_index: int) -> torch.Tensor:
    """[B, T] tokens the new row must leave to the old experts: those labelled with an old
    expert, and every valid token (template tokens too) of a prompt without the new domain."""
    is_new = route_labels == new_index
    labelled_old = (route_labels != IGNORE) & ~is_new
    replay_row = ~is_new.any(dim=-1, keepdim=True)
    return labelled_old | (valid & replay_row)


@torch.no_grad()
def prototype_init(
    lm: CausalLM,
    grown: GrownGates,
    batches: list[TokenBatch],
    margin: float = 1.0,
    temperature: float = 1.0,
) -> None:
    """Point each layer's new row from the old domains' mean gate input to the new domain's.

    With u = mean(new) - mean(old) and m their midpoint, the new logit becomes the old rows'
    mean logit plus s·u·(x - m): at m it is the mean-of-rows start, at the new domain's mean it
    clears the best old logit by `margin`, at the old domains' mean it falls as far below.
    """
    K, L = grown.new_index, grown.old_weight.shape[0]
    d = grown.old_weight.shape[2]
    device = grown.old_weight.device
    sums = torch.zeros(2, L, d, device=device)
    counts = torch.zeros(2, device=device)
    for batch in batches:
        x = gate_inputs(lm, grown, batch, K + 1, temperature)  # [L, tokens, d]
        assert batch.route_labels is not None
        labels = batch.route_labels.reshape(-1)
        is_new = labels == K
        is_old = (labels != IGNORE) & ~is_new
        sums[0] += x[:, is_old].sum(1)
        sums[1] += x[:, is_new].sum(1)
        counts += torch.stack([is_old.sum(), is_new.sum()])
    if bool((counts == 0).any()):
        return  # no labelled tokens of one side: keep the mean-of-rows start
    mu_old, mu_new = sums[0] / counts[0], sums[1] / counts[1]  # [L, d]
    u, mid = mu_new - mu_old, (mu_new + mu_old) / 2
    w_bar, b_bar = grown.old_weight.mean(1), grown.old_bias.mean(1)  # [L, d], [L]
    at_new = torch.einsum("lkd,ld->lk", grown.old_weight, mu_new) + grown.old_bias
    gap = at_new.max(1).values - at_new.mean(1)
    scale = 2 * (gap + margin) / (u * u).sum(1).clamp(min=1e-6)
    grown.new_weight.copy_((w_bar + scale[:, None] * u).unsqueeze(1))
    grown.new_bias.copy_((b_bar - scale * (u * mid).sum(1)).unsqueeze(1))


def top_k_gap(logits: torch.Tensor, new_index: int, top_k: int) -> torch.Tensor:
    """Per row of [..., K+1] logits: the new logit minus the k-th largest old one (> 0: the new
    expert takes a top-k place from an old one)."""
    old = logits[..., :new_index]
    kth = old.topk(min(top_k, new_index), dim=-1).values[..., -1]
    return logits[..., new_index] - kth


def stay_out_loss(
    gate_logits: list[torch.Tensor],
    keep: torch.Tensor,
    new_index: int,
    top_k: int,
    margin: float = 1.0,
) -> torch.Tensor:
    """On the stay-out tokens `keep` (flat bool), how far the new logit reaches into the old
    top-k: mean of relu(new - (k-th largest old) + margin) over layers and tokens."""
    total = torch.zeros((), device=keep.device)
    if not bool(keep.any()):
        return total
    for logits in gate_logits:
        gap = top_k_gap(logits[keep].float(), new_index, top_k)
        total = total + torch.relu(gap + margin).mean()
    return total / max(len(gate_logits), 1)


def refit_new_rows(
    lm: CausalLM,
    grown: GrownGates,
    batches: list[TokenBatch],
    top_k: int,
    margin: float,
    steps: int,
    temperature: float = 1.0,
) -> None:
    """Refit each adapted layer's new row as a logistic separator of the new domain's tokens
    (new logit above the best old one by `margin`, so the new expert leads their mix, as its
    adapter alone would) from the stay-out tokens (below the old k-th one by `margin`), on
    gate inputs captured once with the old composition's routes; starts from the trained row."""
    K = grown.new_index
    layers = adapted_layers(lm)
    if not layers:
        return
    old = Gates(grown.old_weight, grown.old_bias)  # type: ignore[arg-type]
    xs, refs, targets = [], [], []
    with torch.no_grad():
        for batch in batches:
            assert batch.route_labels is not None
            labels = batch.route_labels.reshape(-1)
            is_new = labels == K
            pick = is_new | stay_out_mask(batch.route_labels, batch.valid, K).reshape(-1)
            x = gate_inputs(lm, old, batch, top_k, temperature)[layers][:, pick]  # [La, n, d]
            logits = torch.einsum("lnd,lkd->lnk", x, grown.old_weight[layers])
            logits = logits + grown.old_bias[layers][:, None]
            top = logits.topk(min(top_k, K), dim=-1).values
            refs.append(torch.where(is_new[pick], top[..., 0], top[..., -1]))
            xs.append(x)
            targets.append(is_new[pick])
    x, ref, y = torch.cat(xs, 1), torch.cat(refs, 1), torch.cat(targets)
    if bool(y.all()) or not bool(y.any()):
        return
    sign = torch.where(y, -1.0, 1.0)  # softplus(-(gap - m)) on new tokens, softplus(gap + m) else
    weight = torch.where(y, 0.5 / y.sum(), 0.5 / (~y).sum())
    w = grown.new_weight.detach()[layers, 0].clone().requires_grad_(True)
    b = grown.new_bias.detach()[layers, 0].clone().requires_grad_(True)
    opt = torch.optim.Adam([w, b], lr=1e-2)
    for _ in range(steps):
        gap = torch.einsum("lnd,ld->ln", x, w) + b[:, None] - ref
        loss = (torch.nn.functional.softplus(sign * gap + margin) * weight).sum(1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        grown.new_weight[layers, 0] = w.detach()
        grown.new_bias[layers, 0] = b.detach()


@torch.no_grad()
def calibrate_new_bias(
    lm: CausalLM,
    grown: GrownGates,
    batches: list[TokenBatch],
    top_k: int,
    quantile: float,
    margin: float,
    temperature: float = 1.0,
    keep_answers: float | None = None,
    check_batches: list[TokenBatch] | None = None,
) -> dict[str, float]:
    """Lower each layer's new bias so that on held-out prompts, routed as the old composition
    serves them, the new logit stays `margin` below the old k-th one on `quantile` of each old
    domain's tokens (and of the replay prompts' template tokens); with `keep_answers`, only the
    smallest share of that shift (`relaxed_scale`) under which that share of each old domain's
    held-out prompts (`check_batches`, else `batches`) keep the old composition's greedy answer
    predictions.

    Returns, over the layers the experts adapt, the shares of old-domain tokens (all, and the
    worst domain) and of new-domain tokens whose top-k the new expert enters, before and after,
    and of new-domain tokens it leads (top-1) after.
    """
    K, L = grown.new_index, grown.old_weight.shape[0]
    old = Gates(grown.old_weight, grown.old_bias)  # type: ignore[arg-type]
    groups: list[list[torch.Tensor]] = [[] for _ in range(K + 2)]  # old i, template, new
    leads: list[torch.Tensor] = []  # new-domain tokens: new logit minus the best old one
    for batch in batches:
        x = gate_inputs(lm, old, batch, top_k, temperature)  # [L, N, d]
        logits = torch.einsum("lnd,lkd->lnk", x, grown.weight) + grown.bias[:, None]
        gap = top_k_gap(logits, K, top_k)  # [L, N]
        assert batch.route_labels is not None
        labels = batch.route_labels.reshape(-1)
        keep = stay_out_mask(batch.route_labels, batch.valid, K).reshape(-1)
        leads.append(top_k_gap(logits, K, 1)[:, labels == K])
        for i in range(K):
            groups[i].append(gap[:, labels == i])
        groups[K].append(gap[:, keep & (labels == IGNORE)])
        groups[K + 1].append(gap[:, labels == K])
    gaps = [torch.cat(g, 1) for g in groups]
    shift = torch.zeros(L, device=grown.new_bias.device)
    for g in gaps[: K + 1]:
        if g.shape[1]:
            shift = torch.maximum(shift, torch.quantile(g, quantile, dim=1) + margin)
    scale = 1.0
    if keep_answers is not None:
        check = check_batches or batches
        scale = relaxed_scale(lm, grown, check, top_k, shift, keep_answers, temperature)
    shift = shift * scale
    grown.new_bias.sub_(shift[:, None])
    adapted = adapted_layers(lm)
    none = torch.zeros_like(shift)

    def share(g: torch.Tensor, by: torch.Tensor) -> float:
        g = (g - by[:, None])[adapted]
        return round(float((g > 0).float().mean()), 4) if g.numel() else 0.0

    old_all = torch.cat(gaps[: K + 1], 1)
    return {
        "old_tokens_new_in_top_k_before": share(old_all, none),
        "old_tokens_new_in_top_k_after": share(old_all, shift),
        "worst_old_domain_after": max(share(g, shift) for g in gaps[:K]),
        "new_tokens_new_in_top_k_before": share(gaps[K + 1], none),
        "new_tokens_new_in_top_k_after": share(gaps[K + 1], shift),
        "new_tokens_new_leads_after": share(torch.cat(leads, 1), shift),
        "mean_bias_shift": round(float(shift[adapted].mean()), 4) if adapted else 0.0,
        "shift_scale": scale,
    }


def _pairs_with_new(old: list[str], new: str, count: int, seed: int, split: str) -> list[Example]:
    """Two-task prompts of the new domain and each old one in turn, in both orders."""
    if count <= 0:
        return []
    base = seed * 131 + PAIR_SEED + (1_000_000 if split == "eval" else 0)
    new_tasks = iter(generate_tasks(new, count, base))
    old_tasks: dict[str, iter] = {
        d: iter(generate_tasks(d, count, base + 1 + i)) for i, d in enumerate(old)
    }
    out = []
    for i in range(count):
        other = old[i % len(old)]
        pair: list[Task] = [next(new_tasks), next(old_tasks[other])]
        if (i // len(old)) % 2:
            pair.reverse()
        out.append(Example(tasks=pair, kind="mixed"))
    return out


def mixed_with_new(old: list[str], new: str, count: int, seed: int) -> list[Example]:
    """Eval prompts that need the new skill: the new domain paired with each old one."""
    return _pairs_with_new(old, new, count, seed, "eval")


def grow_examples(
    old: list[str],
    new: str,
    count: int,
    seed: int,
    new_fraction: float = 0.5,
    single_fraction: float = 0.5,
) -> list[Example]:
    """`count` training prompts: `new_fraction` with the new domain (alone or paired with an
    old one), the rest a replay of the old domains (alone or paired), shuffled."""
    n_new = round(count * new_fraction)
    n_new_single = round(n_new * single_fraction)
    n_old = count - n_new
    n_old_single = round(n_old * single_fraction)
    per_old = -(-n_old_single // len(old)) if old else 0
    examples = domain_examples(new, n_new_single, seed, "train")
    examples += _pairs_with_new(old, new, n_new - n_new_single, seed, "train")
    replay = [e for d in old for e in domain_examples(d, per_old, seed + 7, "train")]
    examples += replay[:n_old_single]
    if len(old) > 1:
        examples += mixed_examples(old, n_old - n_old_single, seed, "train")
    else:
        examples += replay[n_old_single:n_old]
    random.Random(seed).shuffle(examples)
    return examples
