"""Shared fixtures of the runtime proof suite: tiny random checkpoints, PEFT adapters made with
`peft` itself, compositions, and engine builders (fp32, CPU, no CUDA graphs)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

# 2 shared cores: one intra-op thread is faster under contention and fairer to the neighbours.
torch.set_num_threads(1)

from molora_runtime.engine.engine import LLMEngine  # noqa: E402
from molora_runtime.model.model_paths import ModelNotFoundError, resolve_model_path  # noqa: E402
from tests.molora_runtime.rt_util import (  # noqa: E402
    ALL_TARGETS,
    build_engine,
    make_composition,
    make_peft_adapter,
)

SMOLLM2 = "smollm2-135m-instruct"


# ----- session fixtures ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Untied 2-layer Llama, vocab 256, no EOS (generations always run to max_tokens)."""
    from molora_runtime.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three adapters with different ranks over all 7 modules: plain, rsLoRA, rank/alpha pattern."""
    root = tmp_path_factory.mktemp("tiny-adapters")
    return {
        "a": make_peft_adapter(tiny_llama, root / "a", r=4, alpha=8, seed=1),
        "b": make_peft_adapter(tiny_llama, root / "b", r=6, alpha=4, seed=2, use_rslora=True),
        "c": make_peft_adapter(
            tiny_llama,
            root / "c",
            r=8,
            alpha=16,
            seed=3,
            rank_pattern={"q_proj": 2, "layers.1.mlp.down_proj": 12},
            alpha_pattern={"v_proj": 3, "gate_proj": 24},
        ),
    }


@pytest.fixture(scope="session")
def tiny_composition(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Learned composition over a, b, c: top-2 of 3, temperature 0.7, with gate bias."""
    return make_composition(
        tiny_llama,
        tmp_path_factory.mktemp("comp") / "moe",
        ["a", "b", "c"],
        top_k=2,
        temperature=0.7,
        seed=5,
    )


@pytest.fixture(scope="session")
def tiny_engine_factory(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tiny_composition: Path
) -> Callable[..., LLMEngine]:
    def factory(**kwargs: Any) -> LLMEngine:
        adapters = kwargs.pop("adapters", tiny_adapters)
        comps = kwargs.pop("compositions", {"moe": tiny_composition})
        return build_engine(tiny_llama, adapters, comps, **kwargs)

    return factory


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Llama with SmolLM2's tokenizer and chat template (vocab 49152, eos 2)."""
    from molora_runtime.model.tiny import make_tiny_model

    try:
        resolve_model_path(SMOLLM2)
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    return make_tiny_model(tmp_path_factory.mktemp("tiny-chat"), seed=7, with_tokenizer=True)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    try:
        return resolve_model_path(SMOLLM2)
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


SMOL_ADAPTERS: dict[str, dict[str, Any]] = {
    "s1": dict(r=4, lora_alpha=8),
    "s2": dict(r=8, lora_alpha=8, use_rslora=True),
    "s3": dict(
        r=6,
        lora_alpha=12,
        rank_pattern={"q_proj": 2, "layers.3.mlp.down_proj": 10},
        alpha_pattern={"v_proj": 3, "layers.5.mlp.up_proj": 20},
    ),
}


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """SmolLM2-135M loaded once per session, both ways: `peft` is the transformers model wrapped
    in a PeftModel holding adapters s1, s2 (rsLoRA), s3 (rank/alpha patterns) — use
    `peft.disable_adapter()` for the plain base model — and `engine` is an fp32 LLMEngine
    serving the same adapters from the folders PEFT saved."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("smol-adapters")
    pm = None
    for i, (name, kw) in enumerate(SMOL_ADAPTERS.items()):
        torch.manual_seed(100 + i)
        cfg = LoraConfig(target_modules=ALL_TARGETS, init_lora_weights=False, **kw)
        if pm is None:
            pm = get_peft_model(hf, cfg, adapter_name=name)
        else:
            pm.add_adapter(name, cfg)
    assert pm is not None
    pm.eval()
    folders = {}
    for name in SMOL_ADAPTERS:
        pm.save_pretrained(str(root), selected_adapters=[name])
        folders[name] = root / name
        assert (folders[name] / "adapter_model.safetensors").is_file()
    engine = build_engine(
        smollm2_path, folders, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=256
    )
    return SimpleNamespace(peft=pm, engine=engine, adapters=folders, path=smollm2_path)


@pytest.fixture(scope="module")
def peft_abc(tiny_llama: Path, tiny_adapters: dict[str, Path]):
    """PEFT's own model of the tiny Llama with adapters a, b and c loaded (the reference); one per
    module, so a module may add adapters to it. peft is the `train` extra: imported here."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    pm = PeftModel.from_pretrained(base, str(tiny_adapters["a"]), adapter_name="a")
    pm.load_adapter(str(tiny_adapters["b"]), adapter_name="b")
    pm.load_adapter(str(tiny_adapters["c"]), adapter_name="c")
    return pm.eval()
