"""`POST /tokenize` and `POST /detokenize` as vLLM shapes them (its benchmark client aligns its
prompts with them).

The router validates the body (size, depth, fields) and the caller's right to the `model` it
names (another tenant's private model is a 404, as on the generation endpoints); a model
replica, which holds the tokenizer and chat template, does the work.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from pydantic import Field, model_validator

from deployments.access.gate import Access
from deployments.api.http_errors import ApiError, read_payload
from deployments.api.message_models import ChatMessage
from deployments.api.payload import Payload
from deployments.api.request_models import MAX_MESSAGES
from deployments.catalog.model_names import BadModelName, CatalogCache, ModelNotFound
from deployments.config import ServeConfig
from molora_runtime.engine.types import MAX_INT32, ChatTemplateValue, check_chat_template_kwargs

MAX_TOKENS = 1 << 20  # ids one /detokenize call may send
REPLICA_TIMEOUT_S = 60
# Calls one router has at the replicas at once (they run in the replicas' worker threads, beside
# request validation), and how many may wait for a turn before the next is a 429.
MAX_IN_FLIGHT = 8
MAX_WAITING = 1024


class TokenizeRequest(Payload):
    """vLLM's two tokenize bodies in one: `prompt`, or `messages` through the chat template."""

    model: str | None = Field(None, min_length=1, max_length=4096)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = Field(
        None, description="default: true for a prompt, false for messages (vLLM's)"
    )
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, ChatTemplateValue] | None = Field(None, max_length=16)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        if self.chat_template_kwargs is not None and self.messages is None:
            raise ValueError("chat_template_kwargs applies to messages only")
        check_chat_template_kwargs(self.chat_template_kwargs)
        return self

    def replica_payload(self) -> dict[str, Any]:
        chat = self.messages is not None
        special = self.add_special_tokens if self.add_special_tokens is not None else not chat
        role = {"developer": "system"}
        return {
            "prompt": self.prompt,
            "messages": [
                {"role": role.get(m.role, m.role), "content": m.text()} for m in self.messages
            ]
            if chat
            else None,
            "add_special_tokens": special,
            "add_generation_prompt": self.add_generation_prompt,
            "chat_template_kwargs": self.chat_template_kwargs,
            "return_token_strs": self.return_token_strs,
        }


class DetokenizeRequest(Payload):
    model: str | None = Field(None, min_length=1, max_length=4096)
    tokens: list[int] = Field(max_length=MAX_TOKENS)

    @model_validator(mode="after")
    def _ids(self) -> DetokenizeRequest:
        if any(not 0 <= t <= MAX_INT32 for t in self.tokens):
            raise ValueError("tokens must be ids >= 0")
        return self


class Tokenization:
    """The two endpoints' handlers (the ingress routes call them)."""

    def __init__(self, cfg: ServeConfig, access: Access, catalog: CatalogCache, model: Any) -> None:
        self.cfg, self.access, self.catalog, self.model = cfg, access, catalog, model
        self._turns = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._waiting = 0

    async def _body(self, request: Request, cls: type[Payload]) -> Any:
        principal = await self.access.authenticate(request)
        server = self.cfg.server
        body = read_payload(
            await request.body(), cls, server.max_request_bytes, server.max_json_depth
        )
        if body.model is not None:  # all models share the base tokenizer, but must be visible
            resolver = self.access.resolver(principal, await self.catalog.get(), self.cfg)
            try:
                resolver.resolve(body.model)
            except BadModelName as exc:
                raise ApiError(400, str(exc), "model") from None
            except ModelNotFound as exc:
                raise ApiError(404, str(exc), "model") from None
        return body

    async def _call(self, method: str, arg: Any) -> dict[str, Any]:
        if self._waiting >= MAX_WAITING:
            raise ApiError(429, f"over {MAX_WAITING} tokenize calls are waiting; retry later")
        self._waiting += 1
        waiting = True
        try:
            async with self._turns:
                self._waiting, waiting = self._waiting - 1, False
                result = await asyncio.wait_for(
                    getattr(self.model, method).remote(arg), REPLICA_TIMEOUT_S
                )
        except Exception as exc:
            raise ApiError(503, f"no replica answered: {type(exc).__name__}") from None
        finally:
            if waiting:  # cancelled before its turn
                self._waiting -= 1
        if "error" in result:
            raise ApiError(400, result["error"])
        return result

    async def tokenize(self, request: Request) -> dict[str, Any]:
        body: TokenizeRequest = await self._body(request, TokenizeRequest)
        return await self._call("tokenize", body.replica_payload())

    async def detokenize(self, request: Request) -> dict[str, Any]:
        body: DetokenizeRequest = await self._body(request, DetokenizeRequest)
        return await self._call("detokenize", body.tokens)
