"""`--init-from`: a run continues a finished adapter's exact weights, or refuses a mismatch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.tiny_llama import TINY_LLAMA


def _peft(rank: int, seed: int):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    lora = LoraConfig(r=rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)), lora)


def _lora(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_warm_start_loads_every_lora_weight(tmp_path: Path) -> None:
    from molora_runtime.training.adapter import warm_start

    saved = _peft(4, seed=0)
    saved.save_pretrained(str(tmp_path), safe_serialization=True)
    fresh = _peft(4, seed=1)
    before = _lora(fresh)
    assert any(not torch.equal(before[n], v) for n, v in _lora(saved).items())
    warm_start(fresh, tmp_path)
    for name, value in _lora(saved).items():
        torch.testing.assert_close(_lora(fresh)[name], value)


def test_warm_start_refuses_another_shape(tmp_path: Path) -> None:
    from molora_runtime.training.adapter import warm_start

    _peft(4, seed=0).save_pretrained(str(tmp_path), safe_serialization=True)
    with pytest.raises((ValueError, RuntimeError)):
        warm_start(_peft(2, seed=1), tmp_path)
