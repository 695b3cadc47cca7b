"""The static-shape decode step used for CUDA graphs (`CudaGraphRunner`, run eagerly on the CPU
with `capture=False`) equals the eager dynamic path: same greedy tokens over mixed routes and
batch sizes that fall between buckets (padded rows on the scratch KV row, slot 0)."""

from __future__ import annotations

import pytest

from molora_runtime.engine.runner.cuda_graph import CudaGraphRunner, batch_buckets
from molora_runtime.routes import LearnedRoute, MixRoute, VocabRoute
from tests.molora_runtime.rt_util import random_prompts, request, run_to_completion

ROUTES = [
    "a",
    None,
    MixRoute(weights={"b": 0.6, "c": 0.4}),
    LearnedRoute(composition="moe"),
    VocabRoute(ranges=[{"start": 0, "end": 100, "adapter": "c"}], default="a"),
    "b",
    LearnedRoute(composition="moe", top_k=1, temperature=0.5),
]


def approx_list(values):
    return [pytest.approx(v, abs=1e-3) for v in values]


class CountingRunner(CudaGraphRunner):
    def __init__(self, engine) -> None:
        super().__init__(
            engine.runner.step,
            max_batch=engine.config.max_num_seqs,
            max_blocks_per_seq=-(-engine.max_seq_len // engine.kv.block_size),
            capture=False,
        )
        self.sizes: list[int] = []

    def run(self, batch, ids, ctx):
        self.sizes.append(batch.num_decode)
        return super().run(batch, ids, ctx)


def test_buckets() -> None:
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(70) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 70]
    assert batch_buckets(1) == [1]


def test_static_decode_equals_eager(tiny_engine_factory) -> None:
    prompts = random_prompts(len(ROUTES), 256, [5, 9, 14, 3], seed=17)
    max_tokens = [9, 4, 12, 7, 10, 2, 11]
    reqs = [
        request(f"r{i}", p, r, m, return_attribution=True)
        for i, (p, r, m) in enumerate(zip(prompts, ROUTES, max_tokens, strict=True))
    ]
    eager = run_to_completion(tiny_engine_factory(max_num_seqs=8), reqs)
    engine = tiny_engine_factory(max_num_seqs=8)
    engine.graph_runner = runner = CountingRunner(engine)
    static = run_to_completion(engine, reqs)
    assert runner.sizes and {3, 5, 6, 7} & set(runner.sizes)  # between buckets → padded rows
    for i in range(len(reqs)):
        assert static[f"r{i}"]["tokens"] == eager[f"r{i}"]["tokens"], ROUTES[i]
        assert [a.adapters for a in static[f"r{i}"]["attribution"]] == approx_list(
            [a.adapters for a in eager[f"r{i}"]["attribution"]]
        )


def test_capture_all_goes_largest_first_into_one_pool(tiny_engine_factory, monkeypatch) -> None:
    """Startup capture order and pool sharing (the capture itself needs CUDA: tests/gpu)."""
    engine = tiny_engine_factory(max_num_seqs=8)
    runner = CountingRunner(engine)
    runner.capture = True
    order: list[int] = []
    monkeypatch.setattr("torch.cuda.graph_pool_handle", lambda: "the-pool")
    monkeypatch.setattr(runner, "_ensure_graph", order.append)
    runner.capture_all()
    assert order == sorted(batch_buckets(8), reverse=True) and runner._pool == "the-pool"
