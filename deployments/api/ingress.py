"""The router (ingress) deployment: the OpenAI-compatible HTTP API as a table of routes.

(No `from __future__ import annotations`: FastAPI must see the real `Request` type through
Serve's ingress wrapper, or it takes `request` for a query parameter.)

Each endpoint is a few lines: generation goes through the one request handler
(deployments/api/handler.py), errors through one set of exception handlers
(deployments/api/http_errors.py), trust decisions through `Access` (deployments/access/gate.py).
"""

import asyncio
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.access import header_deadline
from deployments.access.admission import AdmissionMiddleware
from deployments.access.gate import Access, AccessError
from deployments.access.tenancy import private_names
from deployments.api.handler import RequestHandler
from deployments.api.http_errors import ApiError, install_handlers
from deployments.api.model_cards import model_card, model_list
from deployments.api.openapi_docs import body_docs
from deployments.api.request_models import ChatCompletionRequest, CompletionRequest
from deployments.api.server_info import ModelFacts, server_version
from deployments.api.tokenize import DetokenizeRequest, Tokenization, TokenizeRequest
from deployments.api.upstream import Upstream
from deployments.catalog.admin import YankBody, scope_stats
from deployments.catalog.lora_admin import LoadLoraBody, UnloadLoraBody
from deployments.catalog.model_names import CatalogCache, Resolver
from deployments.catalog.name_lookup import ABSENT_TTL_S, NameLookup
from deployments.catalog.store import CatalogLoader
from deployments.catalog.watch import CatalogWatch
from deployments.config import REPO_ROOT, ServeConfig
from deployments.protocol.errors import status_of
from deployments.replica.heap import GcPauseMeter
from deployments.replica.serve_env import wait_for_router_port
from deployments.replica.stream_channel import ChannelClient
from deployments.telemetry import metrics
from deployments.telemetry.metrics_scrape import MetricsScraper

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"

