"""How one request's response is shaped (chat or text, choices, logprobs, echo, tools, images,
what the `molora` block shows), read off the body once when the request is planned, so the
shaper never reads the body."""

from __future__ import annotations

from dataclasses import dataclass

from deployments.api.engine_request import Body
from deployments.api.request_models import ChatCompletionRequest, CompletionRequest
from deployments.catalog.model_names import Resolved


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """How the replica's items become the OpenAI response, read off the body once."""

    request_id: str
    chat: bool
    model: str
    stream: bool
    n: int  # choices returned
    best_of: int  # choices generated (the n with the best mean logprob return)
    include_usage: bool
    want_logprobs: bool
    attribution: bool
    echo: bool
    echo_text: str | None  # the prompt as text for echo (None: token ids, from the replica)
    tool_mode: str  # "none": no tool call can come
    parallel_tool_calls: bool
    images: bool  # generated image tokens are decoded into images (chat only)
    show_replica: bool  # which replica served, hot-set hit, tier
    route_kind: str
    versions: tuple[str, ...]

    @classmethod
    def of(
        cls,
        body: Body,
        resolved: Resolved,
        chat: bool,
        request_id: str,
        images: bool = False,
        show_replica: bool = True,
    ) -> ResponseShape:
        n, best_of = body.choice_counts()
        echo = isinstance(body, CompletionRequest) and body.echo
        tools = isinstance(body, ChatCompletionRequest) and chat
        return cls(
            request_id=request_id,
            chat=chat,
            model=body.model,
            stream=body.stream,
            n=n,
            best_of=best_of,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            want_logprobs=body.top_logprobs_wanted() is not None,
            attribution=bool(body.molora.return_attribution),
            echo=echo,
            echo_text=body.prompt_text() if echo else None,  # type: ignore[union-attr]
            tool_mode=body.tool_mode() if tools else "none",  # type: ignore[union-attr]
            parallel_tool_calls=bool(getattr(body, "parallel_tool_calls", True)),
            images=images and chat,
            show_replica=show_replica,
            route_kind=resolved.kind,
            versions=tuple(resolved.versions),
        )
