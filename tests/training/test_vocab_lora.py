"""`--image-adapter`: image positions run the frozen adapter's LoRA, the others the trained one."""

from __future__ import annotations

from pathlib import Path

import torch

from molora_runtime.training.vocab_lora import IMAGE_ADAPTER, attach_image_adapter
from tests.training.tiny_llama import TINY_LLAMA


def _peft(lora_seed: int):
    """Same base weights every time; LoRA weights (non-zero B) drawn from `lora_seed`."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    torch.manual_seed(lora_seed)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(base, lora).eval()


def test_mask_picks_the_adapter_per_position(tmp_path: Path) -> None:
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    image = _peft(1)
    with torch.no_grad():
        image_only = image(input_ids=ids).logits
    image.save_pretrained(str(tmp_path / "image"))
    trained = _peft(2)
    with torch.no_grad():
        trained_only = trained(input_ids=ids).logits
    route = attach_image_adapter(trained, tmp_path / "image")
    with torch.no_grad():
        route.image = torch.zeros(1, 5, 1, dtype=torch.bool)
        assert torch.allclose(trained(input_ids=ids).logits, trained_only, atol=1e-5)
        route.image = torch.ones(1, 5, 1, dtype=torch.bool)
        assert torch.allclose(trained(input_ids=ids).logits, image_only, atol=1e-5)
        route.image = torch.tensor([[True, True, False, False, False]]).unsqueeze(-1)
        mixed = trained(input_ids=ids).logits
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
