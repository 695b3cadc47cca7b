"""`molora train router`: train only a composition's per-layer gates (base, adapters frozen).

The forward is the serving model's own (`CausalLM.hidden_states` with a learned `LoRAContext`),
so the gates are trained through exactly the code that serves them. Training routes densely
(top-k = K: softmax over all experts) because a top-1 softmax has no gradient; a load-balancing
term (Switch-style, K·Σ fᵢPᵢ) keeps experts in use, and a small entropy term makes each token's
choice confident so the served top-1/top-2 gate behaves like the trained dense one. The training
data knows which domain each question and answer line comes from (the datasets the experts were
trained on), so an optional supervision term adds the cross-entropy of every layer's gate
against that domain: the LM loss alone sees little of the routing signal in a short budget.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import AutoTokenizer

from molora_runtime.config import DEFAULT_MODEL, LORA_TARGET_MODULES
from molora_runtime.lora.composition import CompositionConfig, save_composition
from molora_runtime.lora.peft_adapter import read_peft_adapter
from molora_runtime.model.attention_meta import DenseAttention
from molora_runtime.model.decoder import CausalLM
from molora_runtime.model.loader import load_model
from molora_runtime.model.model_paths import resolve_model_path
from molora_runtime.training.adapter import lr_at, pick_device, seed_everything
from molora_runtime.training.batching import IGNORE, collate, encode_routed
from molora_runtime.training.checkpoint import load_checkpoint, save_checkpoint
from molora_runtime.training.data import DOMAINS, domain_examples, mixed_examples
from molora_runtime.training.experts import Gates, TrainableGates, attach_experts, learned_context
from molora_runtime.training.progress import Progress
from molora_runtime.training.record import write_card


class RouterTrainConfig(BaseModel):
    """Everything that determines a composition's gates; recorded next to it."""

    model_config = ConfigDict(extra="forbid")

    model: str = DEFAULT_MODEL
    adapters: dict[str, str] = Field(
        description="expert ref (`domain` or `domain@version`) -> PEFT folder, in gate order"
    )
    output: str
    top_k: int = Field(2, ge=1, description="the composition's serving top-k")
    temperature: float = Field(1.0, gt=0)
    steps: int = Field(100, ge=1)
    batch_size: int = Field(8, ge=1)
    lr: float = Field(5e-3, gt=0)
    warmup: int = Field(5, ge=0)
    balance_weight: float = Field(0.01, ge=0)
    entropy_weight: float = Field(0.01, ge=0)
    single_fraction: float = Field(0.5, ge=0, le=1)
    route_supervision: float = Field(
        1.0, ge=0, description="weight of the gate-vs-known-domain cross-entropy (0 = LM only)"
    )
    seed: int = 0
    checkpoint_every: int = Field(50, ge=1)
    device: str = "auto"
    threads: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> RouterTrainConfig:
        unknown = sorted(set(self.domains()) - set(DOMAINS))
        if unknown:
            raise ValueError(
                f"adapters {unknown} name no training domain; experts must be named after "
                f"their domains ({sorted(DOMAINS)}) so mixed data can be drawn"
            )
        if self.top_k > len(self.adapters):
            raise ValueError(f"top_k={self.top_k} exceeds the {len(self.adapters)} adapters")
        return self

    def domains(self) -> list[str]:
        """The training domain of each expert: its ref without the version."""
        return [ref.split("@", 1)[0] for ref in self.adapters]

    def resume_key(self) -> dict:
        return self.model_dump(exclude={"output", "checkpoint_every", "device", "threads"})


