"""CUDA-graph decode equals eager decode token for token, including under hot-set churn.

Runs on the GPU box with only torch, triton, pydantic and safetensors (no transformers/peft):
the model and adapters are written natively by `molora_runtime.model.tiny`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from tests.gpu.gpu_models import cuda_llm, tiny_model_set
from tests.gpu.gpu_support import gpu, require_cuda

ROUTES = [
    "a",
    "b",
    "a:0.6+c:0.4",
    None,
    {"kind": "vocab", "ranges": [{"start": 0, "end": 256, "adapter": "c"}], "default": "b"},
    {"kind": "learned", "composition": "moe"},
    "c",
    {"kind": "learned", "composition": "moe", "top_k": 1},
]


def _setup(tmp: Path) -> tuple[Path, dict[str, Path], dict[str, Path]]:
    return tiny_model_set(
        tmp, ranks=(8, 12, 16), seed=3, compositions={"moe": (["a", "b", "c"], 2)}
    )


def _cuda_llm(
    model: Path,
    adapters: dict[str, Path],
    graphs: bool,
    num_slots: int,
    max_num_seqs: int,
    max_model_len: int,
    compositions: dict[str, Path] | None = None,
) -> Any:
    """An fp32 `LLM` on CUDA over `num_slots` rank-16 slots, with or without CUDA graphs."""
    hot_set = {"num_slots": num_slots, "max_rank": 16}
    return cuda_llm(model, adapters, compositions, graphs, hot_set, max_num_seqs, max_model_len)


def _generate(graphs: bool, num_slots: int, tmp: Path) -> tuple[list[list[int]], object]:
    from molora_runtime.engine.types import SamplingParams

    model, adapters, comps = _setup(tmp)
    llm = _cuda_llm(model, adapters, graphs, num_slots, 8, 128, compositions=comps)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (5 + 3 * i,), generator=gen).tolist() for i in range(8)]
    out = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True), routes=ROUTES)
    return [r.token_ids for r in out], llm.engine


@gpu
def test_cuda_graph_decode_equals_eager() -> None:
    require_cuda()
    with tempfile.TemporaryDirectory() as tmp:
        eager, _ = _generate(False, 4, Path(tmp) / "e")
        graphed, engine = _generate(True, 4, Path(tmp) / "g")
    assert engine.graph_runner is not None and engine.graph_runner._graphs
    assert graphed == eager


@gpu
def test_cuda_graph_survives_adapter_churn_without_recapture() -> None:
    """Two slots for three adapters: slots are rewritten between steps, graphs are not."""
    require_cuda()
    with tempfile.TemporaryDirectory() as tmp:
        from molora_runtime.engine.types import SamplingParams

        model, adapters, _ = _setup(Path(tmp))
        outs = []
        for graphs in (False, True):
            llm = _cuda_llm(model, adapters, graphs, num_slots=2, max_num_seqs=2, max_model_len=64)
            runner = llm.engine.graph_runner
            captured = dict(runner._graphs) if runner is not None else {}
            result = []
            for name in ["a", "b", "c", "a", "c", "b"]:
                r = llm.generate(
                    [[1, 2, 3, 4]], SamplingParams(max_tokens=8, ignore_eos=True), routes=name
                )
                result.append(r[0].token_ids)
            outs.append(result)
            if runner is not None:
                assert llm.engine.hot_set.counters.evictions > 0
                assert runner._graphs == captured  # same graph objects: nothing re-captured
    assert outs[0] == outs[1]
