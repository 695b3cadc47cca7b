"""`GET /v1/models` and `GET /v1/models/{id}`: the base model, adapters, compositions and routes
a caller may use, as OpenAI model cards (with vLLM's `max_model_len`)."""

from __future__ import annotations

from deployments.access.tenancy import visible_routes
from deployments.api.http_errors import ApiError
from deployments.api.response_models import ModelCard, ModelList
from deployments.catalog.model_names import Resolver
from molora_runtime.routes import RouteSpec


def model_list(
    resolver: Resolver,
    routes: dict[str, RouteSpec],
    expose_base: bool,
    max_model_len: int | None = None,
) -> ModelList:
    """The caller's catalog (already filtered to its tenant) as OpenAI model cards."""
    base = resolver.base_name
    cards: list[ModelCard] = []

    def card(name: str, molora: dict) -> ModelCard:
        parent = None if molora["kind"] == "base" else base
        return ModelCard(
            id=name, root=base, parent=parent, max_model_len=max_model_len, molora=molora
        )

    if expose_base:
        cards.append(card(base, {"kind": "base"}))
    for name, entry in sorted(resolver.adapters.items()):
        molora = {"kind": "adapter", "versions": list(entry.versions), "latest": entry.latest}
        cards.append(card(name, molora))
    for name, entry in sorted(resolver.compositions.items()):
        molora = {
            "kind": "composition",
            "adapters": list(entry.adapters),
            "versions": list(entry.versions),
            "latest": entry.latest,
        }
        cards.append(card(name, molora))
    for name, route in sorted(visible_routes(resolver, routes).items()):
        cards.append(card(name, {"kind": "route", "route": route.model_dump()}))
    return ModelList(data=cards)


def model_card(
    model_id: str,
    resolver: Resolver,
    routes: dict[str, RouteSpec],
    expose_base: bool,
    max_model_len: int | None = None,
) -> ModelCard:
    """One listed card; a name the caller cannot list (unknown, or another tenant's) is the
    same OpenAI-shaped 404."""
    for card in model_list(resolver, routes, expose_base, max_model_len).data:
        if card.id == model_id:
            return card
    raise ApiError(404, f"The model `{model_id[:256]}` does not exist.", "model")