@dataclass
class TokenBatch:
    """Right-padded [B, T] ids with next-token labels (IGNORE where not trained)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor  # [B, T] bool, real (non-pad) tokens
    route_labels: torch.Tensor | None = None  # [B, T] expert index per position, IGNORE if none

    def to(self, device: torch.device) -> TokenBatch:
        labels = None if self.route_labels is None else self.route_labels.to(device)
        return TokenBatch(
            self.input_ids.to(device), self.labels.to(device), self.valid.to(device), labels
        )


def balance_loss(gate_logits: list[torch.Tensor], valid: torch.Tensor) -> torch.Tensor:
    """Switch-Transformer load balance K·Σᵢ fᵢ·Pᵢ averaged over layers (1.0 when uniform)."""
    total = torch.zeros((), device=valid.device)
    for logits in gate_logits:
        probs = torch.softmax(logits[valid].float(), dim=-1)
        K = probs.shape[-1]
        frac = torch.nn.functional.one_hot(probs.argmax(-1), K).float().mean(0)
        total = total + K * (frac * probs.mean(0)).sum()
    return total / max(len(gate_logits), 1)


def mean_entropy(gate_logits: list[torch.Tensor], valid: torch.Tensor) -> torch.Tensor:
    total = torch.zeros((), device=valid.device)
    for logits in gate_logits:
        logp = torch.log_softmax(logits[valid].float(), dim=-1)
        total = total - (logp.exp() * logp).sum(-1).mean()
    return total / max(len(gate_logits), 1)


def supervision_loss(gate_logits: list[torch.Tensor], route_labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each layer's gate against the known expert, averaged over layers."""
    keep = route_labels != IGNORE
    total = torch.zeros((), device=route_labels.device)
    if not bool(keep.any()):
        return total
    for logits in gate_logits:
        total = total + torch.nn.functional.cross_entropy(logits[keep].float(), route_labels[keep])
    return total / max(len(gate_logits), 1)


# An added loss term over (gate logits of every layer, batch): its value and its log name.
ExtraLoss = Callable[[list[torch.Tensor], "TokenBatch"], tuple[torch.Tensor, str]]


