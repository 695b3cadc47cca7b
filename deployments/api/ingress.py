"""The router (ingress) deployment: the OpenAI-compatible HTTP API.

(No `from __future__ import annotations`: FastAPI must see the real `Request` type through
Serve's ingress wrapper, or it takes `request` for a query parameter.)

It authenticates the caller and takes its quota (deployments/access/gate.py), validates the body,
resolves `model` into a route against the registry as the caller's tenant sees it, and streams the
request through the model handle, whose `AdapterAffinityRouter` picks the replica; after the
first output, tokens come back through this router's stream channel from that replica when one is
attached (deployments/replica/stream_channel.py). It holds no tokenizer and no tensors; prompt-length
checks happen in the replica and come back as 400s.
"""

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.access.admission import AdmissionMiddleware
from deployments.access.auth import Principal
from deployments.access.gate import Access, AccessError
from deployments.access.gate import error_response as access_error_response
from deployments.access.tenancy import metric_label, visible_routes
from deployments.api.errors import status_of
from deployments.api.images import ImageOutput, ImagePartError, request_images, wants_images
from deployments.api.json_guard import BodyError, parse_body
from deployments.api.logprobs import chat_logprobs, completion_logprobs, mean_logprob
from deployments.api.openapi_docs import body_docs
from deployments.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    MoloraInfo,
    TokenAttributionOut,
    Usage,
    error_payload,
    new_id,
)
from deployments.catalog.admin import YankBody, scope_stats
from deployments.catalog.lora_admin import LoadLoraBody, UnloadLoraBody
from deployments.catalog.model_names import (
    BadModelName,
    CatalogCache,
    ModelNotFound,
    Resolved,
    Resolver,
)
from deployments.catalog.store import load_catalog
from deployments.catalog.watch import CatalogWatch
from deployments.config import REPO_ROOT, ServeConfig
from deployments.ops import metrics
from deployments.placement.affinity import adapter_key
from deployments.placement.request_router import PLACEMENT_KWARG, TARGET_KWARG
from deployments.replica.heap import GcPauseMeter
from deployments.replica.stream_channel import CHANNEL_LOST, ChannelClient
from deployments.replica.wire import (
    DeltaItem,
    ErrorItem,
    InfoItem,
    LogprobItem,
    ReplicaItem,
    TokenAttributionItem,
    UsageItem,
    decode,
)
from molora_runtime.engine.types import GenerationRequest, SamplingParams

logger = logging.getLogger("ray.serve")

Item = ReplicaItem

app = FastAPI(title="MoLoRA Serve", docs_url=None, redoc_url=None)
app.add_middleware(AdmissionMiddleware)


class ApiError(Exception):
    """An error answered in the OpenAI shape."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(
    status: int, message: str, param: str | None = None, retry_after: int = 1
) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if status in (429, 503) else None
    return JSONResponse(error_payload(status, message, param), status_code=status, headers=headers)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail))


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(400, str(exc))


_UNION_TAGS = {"str", "int", "float", "bool", "none"}


def _param_path(loc: tuple[Any, ...]) -> list[str]:
    """A location without pydantic's validator and union-member tags (`list[str]`, `int`)."""
    return [
        str(p)
        for p in loc
        if not str(p).startswith(("function-", "tagged-union"))
        and "[" not in str(p)
        and str(p) not in _UNION_TAGS
    ]


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """The most specific error as `param: message`, with `param` the dotted path of the bad
    field (for a union, the member that got furthest: `prompt.1`, not "not a string")."""
    errors = exc.errors()
    err = max(
        errors, key=lambda e: len([p for p in e["loc"] if not str(p).startswith("function-")])
    )
    loc = _param_path(err["loc"])
    param = ".".join(loc) or None
    msg = "unknown parameter" if err["type"] == "extra_forbidden" else err["msg"]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param


def route_label(resolved: Resolved) -> str:
    route = resolved.route
    if route.kind == "learned":
        return route.composition.split("@", 1)[0]  # type: ignore[union-attr]
    return adapter_key(resolved.placement_adapters) or "base"


def head_info(head: list[Item]) -> InfoItem | None:
    """The `info` a started stream opened with (absent when it failed before any output)."""
    return head[0] if isinstance(head[0], InfoItem) else None


