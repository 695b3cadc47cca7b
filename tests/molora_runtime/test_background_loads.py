"""A cold adapter loads beside the step: running streams keep decoding, a failed load fails
only the requests that need it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from molora_runtime.engine.engine import LLMEngine
from molora_runtime.lora.source import AdapterNotFoundError, DirectorySource
from tests.molora_runtime.rt_util import (
    engine_config,
    random_prompts,
    request,
    run_beside_a_failed_load,
    run_to_completion,
)


class SlowSource(DirectorySource):
    """A store whose fetches of `slow` take a while and of `broken` fail (in fetch threads)."""

    def __init__(self, adapters: dict[str, Path], delay_s: float) -> None:
        super().__init__(adapters)
        self.delay_s = delay_s

    def adapter_path(self, ref: str) -> Path:
        fetching = threading.current_thread().name.startswith("molora-fetch")
        if fetching and ref == "broken":
            raise AdapterNotFoundError("broken: the store lost it")
        if fetching and ref == "slow":
            time.sleep(self.delay_s)
        return super().adapter_path(ref)


def make_engine(tiny_llama: Path, tiny_adapters: dict[str, Path]) -> LLMEngine:
    adapters = {**tiny_adapters, "slow": tiny_adapters["b"], "broken": tiny_adapters["c"]}
    config = engine_config(tiny_llama, max_num_seqs=4, hot_set={"num_slots": 4})
    return LLMEngine(config, SlowSource(adapters, delay_s=0.5))


def test_decode_goes_on_while_an_adapter_loads(tiny_llama, tiny_adapters) -> None:
    prompts = random_prompts(2, 256, [6, 7], seed=3)
    alone = run_to_completion(
        make_engine(tiny_llama, tiny_adapters), [request("s", prompts[1], "slow", 6)]
    )["s"]["tokens"]
    engine = make_engine(tiny_llama, tiny_adapters)
    tokens_while_loading = []

    def watch(step: int, eng: LLMEngine) -> None:
        runner = next((s for s in eng.running if s.request_id == "r"), None)
        if "slow" in eng.hot_set.host.loading() and runner is not None:
            tokens_while_loading.append(len(runner.output_ids))

    got = run_to_completion(
        engine,
        [request("r", prompts[0], "a", 200)],
        schedule={3: [request("s", prompts[1], "slow", 6)]},
        after_step=watch,
    )
    # The running stream decoded through the load instead of waiting 0.5 s for it.
    assert len(set(tokens_while_loading)) > 2, tokens_while_loading
    assert got["s"]["tokens"] == alone and got["s"]["finish_reason"] == "length"
    assert got["r"]["finish_reason"] == "length" and len(got["r"]["tokens"]) == 200


def test_a_failed_load_fails_only_its_requests(tiny_llama, tiny_adapters) -> None:
    engine = make_engine(tiny_llama, tiny_adapters)
    prompts = random_prompts(3, 256, [5, 6, 7], seed=4)
    got = run_beside_a_failed_load(engine, prompts, ("a", "broken", "b"), long=30)
    assert "lost it" in got["x"]["error"]
