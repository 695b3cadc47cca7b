"""Cheap checks of a request before it is queued: prompt, lengths, KV budget, sampling, route."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from molora_runtime.engine.structured.grammar_compiler import GrammarCompiler
from molora_runtime.engine.types import GenerationRequest
from molora_runtime.errors import AdapterLoadError, InvalidRequestError
from molora_runtime.lora.composition import CompositionError, read_composition_config
from molora_runtime.lora.hotset import HotSet
from molora_runtime.model.chat_templates import renders_tools
from molora_runtime.multimodal.prompt import encode_with_images
from molora_runtime.routes import RouteLimits, check_route_limits

NO_TOOL_FORMAT = (
    "this model's chat template has no tool format: it shows the model neither the tools nor "
    "earlier tool calls, so tool_choice 'auto' and tool-call history cannot work; serve it with a "
    "tool-calling template (engine.chat_template, `molora serve --chat-template hermes`), or "
    "force a call with tool_choice 'required' or a named function"
)


def check_in_vocab(ids: Iterable[int], vocab_size: int, what: str) -> None:
    """Refuse token ids outside `[0, vocab_size)` (a 400 naming the first few)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"{what} {bad[:5]} are outside the vocabulary [0, {vocab_size})")


@dataclass(eq=False)
class RequestChecker:
    """Turns a request into prompt ids or raises InvalidRequestError (a 400) / lookup errors.
    `kv_tokens`: tokens the whole KV budget holds (one sequence can never exceed it)."""

    tokenizer: Any
    vocab_size: int
    max_model_len: int
    kv_tokens: int
    limits: RouteLimits
    hot_set: HotSet
    width: int
    grammars: GrammarCompiler
    _tool_format: bool | None = field(default=None, init=False)  # the template renders tools

    def encode_prompt(self, req: GenerationRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
            check_in_vocab(ids, self.vocab_size, "prompt token ids")
            return ids
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send prompt_token_ids")
        if req.messages is not None:
            if req.needs_tool_format and not self._renders_tools():
                raise InvalidRequestError(NO_TOOL_FORMAT)
            text = self.render_chat(req.messages, True, req.chat_template_kwargs, req.tools)
        else:
            assert req.prompt is not None
            text = req.prompt
        if req.images is not None:
            try:
                return encode_with_images(self.tokenizer, text, req.images, self.vocab_size)
            except ValueError as exc:
                raise InvalidRequestError(str(exc)) from exc
        return self.encode_text(text, add_special_tokens=False)

    def render_chat(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool,
        kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """`messages` (and `tools`) through the model's chat template, with the caller's
        template variables."""
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send prompt_token_ids")
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **(kwargs or {}),
            )
        except Exception as exc:  # template errors are the caller's messages' fault
            raise InvalidRequestError(f"cannot apply the chat template: {exc}") from exc

    def encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send prompt_token_ids")
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as exc:  # e.g. a lone surrogate: the text is not valid Unicode
            raise InvalidRequestError(f"cannot tokenize the prompt: {type(exc).__name__}") from exc

    def _renders_tools(self) -> bool:
        if self._tool_format is None:
            self._tool_format = renders_tools(self.tokenizer)
        return self._tool_format

    def decode_ids(self, ids: list[int]) -> str:
        """Text of token ids (special tokens kept, as vLLM's /detokenize)."""
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer")
        check_in_vocab(ids, self.vocab_size, "token ids")
        return self.tokenizer.decode(ids)

    def _check_lengths(self, n: int, req: GenerationRequest) -> None:
        limit, p = self.max_model_len, req.sampling
        if n >= limit:
            raise InvalidRequestError(
                f"the prompt has {n} tokens; this model's limit is {limit} "
                "tokens for prompt and completion together"
            )
        if not p.clamp_to_context and n + p.max_tokens > limit:
            raise InvalidRequestError(
                f"this model's maximum context length is {limit} tokens, but "
                f"{n + p.max_tokens} were requested ({n} in the prompt, "
                f"{p.max_tokens} in max_tokens)"
            )
        need = n + (1 if p.clamp_to_context else p.max_tokens)
        if need > self.kv_tokens:
            raise InvalidRequestError(
                f"the request needs {need} tokens of KV cache ({n} in the prompt, "
                f"{need - n} to generate) but this engine's whole KV budget holds "
                f"{self.kv_tokens} tokens"
            )

    def check(self, req: GenerationRequest) -> list[int]:
        """Cheap checks before queueing; returns the prompt ids."""
        ids = self.encode_prompt(req)
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        self._check_lengths(len(ids), req)
        check_in_vocab(req.sampling.stop_token_ids, self.vocab_size, "stop_token_ids")
        check_in_vocab(req.sampling.logit_bias, self.vocab_size, "logit_bias token ids")
        if req.response_format is not None:
            self.grammars.check(req.response_format)  # compiled later, in the fair compile queue
        self._check_route(req)
        return ids

    def _check_route(self, req: GenerationRequest) -> None:
        route = req.route
        if req.return_gate_summary and not route.is_learned:
            raise InvalidRequestError(
                f"a gate summary needs a learned composition; this request's route is "
                f"{route.kind!r}, which has no gate"
            )
        try:
            check_route_limits(route, self.limits, self.vocab_size)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        for name in route.adapters():
            self.hot_set.check_adapter(name)  # raises AdapterNotFoundError; no download
        comp_config = None
        needed = list(route.adapters())
        comp = route.gate_composition
        if comp is not None:  # its experts come from the composition's config, read from disk
            folder = self.hot_set.source.composition_path(comp)
            try:
                comp_config = read_composition_config(comp, folder)
            except CompositionError as exc:
                raise AdapterLoadError(str(exc)) from exc
            needed = list(dict.fromkeys(needed + comp_config.adapters))
        try:
            route.check_width(self.width, comp_config)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        if len(needed) > self.hot_set.num_slots:
            raise InvalidRequestError(
                f"the route needs {len(needed)} adapters at once but the hot-set has "
                f"{self.hot_set.num_slots} slots"
            )