def sse(payload: Any) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class _Tracker:
    """Per-request metrics: TTFT, inter-token gaps, tokens, final status."""

    def __init__(self, resolved: Resolved) -> None:
        self.kind = resolved.kind
        self.label = route_label(resolved)
        self.start = time.perf_counter()
        self.last: float | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.on_done: list[Any] = []  # callbacks (tokens_used, ok): quota lease, load estimate

    def on_item(self, item: Item) -> None:
        if isinstance(item, UsageItem):
            self.prompt_tokens = item.prompt_tokens
            self.completion_tokens = item.completion_tokens
            return
        if not isinstance(item, DeltaItem) or not item.token_ids:
            return
        now = time.perf_counter()
        n = len(item.token_ids)
        self.completion_tokens += n
        with contextlib.suppress(Exception):
            if self.last is None:
                metrics.ttft().observe(now - self.start, tags={"route_kind": self.kind})
            else:
                gap = (now - self.last) / n
                for _ in range(n):
                    metrics.inter_token().observe(gap, tags={"route_kind": self.kind})
        self.last = now

    def done(self, status: str) -> None:
        for callback in self.on_done:
            callback(self.prompt_tokens + self.completion_tokens, status == "ok")
        with contextlib.suppress(Exception):
            tags = {"route_kind": self.kind, "adapter": self.label}
            metrics.requests().inc(tags={**tags, "status": status})
            if self.prompt_tokens:
                metrics.tokens().inc(self.prompt_tokens, tags={**tags, "kind": "prompt"})
            if self.completion_tokens:
                metrics.tokens().inc(self.completion_tokens, tags={**tags, "kind": "completion"})


def choices_asked(body: Any) -> tuple[int, int]:
    """(choices returned, choices generated): n, and best_of for completions."""
    n = body.n
    best_of = getattr(body, "best_of", None) or n
    return n, best_of


