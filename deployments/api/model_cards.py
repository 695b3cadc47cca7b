"""`GET /v1/models`: the base model, adapters, compositions and routes a caller may use."""

from __future__ import annotations

from deployments.access.tenancy import visible_routes
from deployments.api.response_models import ModelCard, ModelList
from deployments.catalog.model_names import Resolver
from molora_runtime.routes import RouteSpec


def model_list(resolver: Resolver, routes: dict[str, RouteSpec], expose_base: bool) -> ModelList:
    """The caller's catalog (already filtered to its tenant) as OpenAI model cards."""
    base = resolver.base_name
    cards: list[ModelCard] = []
    if expose_base:
        cards.append(ModelCard(id=base, root=base, molora={"kind": "base"}))
    for name, entry in sorted(resolver.adapters.items()):
        molora = {"kind": "adapter", "versions": list(entry.versions), "latest": entry.latest}
        cards.append(ModelCard(id=name, root=base, parent=base, molora=molora))
    for name, entry in sorted(resolver.compositions.items()):
        molora = {
            "kind": "composition",
            "adapters": list(entry.adapters),
            "versions": list(entry.versions),
            "latest": entry.latest,
        }
        cards.append(ModelCard(id=name, root=base, parent=base, molora=molora))
    for name, route in sorted(visible_routes(resolver, routes).items()):
        molora = {"kind": "route", "route": route.model_dump()}
        cards.append(ModelCard(id=name, root=base, parent=base, molora=molora))
    return ModelList(data=cards)
