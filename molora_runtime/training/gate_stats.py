"""Where a trained composition sends tokens: per-domain, per-layer top-1 adapter shares.

Runs gold (teacher-forced) answers through the serving model with the composition's learned
route and records each layer's per-token table; each position that produces an answer token is
labelled with that token's line (the labels router training uses), so mixed prompts show whether
each segment reaches its own adapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from molora_runtime.lora.composition import Composition
from molora_runtime.model.attention_meta import DenseAttention
from molora_runtime.model.decoder import CausalLM
from molora_runtime.training.batching import IGNORE, encode_routed
from molora_runtime.training.data import Example
from molora_runtime.training.experts import Gates, learned_context


@torch.no_grad()
def gate_shares(
    lm: CausalLM,
    composition: Composition,
    tokenizer,
    examples: Sequence[Example],
    top_k: int | None = None,
    layers: Sequence[int] | None = None,
) -> tuple[dict[str, list[list[float]]], float]:
    """{domain: [layer][expert] share of answer tokens whose top-1 is that expert}, one row per
    entry of `layers` (default all), and the fraction of (answer token, layer) pairs whose top-1
    is the token's own-domain expert.

    `layers` limits both to the layers the experts adapt (elsewhere the gate has no effect)."""
    experts = [ref.split("@", 1)[0] for ref in composition.config.adapters]  # domains
    gates = Gates(
        weight=torch.nn.Parameter(composition.gate_weight, requires_grad=False),
        bias=torch.nn.Parameter(
            composition.gate_bias
            if composition.gate_bias is not None
            else torch.zeros(composition.gate_weight.shape[:2]),
            requires_grad=False,
        ),
    )
    k = top_k or composition.config.top_k
    L, K = composition.gate_weight.shape[:2]
    counts = {d: torch.zeros(L, K) for d in experts}
    own_hits = own_total = 0
    layer_ids = torch.tensor(list(layers) if layers is not None else range(L), dtype=torch.long)
    for example in examples:
        ids, labels, routes = encode_routed(tokenizer, example, experts)
        ctx = learned_context(
            gates,
            len(ids),
            top_k=k,
            temperature=composition.config.temperature,
            record_layers=True,
        )
        meta = DenseAttention(batch=1, seq_len=len(ids), positions=torch.arange(len(ids)))
        lm.hidden_states(torch.tensor(ids), meta, None, ctx)
        top1 = torch.stack([slots[:, 0] for slots, _ in ctx.layer_tables]) - 1  # [L, T]
        for t, (label, own) in enumerate(zip(labels, routes, strict=True)):
            if label == IGNORE:  # count the positions that produce answer tokens
                continue
            counts[experts[own]][torch.arange(L), top1[:, t]] += 1
            picks = top1[layer_ids, t]
            own_hits += int((picks == own).sum())
            own_total += len(layer_ids)
    shares = {
        d: (c[layer_ids] / c[layer_ids].sum(1, keepdim=True).clamp(min=1)).tolist()
        for d, c in counts.items()
    }
    return shares, own_hits / max(own_total, 1)


def plot_gate_shares(
    shares: dict[str, list[list[float]]], experts: list[str], path: Path, layers: list[int]
) -> None:
    """One heat map per domain: layers on x, experts on y, colour = share of top-1 picks."""
    import matplotlib  # the optional `train` extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(shares), 1, figsize=(10, 1.3 * len(shares) + 1), sharex=True)
    for ax, (domain, grid) in zip(axes, shares.items(), strict=True):
        extent = (layers[0] - 0.5, layers[-1] + 0.5, len(experts) - 0.5, -0.5)
        im = ax.imshow(
            torch.tensor(grid).t().numpy(),
            aspect="auto",
            vmin=0,
            vmax=1,
            cmap="viridis",
            extent=extent,
        )
        ax.set_yticks(range(len(experts)), experts, fontsize=7)
        ax.set_ylabel(domain, fontsize=8)
    axes[-1].set_xlabel("decoder layer (layers the adapters adapt)")
    fig.suptitle("learned gate: share of answer tokens routed (top-1) to each adapter")
    fig.colorbar(im, ax=axes, shrink=0.8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
