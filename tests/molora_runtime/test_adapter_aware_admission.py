"""Admission fills the batch from resident adapters past requests still waiting for a load or a
slot, and stops passing a waiting request once it has waited `adapter_wait_s` (no adapter
starves)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from molora_runtime.engine.engine import LLMEngine
from molora_runtime.lora.source import DirectorySource
from tests.molora_runtime.rt_util import engine_config, random_prompts, request, run_to_completion

COLD = [f"cold{i}" for i in range(10)]


class ColdSource(DirectorySource):
    """Fetches of the `cold*` adapters take `delay_s` (in the background fetch threads)."""

    def __init__(self, adapters: dict[str, Path], delay_s: float) -> None:
        super().__init__(adapters)
        self.delay_s = delay_s

    def adapter_path(self, ref: str) -> Path:
        if ref.startswith("cold") and threading.current_thread().name.startswith("molora-fetch"):
            time.sleep(self.delay_s)
        return super().adapter_path(ref)


def make_engine(tiny_llama: Path, tiny_adapters: dict[str, Path], **kwargs) -> LLMEngine:
    adapters = {**tiny_adapters, **{name: tiny_adapters["b"] for name in COLD}}
    config = engine_config(tiny_llama, max_num_seqs=16, **kwargs)
    return LLMEngine(config, ColdSource(adapters, delay_s=2.0))


def test_a_resident_adapter_passes_more_than_a_pass_of_cold_ones(tiny_llama, tiny_adapters) -> None:
    engine = make_engine(tiny_llama, tiny_adapters, hot_set={"num_slots": 4}, adapter_wait_s=60)
    prompts = random_prompts(12, 256, [6] * 12, seed=5)
    started_while_cold_loading: list[bool] = []

    def watch(step: int, eng: LLMEngine) -> None:
        if any(s.request_id == "late" for s in eng.running) and not started_while_cold_loading:
            started_while_cold_loading.append(bool(eng.hot_set.host.loading()))

    cold = [request(f"c{i}", prompts[i], name, 2) for i, name in enumerate(COLD)]
    got = run_to_completion(
        engine,
        [request("r", prompts[10], "a", 30)],
        schedule={2: [*cold, request("late", prompts[11], "a", 4)]},
        after_step=watch,
    )
    # Ten requests wait on loads ahead of it; the one on the resident adapter starts anyway.
    assert started_while_cold_loading == [True]
    assert all(got[r.request_id]["finish_reason"] == "length" for r in cold)
    assert got["late"]["finish_reason"] == "length"


def test_a_request_waiting_past_adapter_wait_s_is_no_longer_passed(
    tiny_llama, tiny_adapters
) -> None:
    engine = make_engine(tiny_llama, tiny_adapters, hot_set={"num_slots": 1}, adapter_wait_s=0.0)
    prompts = random_prompts(30, 256, [6] * 30, seed=6)
    # `a` holds the only slot while `r` runs; `x` needs that slot for `b`; more requests on the
    # resident `a` keep arriving after `x`.
    later = {step: [request(f"a{step}", prompts[step], "a", 3)] for step in range(3, 20)}
    order: list[str] = []

    def watch(step: int, eng: LLMEngine) -> None:
        for s in eng.running:
            if s.request_id not in order:
                order.append(s.request_id)

    got = run_to_completion(
        engine,
        [request("r", prompts[0], "a", 12)],
        schedule={2: [request("x", prompts[1], "b", 3)], **later},
        after_step=watch,
    )
    assert got["x"]["finish_reason"] == "length"
    # The slot drained for `x`: it started before every request that arrived after it.
    assert order.index("x") < min(order.index(r) for r in order if r.startswith("a"))
