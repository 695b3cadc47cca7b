"""How many KV blocks one engine gets: a byte budget, a fraction of memory, or the old default."""

from __future__ import annotations

import os

import torch

from molora_runtime.config import EngineConfig
from molora_runtime.model.arch import ModelArch
from molora_runtime.model.attention_meta import KVCache


def kv_budget_bytes(
    config: EngineConfig, per_token: int, max_len: int, device: torch.device
) -> int:
    """`kv_cache_bytes`, else `kv_cache_fraction` of free device memory (CUDA) or of host RAM,
    else room for max_num_seqs x max_len tokens (what static rows used to take)."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    if config.kv_cache_fraction is not None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
        else:
            free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(free * config.kv_cache_fraction)
    return config.max_num_seqs * max_len * per_token


def kv_num_blocks(
    config: EngineConfig, arch: ModelArch, dtype: torch.dtype, max_len: int, device: torch.device
) -> int:
    per_token = KVCache.bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim, dtype)
    budget = kv_budget_bytes(config, per_token, max_len, device)
    per_block = per_token * config.kv_block_size
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(
            f"the KV budget of {budget} bytes holds no block: one block of "
            f"{config.kv_block_size} tokens takes {per_block} bytes for this model"
        )
    return int(blocks)