class _Shaper:
    """Turns replica items into OpenAI responses and chunks (choices by their `index`)."""

    def __init__(
        self, body: Any, resolved: Resolved, chat: bool, request_id: str, images: bool = False
    ) -> None:
        self.body, self.resolved, self.chat, self.id = body, resolved, chat, request_id
        self.images = ImageOutput() if images and chat else None
        self.model = body.model
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.usage = Usage()
        self.sent_role: set[int] = set()
        self.info: InfoItem | None = None
        self.want_logprobs = body.top_logprobs_wanted() is not None
        self.n, self.best_of = choices_asked(body)
        self.offsets: dict[int, int] = {}  # completions' text_offset per choice (streaming)
        self.echo = bool(getattr(body, "echo", False))

    def _echo(self, deltas: list[DeltaItem]) -> tuple[str, list[LogprobItem]]:
        """Echo's prompt text and its logprob items (from the choice's first delta)."""
        items = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), [])
        text = self.body.prompt_text()
        if text is None:
            text = "".join(i.token for i in items)
        return text, items

    def _logprobs(
        self, deltas: list[DeltaItem], offset: int = 0, prompt: list[LogprobItem] | None = None
    ) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        items = [lp for d in deltas for lp in d.logprobs or []]
        if self.chat:
            return chat_logprobs(items)
        return completion_logprobs([*(prompt or []), *items], offset)

    def _usage(self, item: UsageItem) -> None:
        p, c = item.prompt_tokens, item.completion_tokens
        self.usage = Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

    def _info(
        self, with_replica: bool, attribution: list[TokenAttributionItem] | None
    ) -> MoloraInfo:
        info = self.info if with_replica else None
        return MoloraInfo(
            route_kind=self.resolved.kind,
            versions=self.resolved.versions or None,
            replica=info.replica if info else None,
            hot_set_hit=info.hot_set_hit if info else None,
            tier=info.tier if info else None,
            attribution=[
                TokenAttributionOut(token_id=a.token_id, adapters=a.adapters) for a in attribution
            ]
            if attribution is not None
            else None,
        )

    def full(self, items: list[Item]) -> dict[str, Any]:
        by_index: dict[int, list[DeltaItem]] = {}
        for item in items:
            if isinstance(item, InfoItem):
                self.info = item
            elif isinstance(item, UsageItem):
                self._usage(item)
            elif isinstance(item, DeltaItem):
                by_index.setdefault(item.index, []).append(item)
        order = sorted(by_index)
        if self.best_of > self.n:  # best_of: the n choices with the best mean token logprob
            score = {
                i: mean_logprob([lp for d in by_index[i] for lp in d.logprobs or []]) for i in order
            }
            order = sorted(order, key=lambda i: -score[i])[: self.n]
        chat_choices: list[ChatChoice] = []
        text_choices: list[CompletionChoice] = []
        attribution = None
        for out_index, i in enumerate(order):
            deltas = by_index[i]
            text = "".join(d.text for d in deltas)
            finish = next((d.finish_reason for d in reversed(deltas) if d.finish_reason), None)
            if self.body.molora.return_attribution and out_index == 0:
                attribution = [a for d in deltas for a in d.attribution or []]
            prompt: list[LogprobItem] = []
            if self.echo:
                prompt_text, prompt = self._echo(deltas)
                text = prompt_text + text
            logprobs = self._logprobs(deltas, 0, prompt)
            if self.chat:
                message = AssistantMessage(content=text)
                if self.images is not None:
                    message.images = ImageOutput.all([t for d in deltas for t in d.token_ids])
                chat_choices.append(
                    ChatChoice(
                        index=out_index,
                        message=message,
                        finish_reason=finish,
                        logprobs=logprobs,
                    )
                )
            else:
                text_choices.append(
                    CompletionChoice(
                        index=out_index, text=text, finish_reason=finish, logprobs=logprobs
                    )
                )
        info = self._info(True, attribution)
        if self.chat:
            return ChatCompletionResponse(
                id=self.id, model=self.model, choices=chat_choices, usage=self.usage, molora=info
            ).model_dump(exclude_none=True)
        return CompletionResponse(
            id=self.id, model=self.model, choices=text_choices, usage=self.usage, molora=info
        ).model_dump(exclude_none=True)

    def chunks(self, item: Item) -> list[dict[str, Any]]:
        if isinstance(item, InfoItem):
            self.info = item
            return []
        if isinstance(item, UsageItem):
            self._usage(item)
            return []
        if not isinstance(item, DeltaItem):
            return []
        text, finish, index = item.text, item.finish_reason, item.index
        first = index not in self.sent_role
        images = self.images.feed(index, item.token_ids, finish is not None) if self.images else []
        if not text and finish is None and not first and not item.logprobs and not images:
            return []
        info = None
        if (first and not self.sent_role) or item.attribution:
            info = self._info(not self.sent_role, item.attribution)
        offset = self.offsets.get(index, 0)
        prompt: list[LogprobItem] = []
        if self.echo and first:
            prompt_text, prompt = self._echo([item])
            text = prompt_text + text
        logprobs = None
        if item.logprobs or finish or prompt:
            logprobs = self._logprobs([item], offset, prompt)
        if logprobs is not None and not self.chat:
            self.offsets[index] = offset + sum(
                len(lp.token) for lp in [*prompt, *(item.logprobs or [])]
            )
        if self.chat:
            delta = DeltaMessage(content=text, images=images or None)
            if first:
                delta.role = "assistant"
            chunk: Any = ChatCompletionChunk(
                id=self.id,
                model=self.model,
                choices=[
                    ChatChunkChoice(
                        index=index, delta=delta, finish_reason=finish, logprobs=logprobs
                    )
                ],
                molora=info,
            )
        else:
            chunk = CompletionChunk(
                id=self.id,
                model=self.model,
                choices=[
                    CompletionChoice(
                        index=index, text=text, finish_reason=finish, logprobs=logprobs
                    )
                ],
                molora=info,
            )
        self.sent_role.add(index)
        return [chunk.model_dump(exclude_none=True)]

    def usage_chunk(self) -> dict[str, Any]:
        cls = ChatCompletionChunk if self.chat else CompletionChunk
        return cls(id=self.id, model=self.model, choices=[], usage=self.usage).model_dump(
            exclude_none=True
        )


