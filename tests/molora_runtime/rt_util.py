"""Helpers of the runtime proof suite (imported by conftest and the test modules)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from molora_runtime.config import LORA_TARGET_MODULES, EngineConfig, HotSetConfig
from molora_runtime.engine.engine import LLMEngine
from molora_runtime.engine.types import GenerationOutput, GenerationRequest, SamplingParams
from molora_runtime.lora.composition import CompositionConfig, save_composition
from molora_runtime.lora.source import DirectorySource
from molora_runtime.model.arch import load_arch
from molora_runtime.routes import LearnedRoute, MixRoute

ALL_TARGETS = list(LORA_TARGET_MODULES)


def make_peft_adapter(
    base: Path,
    out: Path,
    *,
    r: int,
    alpha: float,
    seed: int,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    target_modules: list[str] | None = None,
    std: float | None = None,
    **lora_kwargs: Any,
) -> Path:
    """A random (non-zero B) PEFT LoRA adapter saved with `save_pretrained` (safetensors)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=target_modules or ALL_TARGETS,
        init_lora_weights=False,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        **lora_kwargs,
    )
    peft_model = get_peft_model(model, config)
    if std is not None:  # keep big models' deltas in a sane range
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, std)
    peft_model.save_pretrained(str(out))
    return out


def make_composition(
    base: Path,
    out: Path,
    adapters: list[str],
    *,
    top_k: int = 2,
    temperature: float = 1.0,
    seed: int = 0,
    gate_scale: float = 1.0,
    with_bias: bool = True,
) -> Path:
    """A random learned composition (per-layer gate d → K) for the model in `base`."""
    arch = load_arch(base)
    gen = torch.Generator().manual_seed(seed)
    L, K, d = arch.num_layers, len(adapters), arch.hidden_size
    weight = torch.randn(L, K, d, generator=gen) * gate_scale
    bias = torch.randn(L, K, generator=gen) if with_bias else None
    config = CompositionConfig(
        base_model=str(base),
        adapters=adapters,
        top_k=top_k,
        temperature=temperature,
        num_layers=L,
        hidden_size=d,
    )
    return save_composition(out, config, weight, bias)


def engine_config(model: Path | str, **kwargs: Any) -> EngineConfig:
    hot = kwargs.pop("hot_set", None)
    hs = hot if isinstance(hot, HotSetConfig) else HotSetConfig(**(hot or {}))
    base = dict(
        model=str(model),
        dtype="float32",
        device="cpu",
        enable_cuda_graph=False,
        max_model_len=256,
        max_num_seqs=16,
        max_num_batched_tokens=512,
    )
    base.update(kwargs)
    return EngineConfig(hot_set=hs, **base)


def build_engine(
    model: Path | str,
    adapters: dict[str, Path] | None = None,
    compositions: dict[str, Path] | None = None,
    **kwargs: Any,
) -> LLMEngine:
    return LLMEngine(engine_config(model, **kwargs), DirectorySource(adapters, compositions))


def run_to_completion(
    engine: LLMEngine,
    requests: Iterable[GenerationRequest] = (),
    *,
    schedule: dict[int, list[GenerationRequest]] | None = None,
    after_step: Callable[[int, LLMEngine], None] | None = None,
    max_steps: int = 10_000,
) -> dict[str, dict[str, Any]]:
    """Add `requests` now (and `schedule[step]` before that step), step until idle; returns per
    request id: tokens, text, finish_reason, error, attribution, outputs."""
    results: dict[str, dict[str, Any]] = {}

    def add(req: GenerationRequest) -> None:
        results[req.request_id] = {
            "tokens": [],
            "text": "",
            "finish_reason": None,
            "error": None,
            "attribution": [],
            "outputs": [],
        }
        engine.add_request(req)

    for req in requests:
        add(req)
    schedule = dict(schedule or {})
    step = 0
    while engine.has_work() or schedule:
        for req in schedule.pop(step, []):
            add(req)
        for out in engine.step():
            _collect(results[out.request_id], out)
        if after_step is not None:
            after_step(step, engine)
        step += 1
        assert step < max_steps, "the engine did not finish"
    return results


