"""`molora train adapter`: LoRA training of one domain adapter with PEFT, saved as a PEFT folder.

The base stays frozen; only the LoRA A/B matrices train, on answer tokens only. The data is
drawn from the domain's generator with the training seed range, so the run is a pure function of
its config: same config + seed, same adapter (on one device type). Checkpoints (safetensors +
json) let an interrupted run resume where it stopped.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from adapter_store.peft_config import ADAPTER_WEIGHTS
from molora_runtime.config import DEFAULT_MODEL, LORA_TARGET_MODULES
from molora_runtime.model.model_paths import resolve_model_path
from molora_runtime.multimodal.digits import MULTIMODAL_DOMAINS, training_examples
from molora_runtime.training.batching import answer_loss, collate, encode_example
from molora_runtime.training.checkpoint import load_checkpoint, save_checkpoint
from molora_runtime.training.data import DOMAINS, domain_examples
from molora_runtime.training.progress import Progress
from molora_runtime.training.record import write_card
from molora_runtime.training.vocab_lora import attach_frozen_adapter


def _frozen_adapter(positions: str) -> Any:
    """The field of a frozen PEFT folder that serves `positions` while the trained one serves
    the rest (training as a vocab route serves)."""
    return Field(
        None,
        description=f"PEFT folder (frozen) that serves {positions} positions, as a vocab route does",
    )


class AdapterTrainConfig(BaseModel):
    """Everything that determines an adapter; recorded next to it as `training_config.json`."""

    model_config = ConfigDict(extra="forbid")

    model: str = DEFAULT_MODEL
    domain: str
    output: str = Field(description="PEFT folder to write")
    rank: int = Field(8, ge=1, le=256)
    alpha: float = Field(16.0, gt=0)
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGET_MODULES))
    first_layer: int = Field(
        0, ge=0, description="adapt layers from this one up; later start = cheaper backward"
    )
    steps: int = Field(150, ge=1)
    stop_at: int | None = Field(
        None,
        ge=1,
        description="end after this step (of the `steps` schedule) and save the adapter there; "
        "resumes a checkpoint of the full run, so a stopped run's checkpoint becomes an adapter",
    )
    batch_size: int = Field(8, ge=1)
    lr: float = Field(2e-3, gt=0)
    warmup: int = Field(10, ge=0)
    seed: int = 0
    max_tasks: int = Field(2, ge=1, le=4, description="tasks per training example")
    checkpoint_every: int = Field(50, ge=1)
    save_dtype: str = Field("bfloat16", pattern="^(bfloat16|float32)$")
    device: str = "auto"
    threads: int | None = Field(None, ge=1, description="torch CPU threads")
    loss_per_example: bool = Field(
        False, description="mean loss per example, then over the batch (short answers count)"
    )
    mixture: dict[str, float] | None = Field(
        None, description="multimodal domains only: task kind -> share, replacing the default"
    )
    image_adapter: str | None = _frozen_adapter("image-range")
    code_dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="multimodal domains only: share of the answer's input image codes "
        "replaced by random codes (labels kept), so the prompt's digit must be used",
    )
    text_adapter: str | None = _frozen_adapter("text")
    routed_fraction: float = Field(
        1.0,
        ge=0,
        le=1,
        description="with image_adapter/text_adapter: share of steps trained routed (seeded); "
        "the others train the adapter alone on every position",
    )
    init_from: str | None = Field(
        None, description="PEFT folder (same rank, layers, modules) whose weights start the run"
    )

    def resume_key(self) -> dict:
        """Fields that must match for a checkpoint to be resumed. Fields added after checkpoints
        were written (the later draw options) count only when set, so those still resume."""
        key = self.model_dump(
            exclude={"output", "checkpoint_every", "device", "threads", "stop_at"}
        )
        for name, default in _LATER_FIELDS.items():
            if key.get(name) == default:
                del key[name]
        return key


_LATER_FIELDS = {"code_dropout": 0.0, "text_adapter": None, "routed_fraction": 1.0}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def lr_at(step: int, cfg_steps: int, warmup: int, lr: float) -> float:
    """Linear warm-up then cosine decay to 10%."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(cfg_steps - warmup, 1)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def load_base(model: str, device: torch.device):
    """The frozen base model and its tokenizer, in float32 for stable small-batch training."""

    path = resolve_model_path(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    lm.requires_grad_(False)
    return lm, tokenizer


def train_adapter(cfg: AdapterTrainConfig) -> Path:
    """Train and save one adapter; resumes from `<output>/checkpoint` when present."""
    from peft import LoraConfig, get_peft_model  # the optional `train` extra

    if cfg.domain not in DOMAINS and cfg.domain not in MULTIMODAL_DOMAINS:
        known = sorted([*DOMAINS, *MULTIMODAL_DOMAINS])
        raise ValueError(f"unknown domain {cfg.domain!r}; known: {known}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    device = pick_device(cfg.device)
    base, tokenizer = load_base(cfg.model, device)
    num_layers = base.config.num_hidden_layers
    if cfg.first_layer >= num_layers:
        raise ValueError(f"first_layer={cfg.first_layer} but the model has {num_layers} layers")
    lora = LoraConfig(
        layers_to_transform=list(range(cfg.first_layer, num_layers)) if cfg.first_layer else None,
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=0.0,
        target_modules=cfg.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora)
    if cfg.init_from:
        warm_start(model, Path(cfg.init_from))
    route = None
    if cfg.image_adapter and cfg.text_adapter:
        raise ValueError("image_adapter and text_adapter exclude each other")
    if cfg.image_adapter or cfg.text_adapter:
        at = "image" if cfg.image_adapter else "text"
        route = attach_frozen_adapter(model, Path(cfg.image_adapter or cfg.text_adapter), at=at)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(params.values(), lr=cfg.lr, weight_decay=0.0)

    out = Path(cfg.output)
    ckpt = out / "checkpoint"
    meta = load_checkpoint(ckpt, params, optimizer, cfg.resume_key())
    start = meta["step"] if meta else 0
    if start:
        print(f"[adapter] resumed from step {start}", flush=True)

    encoded = _encoded_examples(cfg, tokenizer)
    inner = model.get_base_model()
    progress = Progress(cfg.steps, start=start, label=f"adapter:{cfg.domain}")
    model.train()
    end = min(cfg.stop_at or cfg.steps, cfg.steps)
    if start > end:
        raise ValueError(f"checkpoint is at step {start}, past stop_at={cfg.stop_at}")
    for step in range(start, end):
        batch = collate(encoded[step * cfg.batch_size : (step + 1) * cfg.batch_size], 0)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.steps, cfg.warmup, cfg.lr)
        if route is not None:
            if routed_step(cfg, step):
                route.set(batch.input_ids.to(device))
            else:
                route.image = None
        hidden = inner.model(
            input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device)
        ).last_hidden_state
        loss = answer_loss(
            hidden, inner.lm_head, batch.labels.to(device), per_example=cfg.loss_per_example
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        optimizer.step()
        progress.update(step + 1, loss.item())
        if (step + 1) % cfg.checkpoint_every == 0 and step + 1 < end:
            save_checkpoint(ckpt, step + 1, params, optimizer, cfg.resume_key())

    save_peft_folder(model, out, cfg)
    if end < cfg.steps:  # stopped early: keep the checkpoint (it is where this adapter stands)
        if start < end:
            save_checkpoint(ckpt, end, params, optimizer, cfg.resume_key())
        return out
    if ckpt.exists():
        for f in ckpt.iterdir():
            f.unlink()
        ckpt.rmdir()
    return out


def routed_step(cfg: AdapterTrainConfig, step: int) -> bool:
    """Does `step` train routed (frozen adapter on its side)? Seeded per step, so resumable."""
    if cfg.routed_fraction >= 1:
        return True
    return random.Random(f"routed-{cfg.seed}-{step}").random() < cfg.routed_fraction


def warm_start(model, folder: Path) -> None:
    """Load a finished adapter's LoRA weights so a run continues it (a fresh schedule and data).

    Every LoRA weight must be covered and match in shape: a partial start would silently train
    some matrices from zero.
    """
    from peft import set_peft_model_state_dict  # the optional `train` extra

    weights = {k: v.float() for k, v in load_file(str(folder / ADAPTER_WEIGHTS)).items()}
    result = set_peft_model_state_dict(model, weights)
    lora = [n for n, p in model.named_parameters() if p.requires_grad]
    missing = [k for k in result.missing_keys if k in lora]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"init_from {folder.name}: {len(missing)} LoRA weights missing, "
            f"{len(result.unexpected_keys)} unexpected (rank, layers or modules differ)"
        )


