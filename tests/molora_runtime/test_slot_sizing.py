"""`hot_set.num_slots: auto`: on CPU a slot per sequence of a step, twice over, within
`slot_bytes`; on CUDA 8; a number is kept as given. A full batch of distinct adapters then runs
in one step instead of eight at a time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from molora_runtime.config import HotSetConfig
from molora_runtime.engine.engine import LLMEngine
from molora_runtime.lora.slot_sizing import auto_slots, sized, slot_nbytes
from molora_runtime.lora.source import DirectorySource
from molora_runtime.model.arch import load_arch
from tests.molora_runtime.rt_util import engine_config, random_prompts, request, run_to_completion


def test_auto_on_cpu_is_two_slots_per_sequence_at_least_eight(tiny_llama: Path) -> None:
    arch = load_arch(tiny_llama)
    config = HotSetConfig()
    assert config.num_slots == "auto"
    assert auto_slots(config, arch, torch.float32, "cpu", 32) == 64
    assert auto_slots(config, arch, torch.float32, "cpu", 2) == 8
    assert auto_slots(config, arch, torch.float32, "cuda", 32) == 8


def test_auto_stays_within_slot_bytes(tiny_llama: Path) -> None:
    arch = load_arch(tiny_llama)
    per_slot = slot_nbytes(arch, ["q_proj", "v_proj"], 16, torch.float32)
    config = HotSetConfig(target_modules=["q_proj", "v_proj"], slot_bytes=10 * per_slot + 1)
    assert auto_slots(config, arch, torch.float32, "cpu", 32) == 10
    assert auto_slots(config, arch, torch.bfloat16, "cpu", 32) == 20  # half the bytes a slot
    tiny = HotSetConfig(slot_bytes=1)
    assert auto_slots(tiny, arch, torch.float32, "cpu", 32) == 1


def test_a_number_is_kept_and_bad_values_are_refused(tiny_llama: Path) -> None:
    arch = load_arch(tiny_llama)
    assert sized(HotSetConfig(num_slots=3), arch, torch.float32, "cpu", 32).num_slots == 3
    for bad in (0, 2000, "many", -1):
        with pytest.raises(ValidationError):
            HotSetConfig(num_slots=bad)


def test_the_slot_buffers_hold_what_slot_nbytes_says(tiny_llama: Path, tiny_adapters) -> None:
    engine = LLMEngine(
        engine_config(tiny_llama, max_num_seqs=4, hot_set={"max_rank": 8}),
        DirectorySource(tiny_adapters),
    )
    hot = engine.hot_set
    assert hot.num_slots == 8
    per_slot = slot_nbytes(hot.arch, list(hot.config.target_modules), 8, torch.float32)
    assert hot.slots.capacity_nbytes() == 8 * per_slot


def test_a_batch_of_distinct_adapters_runs_in_one_step(tiny_llama: Path, tiny_adapters) -> None:
    names = [f"ad{i}" for i in range(12)]
    source = DirectorySource({n: tiny_adapters["ab"[i % 2]] for i, n in enumerate(names)})
    engine = LLMEngine(engine_config(tiny_llama, max_num_seqs=12), source)
    assert engine.hot_set.num_slots == 24
    prompts = random_prompts(12, 256, [5] * 12, seed=3)
    widest: list[int] = []

    def watch(step: int, eng: LLMEngine) -> None:
        widest.append(len({ref for s in eng.running for ref in s.request.route.refs()}))

    got = run_to_completion(
        engine,
        [request(f"r{i}", prompts[i], n, 8) for i, n in enumerate(names)],
        after_step=watch,
    )
    assert all(out["finish_reason"] == "length" for out in got.values())
    assert max(widest) == 12  # every adapter in one step, not eight at a time