def routed_loss(
    lm: CausalLM,
    gates: TrainableGates,
    batch: TokenBatch,
    balance_weight: float,
    entropy_weight: float,
    temperature: float = 1.0,
    route_supervision: float = 0.0,
    extra_loss: ExtraLoss | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """LM loss on labelled tokens with dense learned routing, plus balance and entropy terms."""
    B, T = batch.input_ids.shape
    K = gates.weight.shape[1]
    ctx = learned_context(gates, B * T, top_k=K, temperature=temperature, return_gate_logits=True)
    meta = DenseAttention(
        batch=B, seq_len=T, positions=torch.arange(T, device=batch.input_ids.device).repeat(B)
    )
    hidden = lm.hidden_states(batch.input_ids.reshape(-1), meta, None, ctx)
    labels = batch.labels.reshape(-1)
    keep = labels != IGNORE
    ce = torch.nn.functional.cross_entropy(lm.logits(hidden[keep]), labels[keep])
    valid = batch.valid.reshape(-1)
    bal = balance_loss(ctx.gate_logits, valid)
    ent = mean_entropy(ctx.gate_logits, valid)
    loss = ce + balance_weight * bal + entropy_weight * ent
    parts = {"ce": ce.item(), "balance": bal.item(), "entropy": ent.item()}
    if route_supervision and batch.route_labels is not None:
        sup = supervision_loss(ctx.gate_logits, batch.route_labels.reshape(-1))
        loss = loss + route_supervision * sup
        parts["route"] = sup.item()
    if extra_loss is not None:
        term, name = extra_loss(ctx.gate_logits, batch)
        loss = loss + term
        parts[name] = term.item()
    return loss, parts


def train_gates(
    lm: CausalLM,
    gates: TrainableGates,
    batches: list[TokenBatch],
    *,
    lr: float,
    warmup: int = 0,
    balance_weight: float = 0.01,
    entropy_weight: float = 0.01,
    temperature: float = 1.0,
    route_supervision: float = 0.0,
    start: int = 0,
    stop: int | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    on_step=None,
    label: str = "router",
    extra_loss: ExtraLoss | None = None,
) -> torch.optim.Optimizer:
    """Optimise only the gate tensors over `batches` (one step each), steps [start, stop)."""
    params = list(gates.params().values())
    optimizer = optimizer or torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    progress = Progress(len(batches), start=start, label=label)
    for step in range(start, len(batches) if stop is None else stop):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, len(batches), warmup, lr)
        loss, parts = routed_loss(
            lm,
            gates,
            batches[step],
            balance_weight,
            entropy_weight,
            temperature,
            route_supervision,
            extra_loss,
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        progress.update(step + 1, loss.item(), **parts)
        if on_step is not None:
            on_step(step + 1, optimizer)
    return optimizer


def token_batch(
    encoded: list[tuple[list[int], list[int]]],
    pad_id: int,
    route_labels: list[list[int]] | None = None,
) -> TokenBatch:
    b = collate(encoded, pad_id)
    routes = None
    if route_labels is not None:
        routes = torch.full_like(b.labels, IGNORE)
        for row, lab in enumerate(route_labels):
            routes[row, : len(lab)] = torch.tensor(lab)
    return TokenBatch(
        input_ids=b.input_ids, labels=b.labels, valid=b.attention_mask.bool(), route_labels=routes
    )


def router_examples(domains: list[str], count: int, seed: int, single_fraction: float):
    """Mixed two-domain prompts plus single-domain lists, shuffled deterministically."""
    n_single = round(count * single_fraction)
    per_domain = -(-n_single // len(domains))
    singles = [e for d in domains for e in domain_examples(d, per_domain, seed + 7, "train")]
    mixed = mixed_examples(domains, count - n_single, seed, "train")
    rng = random.Random(seed)
    examples = singles[:n_single] + mixed
    rng.shuffle(examples)
    return examples


def load_experts(lm: CausalLM, adapters: dict[str, str]):

    return [
        read_peft_adapter(name, folder, lm.arch, list(LORA_TARGET_MODULES), max_rank=256)
        for name, folder in adapters.items()
    ]


def iter_chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def routed_batches(
    tokenizer, examples: list, domains: list[str], batch_size: int, device: torch.device
) -> list[TokenBatch]:
    """Examples as padded batches whose route labels index `domains` (the gate order)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batches = []
    for chunk in iter_chunks(examples, batch_size):
        encoded = [encode_routed(tokenizer, e, domains) for e in chunk]
        pairs = [(ids, labels) for ids, labels, _ in encoded]
        batches.append(token_batch(pairs, pad, [routes for *_, routes in encoded]).to(device))
    return batches


def public_config(cfg: RouterTrainConfig) -> RouterTrainConfig:
    """The config as recorded: folders shown by name only (no machine paths)."""
    return cfg.model_copy(
        update={
            "adapters": {ref: Path(f).name for ref, f in cfg.adapters.items()},
            "output": Path(cfg.output).name,
        }
    )


def train_router(cfg: RouterTrainConfig) -> Path:
    """Train the gates of a composition over `cfg.adapters` and save the composition folder."""

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    device = pick_device(cfg.device)
    path = resolve_model_path(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    lm = load_model(path, dtype=torch.float32, device=device)
    attach_experts(lm, load_experts(lm, cfg.adapters))
    arch = lm.arch
    gates = Gates.init(arch.num_layers, len(cfg.adapters), arch.hidden_size, cfg.seed, device)

    examples = router_examples(
        cfg.domains(), cfg.steps * cfg.batch_size, cfg.seed, cfg.single_fraction
    )
    batches = routed_batches(tokenizer, examples, cfg.domains(), cfg.batch_size, device)

    out = Path(cfg.output)
    ckpt = out / "checkpoint"
    params = gates.params()
    optimizer = torch.optim.AdamW(params.values(), lr=cfg.lr, weight_decay=0.0)
    meta = load_checkpoint(ckpt, params, optimizer, cfg.resume_key())
    start = meta["step"] if meta else 0

    def on_step(step: int, opt: torch.optim.Optimizer) -> None:
        if step % cfg.checkpoint_every == 0 and step < cfg.steps:
            save_checkpoint(ckpt, step, params, opt, cfg.resume_key())

    train_gates(
        lm,
        gates,
        batches,
        lr=cfg.lr,
        warmup=cfg.warmup,
        balance_weight=cfg.balance_weight,
        entropy_weight=cfg.entropy_weight,
        temperature=cfg.temperature,
        route_supervision=cfg.route_supervision,
        start=start,
        optimizer=optimizer,
        on_step=on_step,
    )
    config = CompositionConfig(
        base_model=cfg.model,
        adapters=list(cfg.adapters),
        top_k=cfg.top_k,
        temperature=cfg.temperature,
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
    )
    save_composition(out, config, gates.weight, gates.bias)
    write_card(out, "MoLoRA composition (learned gates)", public_config(cfg))
    if ckpt.exists():
        for f in ckpt.iterdir():
            f.unlink()
        ckpt.rmdir()
    return out
