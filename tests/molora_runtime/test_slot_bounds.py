"""A hostile adapter cannot reach another request's rows: slot contents are bounded when written
(finite after scale and cast, |values| <= MAX_ABS_WEIGHT), and the LoRA backend never lets a
slot touch a row that does not use it.

Bystanders are base-model rows and rows of another adapter, batched with the hostile one; their
tokens and logprobs must be bit-identical to the same batch with a harmless adapter of the same
name in the same slot.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from adapter_store.limits import MAX_ABS_WEIGHT
from molora_runtime.engine.types import SamplingParams
from tests.molora_runtime.rt_util import build_engine, random_prompts, request, run_to_completion

SAMPLING = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0)
ROUTES = [None, "a", "evil", None, "a", "evil"]


def _variant(src: Path, dst: Path, a_value: float | None, b_value: float | None) -> Path:
    """A copy of adapter `src` whose A (and B) entries are all set to the given values."""
    shutil.copytree(src, dst)
    path = dst / "adapter_model.safetensors"
    tensors = load_file(path)
    for key, t in tensors.items():
        value = a_value if "lora_A" in key else b_value
        if value is not None:
            tensors[key] = torch.full_like(t, value)
    save_file(tensors, path)
    return dst


def _serve(tiny_llama: Path, adapters: dict[str, Path], dtype: str) -> dict[str, dict]:
    engine = build_engine(tiny_llama, adapters, dtype=dtype, hot_set={"num_slots": 3})
    prompts = random_prompts(len(ROUTES), 256, [5, 9, 3, 12, 7, 4], seed=11)
    reqs = [
        request(f"r{i}", p, route, sampling=SAMPLING)
        for i, (p, route) in enumerate(zip(prompts, ROUTES, strict=True))
    ]
    return run_to_completion(engine, reqs)


def _bystanders(results: dict[str, dict]) -> dict[str, tuple]:
    return {
        rid: (
            r["error"],
            r["tokens"],
            [lp.logprob for o in r["outputs"] for lp in o.logprobs or []],
        )
        for rid, r in results.items()
        if ROUTES[int(rid[1:])] != "evil"
    }


def test_adapter_scaled_past_the_bound_is_refused_and_bystanders_run(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """B = 3e38 is finite in the file; scaled by alpha / r it is Inf: the load fails with the
    reason, the slot holds nothing, and the other rows are served as if it were never asked."""
    evil = _variant(tiny_adapters["b"], tmp_path / "evil", None, 3.0e38)
    harmless = tiny_adapters["b"]
    got = _serve(tiny_llama, {"a": tiny_adapters["a"], "evil": evil}, "float32")
    for rid, result in got.items():
        if ROUTES[int(rid[1:])] == "evil":
            assert result["error"] and "bound" in str(result["error"]), result["error"]
    for rid, (error, tokens, _) in _bystanders(got).items():
        assert error is None and len(tokens) == SAMPLING.max_tokens, rid
    want = _serve(tiny_llama, {"a": tiny_adapters["a"], "evil": harmless}, "float32")
    for rid, (_, tokens, _) in _bystanders(got).items():
        assert tokens == _bystanders(want)[rid][1], rid


def test_adapter_at_the_bound_leaves_other_rows_bit_identical(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """Every value of the hostile adapter at the bound (its own rows blow up): base rows and
    another adapter's rows in the same batches are bit-identical to a harmless adapter's run."""
    b = MAX_ABS_WEIGHT / 2  # scale 2 (alpha 8, r 4): scale * B is exactly the bound
    for dtype in ("float32", "bfloat16"):
        evil = _variant(tiny_adapters["a"], tmp_path / f"evil-{dtype}", MAX_ABS_WEIGHT, b)
        harmless = _variant(tiny_adapters["a"], tmp_path / f"harmless-{dtype}", None, None)
        hostile = _serve(tiny_llama, {"a": tiny_adapters["a"], "evil": evil}, dtype)
        calm = _serve(tiny_llama, {"a": tiny_adapters["a"], "evil": harmless}, dtype)
        assert _bystanders(hostile) == _bystanders(calm), dtype
        assert all(e is None for e, _, _ in _bystanders(hostile).values())
