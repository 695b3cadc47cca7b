"""From a validated OpenAI body and its resolved route to the engine's `GenerationRequest`."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from deployments.api.gate_summary import check_gate_summary
from deployments.api.http_errors import ApiError, validation_message
from deployments.api.images import wants_images
from deployments.api.request_models import ChatCompletionRequest, CompletionRequest
from deployments.api.response_models import new_id
from deployments.catalog.model_names import Resolved
from molora_runtime.engine.types import GenerationRequest, SamplingParams

Body = CompletionRequest | ChatCompletionRequest

# Echoed prompt logprob entries one request may ask for, prompt length counted in characters
# (or token ids): each entry is a token's text and logprob plus its top alternatives, and every
# choice carries all of them at once.
MAX_ECHO_LOGPROB_ENTRIES = 2_000_000
# Sampling fields the body carries under the engine's names, handed over unchanged.
PASSED_AS_IS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "include_stop_str_in_output",
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
)


def check_echo_size(body: Body) -> None:
    """A 400 for `echo` x `logprobs` x choices too large to send back."""
    if not isinstance(body, CompletionRequest) or not body.echo or body.logprobs is None:
        return
    prompt = body.prompt
    units = (
        len(prompt)
        if isinstance(prompt, str)
        else sum(len(p) if isinstance(p, str) else 1 for p in prompt)
    )
    choices = body.choice_counts()[1]
    entries = choices * (body.logprobs + 1) * units
    if entries > MAX_ECHO_LOGPROB_ENTRIES:
        raise ApiError(
            400,
            f"echo with logprobs={body.logprobs} over a {units}-character prompt for "
            f"{choices} choices asks ~{entries} prompt logprob entries, over "
            f"{MAX_ECHO_LOGPROB_ENTRIES}: lower logprobs, n/best_of or the prompt",
            "logprobs",
        )


def logprobs_asked(body: Body) -> int | None:
    """Top alternatives the engine reports; best_of > n needs the sampled token's logprob
    to rank the choices even when the client asked for none."""
    asked = body.top_logprobs_wanted()
    n, best_of = body.choice_counts()
    if asked is None and best_of > n:
        return 0
    return asked


def engine_request(
    body: Body,
    resolved: Resolved,
    chat: bool,
    default_max_tokens: int,
    images: list[list[int]] | None = None,
    tenant: str | None = None,
) -> GenerationRequest:
    """The engine request; a value the engine refuses becomes a 400 naming its field."""
    check_gate_summary(body, resolved)
    try:
        asked = body.requested_max_tokens()
        sampling = SamplingParams(
            max_tokens=asked or default_max_tokens,
            # A client's own max_tokens past the context is a 400 unless it opts in.
            clamp_to_context=asked is None or body.molora.allow_truncation,
            **{name: getattr(body, name) for name in PASSED_AS_IS},
            stop=body.stop_list(),
            logit_bias=body.bias_ids(),
            logprobs=logprobs_asked(body),
            prompt_logprobs=(body.logprobs or 0)
            if isinstance(body, CompletionRequest) and body.echo
            else None,
        )
        prompt: dict[str, Any]
        if isinstance(body, ChatCompletionRequest):
            prompt = {
                "messages": body.engine_messages(),
                "chat_template_kwargs": body.chat_template_kwargs,
                "images": images,
                "image_output": wants_images(body, resolved.route),
                "tools": body.template_tools(),
                # The model chooses whether to call, or reads earlier calls: the template must
                # render tools (forced calls come from a grammar and need no template support).
                "needs_tool_format": body.tool_mode() == "auto" or body.has_tool_history(),
            }
        elif isinstance(body.prompt, str):
            prompt = {"prompt": body.prompt}
        elif isinstance(body.prompt[0], str):
            prompt = {"prompt": body.prompt[0]}
        else:
            prompt = {"prompt_token_ids": list(body.prompt)}
        return GenerationRequest(
            request_id=new_id("chatcmpl" if chat else "cmpl"),
            route=resolved.route,
            sampling=sampling,
            response_format=body.engine_format(),
            return_attribution=body.molora.return_attribution,
            return_gate_summary=body.molora.gate_summary,
            gate_summary_layers=body.molora.gate_summary_layers,
            tenant=tenant,
            cache_salt=body.cache_salt,
            **prompt,
        )
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise ApiError(400, message, param) from None
