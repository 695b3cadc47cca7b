"""What a step runs on, shared by the eager forward (model_runner.py) and its CUDA-graph twin
(cuda_graph.py), so neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from molora_runtime.lora.hotset import HotSet
from molora_runtime.model.attention_meta import KVCache
from molora_runtime.model.decoder import CausalLM


@dataclass(frozen=True)
class StepModel:
    """What a step runs on: the model, its paged KV cache, the hot-set (slot buffers, gate
    table), the route table's width (adapters per token) and their device. The eager forward and
    its CUDA-graph twin both take this one object, so the two always run the same model over the
    same KV cache and slot buffers."""

    model: CausalLM
    kv: KVCache
    hot_set: HotSet
    width: int
    device: torch.device
