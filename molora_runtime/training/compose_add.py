"""`molora compose add`: a composition's next version with one more expert, gate rows only.

Reads the composition and the new adapter from the store, checks that they fit (the store's
rules in `adapter_store.extend`, then the base model's shapes), trains the new expert's gate
row per layer over the frozen base, frozen experts and frozen old rows (`grow`), and publishes
the result as the composition's next version; the old version is immutable and keeps serving
whoever pins it.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoTokenizer

from adapter_store.errors import InvalidInputError, VersionExistsError
from adapter_store.extend import check_new_expert, next_version
from adapter_store.manifest import AdapterManifest, CompositionManifest
from adapter_store.names import parse_ref
from adapter_store.source import AdapterStoreSource
from adapter_store.versions import Registry
from molora_runtime.lora.composition import CompositionConfig, load_composition, save_composition
from molora_runtime.model.decoder import CausalLM
from molora_runtime.model.loader import load_model
from molora_runtime.model.model_paths import resolve_model_path
from molora_runtime.training.adapter import pick_device, seed_everything
from molora_runtime.training.answer_check import check_examples
from molora_runtime.training.data import DOMAINS
from molora_runtime.training.experts import attach_experts
from molora_runtime.training.grow import (
    GrownGates,
    calibrate_new_bias,
    grow_examples,
    prototype_init,
    refit_new_rows,
    stay_out_loss,
    stay_out_mask,
)
from molora_runtime.training.record import write_card
from molora_runtime.training.router import load_experts, routed_batches, train_gates


class GrowSettings(BaseModel):
    """How the new gate rows train; recorded in the published composition's card."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(40, ge=1)
    batch_size: int = Field(8, ge=1)
    lr: float = Field(2e-2, gt=0)
    warmup: int = Field(3, ge=0)
    new_fraction: float = Field(
        0.5, gt=0, lt=1, description="share of prompts with the new domain (rest: replay)"
    )
    single_fraction: float = Field(0.5, ge=0, le=1, description="share of one-domain prompts")
    route_supervision: float = Field(1.0, ge=0)
    stay_out: float = Field(
        2.0, ge=0, description="weight of the hinge keeping the new row out of old tokens' top-k"
    )
    margin: float = Field(1.0, ge=0, description="logit margin of that hinge and of the init")
    init: Literal["prototype", "mean"] = Field(
        "prototype", description="new row from the domains' mean gate inputs, or the rows' mean"
    )
    init_batches: int = Field(4, ge=1, description="batches the prototype init reads")
    refit_steps: int = Field(
        300, ge=0, description="steps of the new rows' logistic refit on captured gate inputs"
    )
    calibrate_prompts: int = Field(
        64, ge=0, description="held-out prompts of the bias calibration (0: no calibration)"
    )
    calibrate_quantile: float = Field(
        0.9, ge=0, le=1, description="share of old-domain tokens the new row must stay out of"
    )
    calibrate_margin: float = Field(0.1, ge=0, description="logit margin of the calibration")
    calibrate_keep: float | None = Field(
        0.98,
        ge=0,
        le=1,
        description="share of each old domain's held-out prompts whose greedy answers must stay "
        "the old composition's; the calibration's bias drop is given back as far as that holds "
        "(None: keep the whole drop)",
    )
    calibrate_check_prompts: int = Field(
        64,
        ge=0,
        description="held-out one-task prompts per old domain that the answer check reads "
        "(0: the calibration's own prompts); a share of 98% needs ~50 per domain to resolve",
    )
    seed: int = 0


class ComposeAddConfig(BaseModel):
    """One `compose add`: which composition, which expert, its data, the version to publish."""

    model_config = ConfigDict(extra="forbid")

    composition: str = Field(description="composition ref, `name` (latest) or `name@version`")
    adapter: str = Field(description="the new expert's ref in the same store")
    data: str | None = Field(None, description="training domain of the new expert (its name)")
    version: str | None = Field(None, description="version to publish (default: next v<N>)")
    top_k: int | None = Field(None, ge=1, description="serving top-k (default: unchanged)")
    description: str | None = None
    device: str = "auto"
    threads: int | None = Field(None, ge=1)
    grow: GrowSettings = Field(default_factory=GrowSettings)