def run_beside_a_failed_load(
    engine: LLMEngine,
    prompts: list[list[int]],
    routes: tuple[str, str, str],
    long: int,
    after_step: Callable[[int, LLMEngine], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """A `long`-token stream `r` on `routes[0]`; before step 2 a 4-token `x` on `routes[1]`,
    whose adapter fails to load, and a 4-token `y` on `routes[2]` join. Checks that `x` alone
    failed (`y` and `r` ran to their length); returns every request's results."""
    good, bad, other = routes
    got = run_to_completion(
        engine,
        [request("r", prompts[0], good, long)],
        schedule={2: [request("x", prompts[1], bad, 4), request("y", prompts[2], other, 4)]},
        after_step=after_step,
    )
    assert got["x"]["finish_reason"] == "error", got["x"]
    assert got["y"]["finish_reason"] == "length" and len(got["y"]["tokens"]) == 4, got["y"]
    assert got["r"]["finish_reason"] == "length" and len(got["r"]["tokens"]) == long, got["r"]
    return got


def _collect(res: dict[str, Any], out: GenerationOutput) -> None:
    assert res["finish_reason"] is None, f"{out.request_id} produced output after finishing"
    res["outputs"].append(out)
    res["tokens"].extend(out.new_token_ids)
    res["text"] += out.text_delta
    if out.attribution:
        res["attribution"].extend(out.attribution)
    if out.finished:
        res["finish_reason"] = out.finish_reason
        res["error"] = out.error


def request(
    rid: str,
    prompt_ids: list[int] | None = None,
    route: Any = None,
    max_tokens: int = 8,
    **kwargs: Any,
) -> GenerationRequest:
    from molora_runtime.engine.llm import as_route

    sampling = kwargs.pop("sampling", None) or SamplingParams(max_tokens=max_tokens)
    if prompt_ids is not None:
        kwargs["prompt_token_ids"] = prompt_ids
    return GenerationRequest(request_id=rid, route=as_route(route), sampling=sampling, **kwargs)


def random_prompts(n: int, vocab: int, lengths: Iterable[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = list(lengths)
    return [
        torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=gen).tolist()
        for i in range(n)
    ]


def count_calls(monkeypatch: Any, owner: Any, name: str) -> list[int]:
    """Wrap `owner.name` (for the test's duration) so each call appends to the returned list:
    proof that a fast path was really taken, not just available."""
    calls: list[int] = []
    real = getattr(owner, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls


def assert_same_generations(
    got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]], tolerance: float
) -> None:
    """Two `run_to_completion` results (requests with `logprobs=0`): no errors, the same tokens,
    and each sampled token's logprob within `tolerance`."""
    assert got.keys() == want.keys()
    for rid, expected in want.items():
        result = got[rid]
        assert result["error"] is None and expected["error"] is None
        assert result["tokens"] == expected["tokens"], rid
        lp_got = [o.logprobs[0].logprob for o in result["outputs"] if o.logprobs]
        lp_want = [o.logprobs[0].logprob for o in expected["outputs"] if o.logprobs]
        assert len(lp_got) == len(lp_want) == len(expected["tokens"])
        torch.testing.assert_close(
            torch.tensor(lp_got), torch.tensor(lp_want), rtol=tolerance, atol=tolerance
        )


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2))


def engine_prefill_logits(engine: LLMEngine, route: Any, prompt: list[int]) -> torch.Tensor:
    """Logits [T, V] of every prompt position through the engine's model, hot-set and routing
    (one prefill chunk in KV row 0 of an idle engine)."""
    from molora_runtime.engine.llm import as_route
    from molora_runtime.lora.routing import RouteSegment, build_lora_context
    from molora_runtime.model.attention_meta import step_attention

    assert not engine.running, "the engine must be idle"
    route = as_route(route)
    hot = engine.hot_set
    needs = route.adapters()
    cslot = None
    if isinstance(route, LearnedRoute):
        cslot, experts = hot.ensure_composition(route.composition)
        needs = list(dict.fromkeys(needs + experts))
    hot.ensure(needs)
    if cslot is not None:
        hot.bind_experts(cslot)
    ids = torch.tensor(prompt, dtype=torch.long)
    n = len(prompt)
    ctx = build_lora_context([RouteSegment(route, ids)], hot, engine.width, engine.device)
    bs = engine.kv.block_size
    table = list(range(-(-n // bs)))  # an idle engine's first blocks
    meta = step_attention(
        [(table[p // bs], p % bs) for p in range(n)],
        list(range(n)),
        [],
        [(0, n, 0, table)],
        engine.kv,
        engine.device,
    )
    with torch.inference_mode():
        return engine.model(ids, meta, engine.kv, ctx)


# Routes of well-behaved bystander requests (one of each kind) in the failure-isolation tests.
GOOD_ROUTES = {
    "g-a": "a",
    "g-base": None,
    "g-mix": MixRoute(weights={"b": 0.6, "c": 0.4}),
    "g-learned": LearnedRoute(composition="moe"),
}
