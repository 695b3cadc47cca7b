"""Gate summaries on CUDA: folded without any host sync in the step, and the same with CUDA
graphs as eager.

Every call of `GateSummaries.record` runs under `torch.cuda.set_sync_debug_mode("error")`, so
a device-to-host read or a blocking copy in it fails the check; the one read per request is at
its finish (`take`). Runs on the GPU box with only torch, triton, pydantic and safetensors.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from tests.gpu.gpu_models import cuda_llm, tiny_model_set
from tests.gpu.gpu_support import gpu, require_cuda

MAX_TOKENS = 12


def _summaries(graphs: bool, tmp: Path) -> tuple[dict[str, Any], int, int]:
    from molora_runtime.engine.types import GenerationRequest, SamplingParams
    from molora_runtime.routes import LearnedRoute, SingleRoute

    model, adapters, comps = tiny_model_set(
        tmp,
        ranks=(8, 8, 8),
        seed=5,
        compositions={"moe": (["a", "b", "c"], 2), "duo": (["a", "b"], 1)},
    )
    llm = cuda_llm(model, adapters, comps, graphs, {"num_slots": 4, "max_rank": 8})
    engine = llm.engine
    summaries = engine.outputs.summaries
    real_record = summaries.record
    calls = [0]

    def strict_record(*args: Any) -> None:
        torch.cuda.synchronize()  # whatever came before is settled: only record's own ops count
        torch.cuda.set_sync_debug_mode("error")
        try:
            real_record(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        calls[0] += 1

    summaries.record = strict_record  # type: ignore[method-assign]
    graph_runs = [0]
    if engine.graph_runner is not None:
        real_run = engine.graph_runner.run

        def counted(*args: Any) -> Any:
            graph_runs[0] += 1
            return real_run(*args)

        engine.graph_runner.run = counted  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(0)
    routes = [
        LearnedRoute(composition="moe"),
        LearnedRoute(composition="moe", top_k=1),
        LearnedRoute(composition="duo"),
        SingleRoute(adapter="c"),
    ]
    for i, route in enumerate(routes):
        prompt = torch.randint(0, 512, (5 + 3 * i,), generator=gen).tolist()
        engine.add_request(
            GenerationRequest(
                request_id=f"r{i}",
                prompt_token_ids=prompt,
                route=route,
                sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                return_gate_summary=isinstance(route, LearnedRoute),
                gate_summary_layers=isinstance(route, LearnedRoute),
            )
        )
    found: dict[str, Any] = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                found[out.request_id] = out.gate_summary
    assert summaries.active == 0
    return found, calls[0], graph_runs[0]


def _raises_in_sync_error_mode(fn: Any) -> bool:
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return False


@gpu
def test_gate_summary_without_host_sync_eager_and_graphs() -> None:
    require_cuda()
    # the detector sees the syncs `record` avoids: a read-back and a pageable host->device copy
    assert _raises_in_sync_error_mode(lambda: torch.ones(1, device="cuda").item())
    assert _raises_in_sync_error_mode(lambda: torch.tensor([1, 2]).to("cuda"))
    with tempfile.TemporaryDirectory() as tmp:
        eager, eager_calls, _ = _summaries(False, Path(tmp) / "e")
        graphed, graph_calls, graph_runs = _summaries(True, Path(tmp) / "g")
    assert eager_calls >= MAX_TOKENS and graph_calls >= MAX_TOKENS
    assert graph_runs > 0, "no decode step replayed a CUDA graph"
    assert eager["r3"] is None and graphed["r3"] is None
    for rid in ("r0", "r1", "r2"):
        e, g = eager[rid], graphed[rid]
        assert e.tokens == g.tokens == MAX_TOKENS
        assert abs(sum(e.share) - 1) < 1e-5 and abs(sum(e.mean_weight) - 1) < 1e-5
        for row in e.layer_top1_share:
            assert abs(sum(row) - 1) < 1e-5
        for a, b in zip(e.share + e.mean_weight, g.share + g.mean_weight, strict=True):
            assert abs(a - b) < 1e-4, (rid, e, g)
        assert abs(e.mean_entropy - g.mean_entropy) < 1e-4
    print("gate summary (graphs):", {k: v for k, v in graphed.items() if v is not None})
