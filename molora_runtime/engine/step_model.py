"""What a step runs on, built once by the engine: the eager runner and its CUDA-graph twin both
take it, so the two always run the same model over the same KV cache and slot buffers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from molora_runtime.lora.hotset import HotSet
from molora_runtime.model.attention_meta import KVCache
from molora_runtime.model.decoder import CausalLM


@dataclass(frozen=True)
class StepModel:
    """The model, its paged KV cache, the hot-set (slot buffers, gate table), the route table's
    width (adapters per token) and the device they live on."""

    model: CausalLM
    kv: KVCache
    hot_set: HotSet
    width: int
    device: torch.device
