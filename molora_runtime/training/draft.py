"""`molora train draft`: train the learned draft head (EAGLE-1 style) on the target's own outputs.

The target (the base model, or the base with one adapter) answers a prompt set greedily with the
serving engine, so the head learns exactly the tokens verification will accept. One teacher-forced
pass of the same decoder (`DenseAttention`, the adapter attached as a slot) then records its hidden
states after the final norm at every position, and the target's greedy token after each.
Training draws windows of `window` positions: row i gets (feature_t, token_{t+1}) and must predict
feature_{t+1} (smooth L1) and the target's next token from it (cross-entropy through the target's
frozen LM head). A second pass over the same window feeds the head its own predicted features
(after the first row), as serving's roll-out does. AdamW, float32, a cosine schedule; the head is
written as safetensors + JSON (`draft_head.py`). With `init_from` a head is tuned further, e.g. a
per-adapter copy of the shared head on that adapter's outputs.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch.nn import functional as F

from molora_runtime.config import DEFAULT_MODEL, LORA_TARGET_MODULES
from molora_runtime.engine.llm import LLM
from molora_runtime.engine.speculation.draft_head import DraftHead, DraftHeadConfig, load_head
from molora_runtime.engine.types import SamplingParams
from molora_runtime.lora.peft_adapter import read_peft_adapter
from molora_runtime.model.attention_meta import DenseAttention
from molora_runtime.model.decoder import CausalLM
from molora_runtime.model.loader import load_model
from molora_runtime.model.model_paths import resolve_model_path
from molora_runtime.training.adapter import lr_at
from molora_runtime.training.data import DOMAINS, domain_examples, mixed_examples
from molora_runtime.training.experts import attach_experts, static_context
from molora_runtime.training.progress import Progress

Prompt = list[int] | list[dict[str, str]]
FEATURE_CHUNK = 8  # sequences per teacher-forced pass when recording features


class DraftTrainConfig(BaseModel):
    """What `molora train draft` trains the head on and how."""

    model_config = ConfigDict(extra="forbid")

    model: str = DEFAULT_MODEL
    output: str = Field(description="folder the head is written to")
    adapter: str | None = Field(
        None, description="NAME=PEFT_FOLDER: train on that adapter's outputs"
    )
    init_from: str | None = Field(None, description="a head folder to tune further")
    domains: list[str] = Field(
        default_factory=lambda: ["arithmetic", "sorting", "counting", "reversal"],
        description="reasoning-gym domains of the prompt set (molora_runtime.training.data)",
    )
    sequences: int = Field(256, ge=1, le=100_000, description="prompts answered by the target")
    max_tokens: int = Field(96, ge=2, le=2048, description="tokens generated per prompt")
    window: int = Field(5, ge=2, le=16, description="positions per training window")
    steps: int = Field(300, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(1e-3, gt=0)
    seed: int = 0
    threads: int | None = None

    @field_validator("domains")
    @classmethod
    def _known_domains(cls, value: list[str]) -> list[str]:
        unknown = [d for d in value if d not in DOMAINS]
        if unknown or not value:
            raise ValueError(
                f"unknown domain {unknown[0]!r}; known: {sorted(DOMAINS)}"
                if unknown
                else "no domain"
            )
        return value

    def adapter_pair(self) -> tuple[str, str] | None:
        if self.adapter is None:
            return None
        name, sep, folder = self.adapter.partition("=")
        if not sep or not name or not folder:
            raise ValueError(f"adapter {self.adapter!r} must be NAME=PEFT_FOLDER")
        return name, folder


@dataclass
class Recorded:
    """The target's sequences (prompt + greedy answer), its final-norm hidden states at every
    position and its greedy next token after each."""

    tokens: list[torch.Tensor]  # [L_i]
    features: list[torch.Tensor]  # [L_i, h]
    labels: list[torch.Tensor]  # [L_i]: argmax of the target's logits at each position
    logit_scale: float = (
        1.0  # sharpens the draft's cross-entropy where the target's logits are flat
    )


def task_prompts(domains: list[str], count: int, seed: int) -> list[Prompt]:
    """Chat prompts of the training split: single-domain lists and mixed pairs, half each."""
    mixed = mixed_examples(domains, count // 2, seed, "train") if len(domains) > 1 else []
    per = -(-(count - len(mixed)) // len(domains))
    singles = [e for d in domains for e in domain_examples(d, per, seed + 11, "train")]
    examples = mixed + singles[: count - len(mixed)]
    random.Random(seed).shuffle(examples)
    return [e.messages() for e in examples]


def generate(
    model: str, prompts: Sequence[Prompt], max_tokens: int, adapter: tuple[str, str] | None
) -> list[list[int]]:
    """prompt + greedy answer of every prompt, from the serving engine (fp32, no speculation)."""
    adapters = {adapter[0]: adapter[1]} if adapter is not None else None
    llm = LLM(
        model, adapters=adapters, dtype="float32", device="cpu", enable_prefix_caching=False,
        max_num_seqs=16, max_model_len=min(4096, 512 + max_tokens),
    )  # fmt: skip
    route = adapter[0] if adapter is not None else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    results = llm.generate(list(prompts), params, routes=route)
    return [r.prompt_token_ids + r.token_ids for r in results]


def target_model(model: str, adapter: tuple[str, str] | None) -> CausalLM:
    """The frozen target in float32 (the adapter attached as slot 1 when given)."""
    lm = load_model(resolve_model_path(model), torch.float32, "cpu").eval().requires_grad_(False)
    if adapter is not None:
        name, folder = adapter
        weights = read_peft_adapter(name, folder, lm.arch, list(LORA_TARGET_MODULES), 256)
        attach_experts(lm, [weights])
    return lm


@torch.no_grad()
def record(lm: CausalLM, sequences: list[list[int]], on_adapter: bool) -> Recorded:
    """Hidden states and greedy next tokens of every position, a few sequences per pass."""
    out = Recorded([], [], [])
    spread: list[torch.Tensor] = []
    for i in range(0, len(sequences), FEATURE_CHUNK):
        chunk = sequences[i : i + FEATURE_CHUNK]
        B, T = len(chunk), max(len(s) for s in chunk)
        ids = torch.zeros(B, T, dtype=torch.long)
        for b, s in enumerate(chunk):
            ids[b, : len(s)] = torch.tensor(s)  # right padding: causal rows never see it
        meta = DenseAttention(B, T, torch.arange(T).repeat(B))
        ctx = static_context(torch.ones(B * T, dtype=torch.long)) if on_adapter else None
        hidden = lm.hidden_states(ids.flatten(), meta, None, ctx).view(B, T, -1)
        logits = lm.logits(hidden.flatten(0, 1))
        labels = logits.argmax(-1).view(B, T)
        spread.append(logits.std(dim=-1))
        for b, s in enumerate(chunk):
            out.tokens.append(ids[b, : len(s)].clone())
            out.features.append(hidden[b, : len(s)].clone())
            out.labels.append(labels[b, : len(s)].clone())
    # The loss only needs the target's argmax: logits with a spread under 1 (a tiny random model)
    # are scaled up to it, so the cross-entropy still separates the top token.
    out.logit_scale = max(1.0, 1.0 / float(torch.cat(spread).mean()))
    return out


def windows(
    data: Recorded, picks: list[tuple[int, int]], w: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(features_t, tokens_{t+1}, features_{t+1}, target tokens after t+1) for t in [s, s+w) of
    each picked (sequence, start)."""
    f_in, tok, f_out, lab = [], [], [], []
    for i, s in picks:
        f, x, y = data.features[i], data.tokens[i], data.labels[i]
        f_in.append(f[s : s + w])
        tok.append(x[s + 1 : s + w + 1])
        f_out.append(f[s + 1 : s + w + 1])
        lab.append(y[s + 1 : s + w + 1])
    return torch.stack(f_in), torch.stack(tok), torch.stack(f_out), torch.stack(lab)