app = FastAPI(title="MoLoRA Serve", docs_url=None, redoc_url=None)
install_handlers(app)
app.add_middleware(AdmissionMiddleware)


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
        loader = CatalogLoader(self.cfg.store)
        self.catalog = CatalogCache(
            lambda: asyncio.to_thread(loader),
            self.cfg.store.refresh_s,
            max_share=self.cfg.store.reload_share,
            load_cpu_s=lambda: loader.cpu_s,
        )
        self.epoch = CatalogWatch(self.catalog, epoch, uuid.uuid4().hex, reader=loader)
        self.upstream = Upstream(model, uuid.uuid4().hex, None)
        if self.cfg.server.stream_channels:
            self.upstream.channels = ChannelClient(self.upstream.open_channel)
        self.access = Access(self.cfg.server, self.cfg.engine.max_num_seqs, REPO_ROOT)
        self.access.announce()
        app.state.admission = self.access.admission
        header_deadline.install(self.cfg.server.admission.header_timeout_s)
        lookup = NameLookup(
            self.catalog, loader.entries, min(ABSENT_TTL_S, self.cfg.store.refresh_s)
        )
        self.handler = RequestHandler(self.cfg, self.access, self.catalog, lookup, self.upstream)
        self.tokenization = Tokenization(self.cfg, self.access, self.catalog, model)
        self.facts = ModelFacts(model, self.cfg.engine.max_model_len)
        self.scraper = MetricsScraper(lambda: self._private_names())
        # A daemon thread: it ends with this process, nothing to stop.
        self._gc_meter = GcPauseMeter(metrics.record_gc_pause).start()
        await wait_for_router_port()  # Serve binds the router's own HTTP port after this

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(self) -> JSONResponse:
        try:
            info = await asyncio.wait_for(self.model.health.remote(), timeout=10)
        except Exception as exc:
            raise ApiError(
                503, f"model replicas are not healthy: {type(exc).__name__}: {exc}"
            ) from None
        return JSONResponse({"status": "ok", **info})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping(self) -> JSONResponse:
        """vLLM's (SageMaker's) liveness probe: the same check as /health."""
        return await self.health()

    @app.get("/version")
    async def version(self) -> JSONResponse:
        return JSONResponse({"version": server_version()})

    @app.get("/metrics")
    async def prometheus_metrics(self, request: Request) -> PlainTextResponse:
        """Prometheus text: our and vLLM-named series of every node, private names hidden.
        With auth on, an admin key: the series show every tenant's traffic."""
        if self.access.keys is not None:
            self.access.require_admin(await self.access.authenticate(request))
        return PlainTextResponse(await self.scraper.text(), media_type=PROMETHEUS_TEXT)

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        resolver = await self._resolver(request)
        cards = model_list(
            resolver, self.cfg.expose.routes, self.cfg.expose.base, await self.facts.max_model_len()
        )
        return JSONResponse(cards.model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def model_by_id(self, model_id: str, request: Request) -> JSONResponse:
        card = model_card(
            model_id,
            await self._resolver(request),
            self.cfg.expose.routes,
            self.cfg.expose.base,
            await self.facts.max_model_len(),
        )
        return JSONResponse(card.model_dump())

    @app.post("/tokenize", openapi_extra=body_docs(TokenizeRequest))
    async def tokenize(self, request: Request) -> JSONResponse:
        return JSONResponse(await self.tokenization.tokenize(request))

    @app.post("/detokenize", openapi_extra=body_docs(DetokenizeRequest))
    async def detokenize(self, request: Request) -> JSONResponse:
        return JSONResponse(await self.tokenization.detokenize(request))

    async def _resolver(self, request: Request) -> Resolver:
        principal = await self.access.authenticate(request)
        return self.access.resolver(principal, await self.catalog.get(), self.cfg)

    async def _private_names(self) -> frozenset[str]:
        return private_names(await self.catalog.get())

    @app.post("/v1/completions", openapi_extra=body_docs(CompletionRequest))
    async def completions(self, request: Request) -> Any:
        return await self.handler.handle(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=body_docs(ChatCompletionRequest))
    async def chat_completions(self, request: Request) -> Any:
        return await self.handler.handle(request, chat=True)

    @app.get("/v1/admin/stats")
    async def replica_stats(self, request: Request) -> Any:
        """Admin keys: one replica's adapter tiers (counters, bytes, load-stage latencies) and
        which tier each adapter is in; `replica` names which one answered. Prometheus has
        the aggregate over replicas."""
        principal = await self.access.authenticate(request)
        self.access.require_admin(principal)
        try:
            result = await asyncio.wait_for(self.model.tier_stats.remote(), timeout=30)
        except Exception as exc:
            raise ApiError(503, f"no replica answered: {type(exc).__name__}: {exc}") from None
        visible = self.access.visible(principal, await self.catalog.get())
        return JSONResponse(scope_stats(result, visible))

    @app.post("/v1/admin/{collection}/{name}/{action}", openapi_extra=body_docs(YankBody))
    async def admin(self, collection: str, name: str, action: str, request: Request) -> Any:
        """Admin keys: `POST /v1/admin/adapters/NAME/yank` (or unyank; or compositions)."""
        principal = await self.access.authenticate(request)
        result = await self.access.admin(
            principal, self.cfg.store, collection, name, action, await request.body()
        )
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
        principal = await self.access.authenticate(request)
        try:
            result = await self.access.lora(
                principal, self.cfg, action, await request.body(), REPO_ROOT
            )
        except AccessError:
            raise
        except Exception as exc:  # the store: down (503) or answering garbage (502)
            status = status_of(exc)
            raise ApiError(
                status, f"{type(exc).__name__}: {exc}" if status >= 500 else str(exc)
            ) from None
        # vLLM answers with this sentence.
        return PlainTextResponse(result["message"], headers=await self.epoch.changed())