def _encoded_examples(cfg: AdapterTrainConfig, tokenizer) -> list[tuple[list[int], list[int]]]:
    """The run's (ids, labels): a reasoning-gym domain, or a multimodal digits adapter."""
    count = cfg.steps * cfg.batch_size
    if cfg.domain in MULTIMODAL_DOMAINS:
        return training_examples(
            tokenizer, cfg.domain, count, cfg.seed, cfg.mixture, cfg.code_dropout
        )
    if cfg.mixture or cfg.code_dropout:
        raise ValueError("mixture and code_dropout apply to the multimodal domains only")
    examples = domain_examples(cfg.domain, count, cfg.seed, "train", max_tasks=cfg.max_tasks)
    return [encode_example(tokenizer, e) for e in examples]


def public_config(cfg: AdapterTrainConfig) -> AdapterTrainConfig:
    """The config as recorded: output folder shown by name only (no machine paths)."""
    update = {"output": Path(cfg.output).name}
    for key in ("init_from", "image_adapter", "text_adapter"):
        if getattr(cfg, key):
            update[key] = Path(getattr(cfg, key)).name
    return cfg.model_copy(update=update)


def save_peft_folder(model, out: Path, cfg: AdapterTrainConfig) -> None:
    """Write a standard PEFT folder, weights cast to `save_dtype`, base named by alias not path."""
    model.save_pretrained(str(out), selected_adapters=["default"])
    # PEFT's own model card embeds local paths; ours (README.md) replaces it below.
    weights = out / ADAPTER_WEIGHTS
    dtype = getattr(torch, cfg.save_dtype)
    tensors = {k: v.to(dtype).contiguous() for k, v in load_file(str(weights)).items()}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    conf_path = out / "adapter_config.json"
    conf = json.loads(conf_path.read_text())
    conf["base_model_name_or_path"] = cfg.model
    conf_path.write_text(json.dumps(conf, indent=2) + "\n")
    write_card(out, f"LoRA adapter `{cfg.domain}`", public_config(cfg))