@serve.deployment(name="Router", max_ongoing_requests=512)
@serve.ingress(app)
class Router:
    """OpenAI-compatible ingress in front of the model replicas."""

    async def __init__(
        self,
        model: DeploymentHandle,
        config: dict[str, Any],
        epoch: DeploymentHandle | None = None,
    ) -> None:
        self.cfg = ServeConfig.model_validate(config)
        self.model = model
        self.catalog = CatalogCache(
            lambda: asyncio.to_thread(load_catalog, self.cfg.store), self.cfg.store.refresh_s
        )
        self.epoch = CatalogWatch(self.catalog, epoch, uuid.uuid4().hex)
        self._last_forced = 0.0
        self._channel_id = uuid.uuid4().hex
        self.channels = (
            ChannelClient(self._open_channel) if self.cfg.server.stream_channels else None
        )
        self.access = Access(self.cfg.server, self.cfg.engine.max_num_seqs, REPO_ROOT)
        self.access.announce()
        app.state.admission = self.access.admission
        # A daemon thread: it ends with this process, nothing to stop.
        self._gc_meter = GcPauseMeter(metrics.record_gc_pause).start()

    def _open_channel(self, replica: str) -> Any:
        """This router's stream channel from one model replica (deployments/replica/stream_channel.py)."""
        return self.model.options(stream=True).channel.remote(
            self._channel_id, **{TARGET_KWARG: replica}
        )

    # -- endpoints --------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> JSONResponse:
        try:
            info = await asyncio.wait_for(self.model.health.remote(), timeout=10)
        except Exception as exc:
            return error_response(
                503, f"model replicas are not healthy: {type(exc).__name__}: {exc}"
            )
        return JSONResponse({"status": "ok", **info})

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        try:
            principal = await self.access.authenticate(request)
        except AccessError as exc:
            return access_error_response(exc)
        catalog = self.access.visible(principal, await self.catalog.get())
        resolver = Resolver(self.cfg, catalog)
        base = resolver.base_name
        cards: list[ModelCard] = []
        if self.cfg.expose.base:
            cards.append(ModelCard(id=base, root=base, molora={"kind": "base"}))
        for name, entry in sorted(resolver.adapters.items()):
            cards.append(
                ModelCard(
                    id=name,
                    root=base,
                    parent=base,
                    molora={
                        "kind": "adapter",
                        "versions": list(entry.versions),
                        "latest": entry.latest,
                    },
                )
            )
        for name, entry in sorted(resolver.compositions.items()):
            cards.append(
                ModelCard(
                    id=name,
                    root=base,
                    parent=base,
                    molora={
                        "kind": "composition",
                        "adapters": list(entry.adapters),
                        "versions": list(entry.versions),
                        "latest": entry.latest,
                    },
                )
            )
        for name, route in sorted(visible_routes(resolver, self.cfg.expose.routes).items()):
            cards.append(
                ModelCard(
                    id=name,
                    root=base,
                    parent=base,
                    molora={"kind": "route", "route": route.model_dump()},
                )
            )
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.post("/v1/completions", openapi_extra=body_docs(CompletionRequest))
    async def completions(self, request: Request) -> Any:
        return await self._handle(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=body_docs(ChatCompletionRequest))
    async def chat_completions(self, request: Request) -> Any:
        return await self._handle(request, chat=True)

    @app.get("/v1/admin/stats")
    async def replica_stats(self, request: Request) -> Any:
        """Admin keys: one replica's adapter tiers (counters, bytes, load-stage latencies) and
        which tier each adapter is in; `replica` names which one answered. Prometheus has
        the aggregate over replicas."""
        try:
            principal = await self.access.authenticate(request)
            self.access.require_admin(principal)
        except AccessError as exc:
            return access_error_response(exc)
        try:
            result = await asyncio.wait_for(self.model.tier_stats.remote(), timeout=30)
        except Exception as exc:
            return error_response(503, f"no replica answered: {type(exc).__name__}: {exc}")
        visible = self.access.visible(principal, await self.catalog.get())
        return JSONResponse(scope_stats(result, visible))

    @app.post("/v1/admin/{collection}/{name}/{action}", openapi_extra=body_docs(YankBody))
    async def admin(self, collection: str, name: str, action: str, request: Request) -> Any:
        """Admin keys: `POST /v1/admin/adapters/NAME/yank` (or unyank; or compositions)."""
        try:
            principal = await self.access.authenticate(request)
            result = await self.access.admin(
                principal, self.cfg.store, collection, name, action, await request.body()
            )
        except AccessError as exc:
            return access_error_response(exc)
        return JSONResponse(result, headers=await self.epoch.changed())

    @app.post("/v1/load_lora_adapter", openapi_extra=body_docs(LoadLoraBody))
    async def load_lora_adapter(self, request: Request) -> Any:
        """vLLM's runtime LoRA load: publishes `lora_path` to the store as `lora_name`."""
        return await self._lora(request, "load")

    @app.post("/v1/unload_lora_adapter", openapi_extra=body_docs(UnloadLoraBody))
    async def unload_lora_adapter(self, request: Request) -> Any:
        """vLLM's runtime LoRA unload: yanks every version of `lora_name`."""
        return await self._lora(request, "unload")

    async def _lora(self, request: Request, action: str) -> Any:
        try:
            principal = await self.access.authenticate(request)
            result = await self.access.lora(
                principal, self.cfg, action, await request.body(), REPO_ROOT
            )
        except AccessError as exc:
            return access_error_response(exc)
        except Exception as exc:  # the store: down (503) or answering garbage (502)
            status = status_of(exc)
            return error_response(
                status, f"{type(exc).__name__}: {exc}" if status >= 500 else str(exc)
            )
        headers = await self.epoch.changed()
        return PlainTextResponse(
            result["message"], headers=headers
        )  # vLLM answers with this sentence

    # -- request path -----------------------------------------------------------------------

    async def _handle(self, request: Request, chat: bool) -> Any:
        retry_after = self.access.load.retry_after()
        end = None
        try:
            principal = await self.access.authenticate(request)
            body = await self._parse(request, chat)
            max_tokens = body.requested_max_tokens() or self.cfg.server.default_max_tokens
            # Every choice may run to max_tokens: the token quota is charged for all of them.
            prompt_bound = len(await request.body())  # bytes >= prompt tokens: charged on abort
            end = self.access.admit(principal, max_tokens * choices_asked(body)[1], prompt_bound)
            resolved = await self._resolve(body, principal)
            images = await self._images(body)
            gen_req = self._engine_request(body, resolved, chat, images)
        except AccessError as exc:
            return access_error_response(exc)
        except ApiError as exc:
            if end is not None:
                end(0, False)
            return error_response(exc.status, exc.message, exc.param, retry_after)
        tracker = _Tracker(resolved)
        tracker.label = metric_label(tracker.label, resolved, await self.catalog.get())
        tracker.on_done.append(lambda used, ok: end(used, ok, tracker.prompt_tokens > 0))
        try:
            stream, first = await self._start(gen_req, resolved, choices_asked(body)[1])
        except ApiError as exc:
            tracker.done(str(exc.status))
            return error_response(exc.status, exc.message, exc.param, retry_after)
        shaper = _Shaper(body, resolved, chat, gen_req.request_id, gen_req.image_output)
        if body.stream:
            return StreamingResponse(
                self._sse(stream, first, shaper, tracker),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": gen_req.request_id},
            )
        return await self._collect(stream, first, shaper, tracker)

    async def _parse(
        self, request: Request, chat: bool
    ) -> CompletionRequest | ChatCompletionRequest:
        raw = await request.body()
        if len(raw) > self.cfg.server.max_request_bytes:
            raise ApiError(413, f"request body exceeds {self.cfg.server.max_request_bytes} bytes")
        try:
            data = parse_body(raw, self.cfg.server.max_json_depth)
        except BodyError as exc:
            raise ApiError(400, str(exc)) from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object")
        model_cls = ChatCompletionRequest if chat else CompletionRequest
        try:
            return model_cls.model_validate(data)
        except ValidationError as exc:
            message, param = validation_message(exc)
            raise ApiError(400, message, param) from None

    async def _resolve(
        self, body: CompletionRequest | ChatCompletionRequest, principal: Principal
    ) -> Resolved:
        explicit = body.molora.route
        for attempt in range(2):
            catalog = await self.catalog.get(force=attempt > 0)
            resolver = Resolver(self.cfg, self.access.visible(principal, catalog))
            try:
                return resolver.resolve(body.model, explicit)
            except BadModelName as exc:
                raise ApiError(400, str(exc), "model") from None
            except ModelNotFound as exc:
                # A name published seconds ago may not be in the cached catalog yet.
                now = time.monotonic()
                if attempt == 0 and now - self._last_forced > 1.0:
                    self._last_forced = now
                    continue
                param = "molora.route" if explicit is not None else "model"
                raise ApiError(404, str(exc), param) from None
        raise AssertionError("unreachable")

    @staticmethod
    async def _images(body: CompletionRequest | ChatCompletionRequest) -> list[list[int]] | None:
        """The chat request's image parts as 8x8 grey levels (decoded off the event loop)."""
        if not isinstance(body, ChatCompletionRequest) or not body.has_images():
            return None
        try:
            return await asyncio.to_thread(request_images, body)
        except ImagePartError as exc:
            raise ApiError(400, str(exc), exc.param) from None

    def _engine_request(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        resolved: Resolved,
        chat: bool,
        images: list[list[int]] | None = None,
    ) -> GenerationRequest:
        try:
            asked = body.requested_max_tokens()
            sampling = SamplingParams(
                max_tokens=asked or self.cfg.server.default_max_tokens,
                # A client's own max_tokens past the context is a 400 unless it opts in.
                clamp_to_context=asked is None or body.molora.allow_truncation,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=body.seed,
                stop=body.stop_list(),
                stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                logit_bias=body.bias_ids(),
                min_tokens=body.min_tokens,
                logprobs=self._logprobs_asked(body),
                prompt_logprobs=(body.logprobs or 0)
                if isinstance(body, CompletionRequest) and body.echo
                else None,
            )
            prompt: dict[str, Any]
            if isinstance(body, ChatCompletionRequest):
                prompt = {
                    "messages": body.engine_messages(),
                    "images": images,
                    "image_output": wants_images(body, resolved.route),
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
                **prompt,
            )
        except ValidationError as exc:
            message, param = validation_message(exc)
            raise ApiError(400, message, param) from None

    @staticmethod
    def _logprobs_asked(body: CompletionRequest | ChatCompletionRequest) -> int | None:
        """Top alternatives the engine reports; best_of > n needs the sampled token's logprob
        to rank the choices even when the client asked for none."""
        asked = body.top_logprobs_wanted()
        n, best_of = choices_asked(body)
        if asked is None and best_of > n:
            return 0
        return asked

    async def _start(
        self, req: GenerationRequest, resolved: Resolved, n: int = 1
    ) -> tuple[Any, list[Item]]:
        """Send the request and wait for its first output (past `info`), so errors — an adapter
        that cannot load included — still get a real status before any header is sent."""
        payload = req.model_dump(mode="json")
        placement = {"adapters": list(resolved.placement_adapters)}
        extra: dict[str, Any] = {"n": n} if n > 1 else {}
        if self.channels is not None:
            extra["channel"] = self._channel_id
            self.channels.register(req.request_id)
        try:
            stream, head = await self._send(req, payload, placement, extra)
        except BaseException:
            self._forget(req.request_id)
            raise
        info = head_info(head)
        if self.channels is not None and info is not None:
            self.channels.on_replica(req.request_id, info.replica, info.channel)
        return stream, head

    def _forget(self, key: str) -> None:
        if self.channels is not None:
            self.channels.unregister(key)

    async def _send(
        self,
        req: GenerationRequest,
        payload: dict[str, Any],
        placement: dict[str, Any],
        extra: dict[str, Any],
    ) -> tuple[Any, list[Item]]:
        for attempt in range(2):
            stream = self.model.options(stream=True).generate.remote(
                payload, **{PLACEMENT_KWARG: placement}, **extra
            )
            head: list[Item] = []
            try:
                while not head or isinstance(head[-1], InfoItem):
                    head.append(decode(await stream.__anext__()))
            except StopAsyncIteration:
                stream.cancel()
                raise ApiError(500, "the replica ended the stream without output") from None
            except BackPressureError as exc:
                raise ApiError(503, f"server overloaded, retry later: {exc}") from None
            except asyncio.CancelledError:
                stream.cancel()
                raise
            except ValidationError as exc:
                stream.cancel()
                logger.error("request %s: malformed replica item: %s", req.request_id, exc)
                raise ApiError(500, "internal error: the replica sent a malformed item") from None
            except Exception as exc:
                # The replica died before producing anything: nothing was sent, so try another.
                logger.warning("request %s failed to start: %r", req.request_id, exc)
                stream.cancel()
                if attempt == 0:
                    continue
                raise ApiError(
                    503, f"no model replica could take the request: {type(exc).__name__}"
                ) from None
            last = head[-1]
            if isinstance(last, ErrorItem):
                stream.cancel()
                raise ApiError(last.status, last.message, last.param)
            return stream, head
        raise AssertionError("unreachable")

    async def _items(
        self, stream: Any, head: list[Item], tracker: _Tracker, key: str
    ) -> AsyncIterator[list[Item]]:
        """A started stream's items up to `usage` or `error`, in batches: the head, then what
        had arrived by the time the consumer asked (from the stream channel when the replica
        routed them there), so a router that fell behind catches up in one write per request,
        not one per token. Cancelling the consumer cancels the replica call."""
        try:
            for item in head:
                tracker.on_item(item)
            yield head
            if isinstance(head[-1], UsageItem | ErrorItem):
                return
            info = head_info(head)
            via_channel = self.channels is not None and info is not None and info.channel
            source = self._channel_items(key) if via_channel else self._stream_items(stream)
            async with contextlib.aclosing(source) as raws:
                async for batch in raws:
                    items: list[Item] = []
                    for raw in batch:
                        item = decode(raw)
                        tracker.on_item(item)
                        items.append(item)
                        if isinstance(item, UsageItem | ErrorItem):
                            yield items
                            return
                    yield items
        finally:
            stream.cancel()
            self._forget(key)

    @staticmethod
    async def _stream_items(stream: Any) -> AsyncIterator[list[Any]]:
        async for raw in stream:
            yield [raw]

    async def _channel_items(self, key: str) -> AsyncIterator[list[Any]]:
        queue = self.channels.queue_of(key)  # type: ignore[union-attr]
        if queue is None:
            raise RuntimeError("the request's stream channel entry is gone")
        while True:
            batch = [await queue.get()]
            while not queue.empty() and batch[-1] != CHANNEL_LOST:
                batch.append(queue.get_nowait())
            if batch[-1] == CHANNEL_LOST:
                if len(batch) > 1:
                    yield batch[:-1]
                raise RuntimeError("the stream channel from the model replica ended")
            yield batch

    async def _collect(
        self, stream: Any, head: list[Item], shaper: _Shaper, tracker: _Tracker
    ) -> JSONResponse:
        items: list[Item] = []
        try:
            async with contextlib.aclosing(self._items(stream, head, tracker, shaper.id)) as source:
                async for batch in source:
                    for item in batch:
                        if isinstance(item, ErrorItem):
                            tracker.done(str(item.status))
                            return error_response(item.status, item.message, item.param)
                        items.append(item)
        except asyncio.CancelledError:
            tracker.done("cancelled")
            raise
        except Exception as exc:
            tracker.done("503")
            return error_response(
                503, f"the model replica failed mid-request: {type(exc).__name__}"
            )
        tracker.done("ok")
        return JSONResponse(shaper.full(items))

    async def _sse(
        self, stream: Any, head: list[Item], shaper: _Shaper, tracker: _Tracker
    ) -> AsyncIterator[str]:
        status = "ok"
        try:
            failed = False
            async with contextlib.aclosing(self._items(stream, head, tracker, shaper.id)) as source:
                async for batch in source:
                    out: list[str] = []
                    for item in batch:
                        if isinstance(item, ErrorItem):
                            status, failed = str(item.status), True
                            out.append(sse(error_payload(item.status, item.message, item.param)))
                            break
                        out.extend(sse(chunk) for chunk in shaper.chunks(item))
                    if out:
                        yield "".join(out)
                    if failed:
                        break
            if not failed and shaper.include_usage:
                yield sse(shaper.usage_chunk())
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        except Exception as exc:
            status = "503"
            logger.warning("stream failed mid-way: %r", exc)
            yield sse(
                error_payload(503, f"the model replica failed mid-stream: {type(exc).__name__}")
            )
        finally:
            tracker.done(status)
        yield sse("[DONE]")