@dataclass
class AddPlan:
    """Everything checked before any weight is read."""

    composition: CompositionManifest
    expert: AdapterManifest
    members: list[AdapterManifest]
    old_domains: list[str]
    new_domain: str
    version: str
    top_k: int


def plan_add(registry: Registry, cfg: ComposeAddConfig) -> AddPlan:
    """Resolve and check the composition, the expert, the data and the version to publish."""
    composition = registry.resolve("composition", cfg.composition)
    assert isinstance(composition, CompositionManifest)
    expert = registry.resolve("adapter", cfg.adapter)
    assert isinstance(expert, AdapterManifest)
    members = [registry.resolve("adapter", ref) for ref in composition.adapters]
    check_new_expert(composition, expert, members)  # type: ignore[arg-type]
    old_domains = [parse_ref(ref).name for ref in composition.adapters]
    unknown = [d for d in old_domains if d not in DOMAINS]
    if unknown:
        raise InvalidInputError(
            f"composition {composition.ref}'s experts {unknown} name no training domain "
            f"({sorted(DOMAINS)}): the replay data that teaches the new row where not to fire "
            "is drawn from the experts' domains"
        )
    new_domain = cfg.data or expert.name
    if new_domain not in DOMAINS:
        raise InvalidInputError(
            f"--data {new_domain!r} is no training domain; choose one of {sorted(DOMAINS)}"
        )
    if new_domain in old_domains:
        raise InvalidInputError(
            f"--data {new_domain!r} is already served by expert {new_domain!r} of "
            f"{composition.ref}; the new expert needs a domain of its own"
        )
    versions = [v.version for v in registry.versions("composition", composition.name)]
    version = cfg.version or next_version(versions)
    if version in versions:
        raise VersionExistsError(
            f"composition {composition.name}@{version} exists; versions are immutable"
        )
    top_k = cfg.top_k or composition.top_k
    if top_k > len(members) + 1:
        raise InvalidInputError(f"top_k={top_k} exceeds the {len(members) + 1} experts")
    return AddPlan(composition, expert, members, old_domains, new_domain, version, top_k)  # type: ignore[arg-type]


def train_new_rows(
    lm: CausalLM,
    tokenizer,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor | None,
    old_domains: list[str],
    new_domain: str,
    settings: GrowSettings,
    top_k: int,
    temperature: float = 1.0,
) -> tuple[GrownGates, float]:
    """Train the new expert's rows on `lm` (experts attached, new one last); returns the grown
    gates and the CPU seconds the training took (every thread of this process)."""
    device = lm.embed_tokens.weight.device
    lm.requires_grad_(False)
    seed_everything(settings.seed)
    grown = GrownGates.extend(gate_weight.to(device), gate_bias)
    examples = grow_examples(
        old_domains,
        new_domain,
        settings.steps * settings.batch_size,
        settings.seed,
        settings.new_fraction,
        settings.single_fraction,
    )
    batches = routed_batches(
        tokenizer, examples, [*old_domains, new_domain], settings.batch_size, device
    )
    if settings.init == "prototype":
        prototype_init(lm, grown, batches[: settings.init_batches], settings.margin, temperature)

    def hinge(gate_logits: list[torch.Tensor], batch) -> tuple[torch.Tensor, str]:
        keep = stay_out_mask(batch.route_labels, batch.valid, grown.new_index).reshape(-1)
        term = stay_out_loss(gate_logits, keep, grown.new_index, top_k, settings.margin)
        return settings.stay_out * term, "stay_out"

    cpu0 = time.process_time()
    train_gates(
        lm,
        grown,
        batches,
        lr=settings.lr,
        warmup=settings.warmup,
        balance_weight=0.0,
        entropy_weight=0.0,
        temperature=temperature,
        route_supervision=settings.route_supervision,
        label="compose add",
        extra_loss=hinge if settings.stay_out else None,
    )
    if settings.refit_steps:
        refit_new_rows(
            lm, grown, batches, top_k, settings.margin, settings.refit_steps, temperature
        )
    if settings.calibrate_prompts:
        held_out = grow_examples(
            old_domains,
            new_domain,
            settings.calibrate_prompts,
            settings.seed + 1,
            settings.new_fraction,
            settings.single_fraction,
        )
        domains = [*old_domains, new_domain]
        check = check_examples(old_domains, settings.calibrate_check_prompts, settings.seed)
        grown.routing = calibrate_new_bias(
            lm,
            grown,
            routed_batches(tokenizer, held_out, domains, 8, device),
            top_k,
            settings.calibrate_quantile,
            settings.calibrate_margin,
            temperature,
            settings.calibrate_keep,
            routed_batches(tokenizer, check, domains, 8, device) if check else None,
        )
        print(f"compose add calibration: {grown.routing}", flush=True)
    return grown, time.process_time() - cpu0


