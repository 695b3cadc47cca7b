"""The offline API, in the style users know from vLLM: `LLM(...).generate(prompts, ...)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from molora_runtime.config import DEFAULT_MODEL, EngineConfig, HotSetConfig
from molora_runtime.engine.engine import LLMEngine
from molora_runtime.engine.types import (
    CompletionResult,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
)
from molora_runtime.lora.source import AdapterSource, DirectorySource
from molora_runtime.routes import BaseRoute, RouteSpec, SingleRoute, parse_mix

_ROUTE = TypeAdapter(RouteSpec)
Prompt = str | list[int] | list[dict[str, str]]
RouteLike = RouteSpec | str | dict[str, Any] | None


def as_route(route: RouteLike) -> RouteSpec:
    """Accept a RouteSpec, its dict form, None (base), an adapter name or a mix string."""
    if route is None:
        return BaseRoute()
    if isinstance(route, str):
        return parse_mix(route) if ":" in route else SingleRoute(adapter=route)
    if isinstance(route, dict):
        return _ROUTE.validate_python(route)
    return route


class LLM:
    """Load a model and adapters once, then generate for many prompts in continuous batches."""

    def __init__(
        self,
        model: str | Path = DEFAULT_MODEL,
        adapters: dict[str, str | Path] | None = None,
        compositions: dict[str, str | Path] | None = None,
        source: AdapterSource | None = None,
        hot_set: HotSetConfig | dict[str, Any] | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if source is not None and (adapters or compositions):
            raise ValueError("give either source= or adapters=/compositions=, not both")
        hs = hot_set if isinstance(hot_set, HotSetConfig) else HotSetConfig(**(hot_set or {}))
        config = EngineConfig(model=str(model), hot_set=hs, **engine_kwargs)
        self.engine = LLMEngine(config, source or DirectorySource(adapters, compositions))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        routes: RouteLike | Seq[RouteLike] = None,
        return_attribution: bool = False,
        return_gate_summary: bool = False,
    ) -> list[CompletionResult]:
        """Generate for every prompt (text, token ids or chat messages); results keep order.
        `return_gate_summary`: every route must be learned (InvalidRequestError otherwise)."""
        prompt_list = _as_prompt_list(prompts)
        n = len(prompt_list)
        params = _broadcast(sampling_params or SamplingParams(), n, "sampling_params")
        route_list = [as_route(r) for r in _broadcast(routes, n, "routes")]
        requests = []
        for prompt, p, route in zip(prompt_list, params, route_list, strict=True):
            rid = f"offline-{next(self._ids)}"
            kwargs: dict[str, Any]
            if isinstance(prompt, str):
                kwargs = {"prompt": prompt}
            elif prompt and isinstance(prompt[0], dict):
                kwargs = {"messages": prompt}
            else:
                kwargs = {"prompt_token_ids": prompt}
            requests.append(
                GenerationRequest(
                    request_id=rid,
                    route=route,
                    sampling=p,
                    return_attribution=return_attribution,
                    return_gate_summary=return_gate_summary,
                    **kwargs,
                )
            )
        # Every request is validated before any runs: one bad prompt fails the call up front.
        prepared = [(r, self.engine.validate_request(r)) for r in requests]
        results: dict[str, CompletionResult] = {
            r.request_id: CompletionResult(
                r.request_id, "", [], ids, None, [] if return_attribution else None
            )
            for r, ids in prepared
        }
        pending = iter(prepared)
        next_up = next(pending, None)
        while next_up is not None or self.engine.has_work():
            # Feed the engine as its queue allows, so any number of prompts fits one call.
            while next_up is not None and self.engine.has_room():
                self.engine.add_request(*next_up)
                next_up = next(pending, None)
            for out in self.engine.step():
                _accumulate(results[out.request_id], out)
        return [results[r.request_id] for r in requests]


def _accumulate(result: CompletionResult, out: GenerationOutput) -> None:
    result.text += out.text_delta
    result.token_ids.extend(out.new_token_ids)
    if out.attribution is not None and result.attribution is not None:
        result.attribution.extend(out.attribution)
    if out.logprobs is not None:  # SamplingParams(logprobs=k)
        result.logprobs = (result.logprobs or []) + out.logprobs
    if out.finished:
        result.finish_reason = out.finish_reason
        result.gate_summary = out.gate_summary
        if out.error:
            raise RuntimeError(f"request {out.request_id} failed: {out.error}")


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]  # type: ignore[arg-type]
    if prompts and isinstance(prompts[0], dict):
        return [list(prompts)]  # type: ignore[arg-type]
    return list(prompts)  # type: ignore[arg-type]


def _broadcast(value: Any, n: int, what: str) -> list[Any]:
    if isinstance(value, list | tuple):
        if len(value) != n:
            raise ValueError(f"{what} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n
