"""`--image-adapter`, `--text-adapter`: one side's positions run a frozen LoRA, the other trains."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from molora_runtime.training.vocab_lora import (
    IMAGE_ADAPTER,
    TEXT_ADAPTER,
    attach_image_adapter,
    attach_text_adapter,
)
from tests.support.tiny_llama import TINY_LLAMA


def _peft(lora_seed: int):
    """Same base weights every time; LoRA weights (non-zero B) drawn from `lora_seed`."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    torch.manual_seed(lora_seed)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(base, lora).eval()


IDS = torch.tensor([[1, 2, 3, 4, 5]])


def _frozen_and_trained(folder: Path) -> tuple[torch.Tensor, torch.nn.Module, torch.Tensor]:
    """The frozen adapter's logits on IDS (saved to `folder`), the adapter to train and its own."""
    frozen = _peft(1)
    with torch.no_grad():
        frozen_only = frozen(input_ids=IDS).logits
    frozen.save_pretrained(str(folder))
    trained = _peft(2)
    with torch.no_grad():
        trained_only = trained(input_ids=IDS).logits
    return frozen_only, trained, trained_only


def _attached(
    folder: Path, attach: Callable[[torch.nn.Module, Path], Any], frozen_on_image: bool
) -> tuple[torch.Tensor, torch.nn.Module, torch.Tensor, Any]:
    """The frozen adapter's logits, the trained adapter with the frozen one attached by `attach`,
    its own logits and the route; checks that every position on the frozen side (image when
    `frozen_on_image`, else text) gets the frozen adapter and every other the trained one."""
    frozen_only, trained, trained_only = _frozen_and_trained(folder)
    route = attach(trained, folder)
    with torch.no_grad():
        route.image = torch.full((1, 5, 1), not frozen_on_image, dtype=torch.bool)
        assert torch.allclose(trained(input_ids=IDS).logits, trained_only, atol=1e-5)
        route.image = torch.full((1, 5, 1), frozen_on_image, dtype=torch.bool)
        assert torch.allclose(trained(input_ids=IDS).logits, frozen_only, atol=1e-5)
    return frozen_only, trained, trained_only, route


def test_mask_picks_the_adapter_per_position(tmp_path: Path) -> None:
    image_only, trained, trained_only, route = _attached(
        tmp_path / "image", attach_image_adapter, frozen_on_image=True
    )
    with torch.no_grad():
        route.image = torch.tensor([[True, True, False, False, False]]).unsqueeze(-1)
        mixed = trained(input_ids=IDS).logits
    # causal: the first two positions see only image-adapter positions
    assert torch.allclose(mixed[:, :2], image_only[:, :2], atol=1e-5)
    assert not torch.allclose(mixed[:, 2:], trained_only[:, 2:], atol=1e-5)


def test_only_the_trained_adapter_learns(tmp_path: Path) -> None:
    _peft(1).save_pretrained(str(tmp_path / "image"))
    trained = _peft(2)
    attach_image_adapter(trained, tmp_path / "image")
    learning = [n for n, p in trained.named_parameters() if p.requires_grad]
    assert learning and all(".default." in n for n in learning)
    assert any(f".{IMAGE_ADAPTER}." in n for n, _ in trained.named_parameters())


def test_text_adapter_is_the_mirror_image(tmp_path: Path) -> None:
    """`--text-adapter` (train `draw` as the route serves it): the frozen one serves text."""
    _, trained, trained_only, route = _attached(
        tmp_path / "text", attach_text_adapter, frozen_on_image=False
    )
    with torch.no_grad():
        route.image = None  # an unrouted step: the trained adapter everywhere
        assert torch.allclose(trained(input_ids=IDS).logits, trained_only, atol=1e-5)
    learning = [n for n, p in trained.named_parameters() if p.requires_grad]
    assert learning and all(".default." in n for n in learning)
    assert any(f".{TEXT_ADAPTER}." in n for n, _ in trained.named_parameters())


def test_routed_fraction_picks_a_seeded_share_of_steps() -> None:
    from molora_runtime.training.adapter import AdapterTrainConfig, routed_step

    cfg = AdapterTrainConfig(domain="draw", output="x", text_adapter="read", routed_fraction=0.5)
    picks = [routed_step(cfg, s) for s in range(400)]
    assert 150 < sum(picks) < 250
    assert picks == [routed_step(cfg, s) for s in range(400)]
    assert all(routed_step(cfg.model_copy(update={"routed_fraction": 1.0}), s) for s in range(9))


def test_stop_at_resumes_the_full_runs_checkpoint() -> None:
    """`--stop-at N` reads the checkpoint of the same run (its schedule is the full `steps`)."""
    from molora_runtime.training.adapter import AdapterTrainConfig

    full = AdapterTrainConfig(domain="draw", output="x", steps=260, code_dropout=0.5)
    stopped = full.model_copy(update={"stop_at": 120, "output": "y"})
    assert stopped.resume_key() == full.resume_key()
    assert full.model_copy(update={"steps": 120}).resume_key() != full.resume_key()


def test_checkpoints_from_before_the_draw_options_still_resume() -> None:
    from molora_runtime.training.adapter import AdapterTrainConfig

    key = AdapterTrainConfig(domain="read", output="x").resume_key()
    assert not {"code_dropout", "text_adapter", "routed_fraction", "stop_at"} & set(key)
    assert (
        "code_dropout"
        in AdapterTrainConfig(domain="draw", output="x", code_dropout=0.5).resume_key()
    )