def _check_shapes(lm: CausalLM, composition: CompositionManifest) -> None:
    arch = lm.arch
    if (arch.num_layers, arch.hidden_size) != (composition.num_layers, composition.hidden_size):
        raise InvalidInputError(
            f"composition {composition.ref} has gates for {composition.num_layers} layers x "
            f"{composition.hidden_size}, but base model {composition.base_model!r} has "
            f"{arch.num_layers} x {arch.hidden_size}"
        )


def compose_add(
    registry: Registry, cfg: ComposeAddConfig, command: str | None = None
) -> tuple[CompositionManifest, float]:
    """Publish `cfg.composition` + `cfg.adapter` as the next version; returns its manifest and
    the CPU seconds of the gate training."""
    plan = plan_add(registry, cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    source = AdapterStoreSource(registry=registry)
    comp_ref = plan.composition.ref
    comp = load_composition(plan.composition.name, source.composition_path(comp_ref))
    device = pick_device(cfg.device)
    model_path = resolve_model_path(plan.composition.base_model)
    lm = load_model(model_path, dtype=torch.float32, device=device)
    _check_shapes(lm, plan.composition)
    refs = [*plan.composition.adapters, plan.expert.ref]
    attach_experts(lm, load_experts(lm, {r: str(source.adapter_path(r)) for r in refs}))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    grown, cpu_s = train_new_rows(
        lm,
        tokenizer,
        comp.gate_weight,
        comp.gate_bias,
        plan.old_domains,
        plan.new_domain,
        cfg.grow,
        plan.top_k,
        comp.config.temperature,
    )
    config = CompositionConfig(
        **comp.config.model_dump(exclude={"adapters", "top_k"}), adapters=refs, top_k=plan.top_k
    )
    description = cfg.description or (
        f"{comp_ref} + {plan.expert.ref} (gate rows of the new expert only, "
        f"{cfg.grow.steps} steps on {plan.new_domain} + replay)"
    )
    with tempfile.TemporaryDirectory(prefix="molora-compose-add-") as tmp:
        folder = save_composition(Path(tmp), config, grown.weight, grown.bias)
        card = write_card(
            folder, f"MoLoRA composition {comp_ref} + {plan.expert.ref}", cfg, command
        )
        if grown.routing:
            shares = "\n".join(f"- {k}: {v}" for k, v in grown.routing.items())
            card.write_text(f"{card.read_text()}\nRouting on held-out prompts:\n\n{shares}\n")
        manifest = registry.publish_composition(
            folder,
            plan.composition.name,
            plan.version,
            description=description,
            tenant=plan.composition.tenant,
        )
    assert isinstance(manifest, CompositionManifest)
    return manifest, cpu_s
