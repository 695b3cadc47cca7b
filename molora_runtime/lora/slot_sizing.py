"""What `hot_set.num_slots: auto` comes to on the device an engine runs on.

A step serves only adapters that sit in slots, so the slot count caps the distinct adapters of one
batch. On CUDA the slots are static device buffers a captured graph reads, and their count is
memory the KV cache does not get: auto keeps 8. On CPU the slots are host memory like the host
tier beside them, so auto gives every sequence a step runs a slot of its own, twice over (the
next batch's adapters load while this one runs), within `slot_bytes`.
"""

from __future__ import annotations

import torch

from molora_runtime.config import HotSetConfig
from molora_runtime.model.arch import ModelArch

CUDA_SLOTS = 8
MIN_CPU_SLOTS = 8
SLOTS_PER_SEQUENCE = 2
MAX_SLOTS = 1024


def slot_nbytes(arch: ModelArch, targets: list[str], rank: int, dtype: torch.dtype) -> int:
    """Bytes of one slot padded to `rank`: A and B of every targeted projection in every layer."""
    width = sum(sum(arch.linear_shape(module)) for module in targets)
    return arch.num_layers * rank * width * torch.empty((), dtype=dtype).element_size()


def auto_slots(
    config: HotSetConfig, arch: ModelArch, dtype: torch.dtype, device_type: str, max_num_seqs: int
) -> int:
    """The slot count `num_slots: auto` means for an engine of `max_num_seqs` sequences."""
    if device_type != "cpu":
        return CUDA_SLOTS
    per_slot = slot_nbytes(arch, list(config.target_modules), config.max_rank, dtype)
    wanted = max(MIN_CPU_SLOTS, SLOTS_PER_SEQUENCE * max_num_seqs)
    return max(1, min(wanted, config.slot_bytes // per_slot, MAX_SLOTS))


def sized(
    config: HotSetConfig, arch: ModelArch, dtype: torch.dtype, device_type: str, max_num_seqs: int
) -> HotSetConfig:
    """`config` with a slot count: `auto` resolved for this engine, a number kept as given."""
    if config.num_slots != "auto":
        return config
    slots = auto_slots(config, arch, dtype, device_type, max_num_seqs)
    return config.model_copy(update={"num_slots": slots})