def window_loss(
    head: DraftHead, lm: CausalLM, batch: tuple[torch.Tensor, ...], scale: float = 1.0
) -> tuple[torch.Tensor, float]:
    """Teacher-forced pass + a pass on the head's own features; (loss, the second pass's
    top-1 agreement with the target)."""
    f_in, tok, f_out, lab = batch
    pred = head(f_in, tok, lm)
    own = torch.cat([f_in[:, :1], pred[:, :-1].detach()], dim=1)
    pred2 = head(own, tok, lm)
    loss = torch.zeros(())
    for p in (pred, pred2):
        logits = lm.logits(p.flatten(0, 1)) * scale
        loss = loss + F.cross_entropy(logits, lab.flatten()) + F.smooth_l1_loss(p, f_out)
    with torch.no_grad():
        agree = (lm.logits(pred2.flatten(0, 1)).argmax(-1) == lab.flatten()).float().mean()
    return loss, float(agree)


def train_head(
    lm: CausalLM, data: Recorded, cfg: DraftTrainConfig, head: DraftHead | None = None
) -> DraftHead:
    """Train `head` (a new one from the target's last layer when None) on `data`."""
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    if head is None:
        head = DraftHead.from_target(lm, DraftHeadConfig.for_arch(lm.arch), seed=cfg.seed)
    head.train().requires_grad_(True)
    head.rope.requires_grad_(False)
    usable = [i for i, t in enumerate(data.tokens) if len(t) > cfg.window + 1]
    if not usable:
        raise ValueError(f"no recorded sequence is longer than window + 1 = {cfg.window + 1}")
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    progress = Progress(cfg.steps, every=max(cfg.steps // 10, 1), label="draft")
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.steps, max(cfg.steps // 20, 1), cfg.lr)
        picks = []
        for _ in range(cfg.batch_size):
            i = rng.choice(usable)
            picks.append((i, rng.randrange(len(data.tokens[i]) - cfg.window)))
        batch = windows(data, picks, cfg.window)
        loss, agree = window_loss(head, lm, batch, data.logit_scale)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        progress.update(step + 1, float(loss.detach()), agree=agree)
    head.eval().requires_grad_(False)
    return head


def train_draft(cfg: DraftTrainConfig, prompts: Sequence[Prompt] | None = None) -> Path:
    """Generate, record, train and save one head; returns its folder. `prompts` replaces the
    reasoning-gym prompt set (token ids or chat messages)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    adapter = cfg.adapter_pair()
    started = time.monotonic()
    prompts = prompts if prompts is not None else task_prompts(cfg.domains, cfg.sequences, cfg.seed)
    sequences = generate(cfg.model, prompts[: cfg.sequences], cfg.max_tokens, adapter)
    lm = target_model(cfg.model, adapter)
    data = record(lm, sequences, adapter is not None)
    print(f"recorded {len(sequences)} sequences in {time.monotonic() - started:.0f} s", flush=True)
    head = load_head(cfg.init_from, lm) if cfg.init_from else None
    head = train_head(lm, data, cfg, head)
    base = head.config.model_copy() if cfg.init_from else DraftHeadConfig.for_arch(lm.arch)
    head.config = base.model_copy(update={
        "base_model": cfg.model, "adapter": adapter[0] if adapter else None,
        "window": cfg.window, "trained_sequences": base.trained_sequences + len(sequences),
        "trained_steps": base.trained_steps + cfg.steps,
    })  # fmt: skip
    out = head.save(Path(cfg.output).expanduser())
    print(f"trained in {time.monotonic() - started:.0f} s", flush=True)
    return out


def public_config(cfg: DraftTrainConfig) -> DraftTrainConfig:
    """The config as recorded in the card: folder paths reduced to their names."""
    adapter = cfg.adapter_pair()
    return cfg.model_copy(update={
        "output": Path(cfg.output).name,
        "adapter": f"{adapter[0]}={Path(adapter[1]).name}" if adapter else None,
        "init_from": Path(cfg.init_from).name if cfg.init_from else None,
    })  # fmt: skip
