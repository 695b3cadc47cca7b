"""What a caller may see: public names plus its own tenant's private ones.

The ingress resolves every request against the catalog *as the caller sees it*, so another
tenant's adapter or composition is simply absent: listing omits it and naming it (alone, inside
a mix, a vocab route or an explicit route) fails with exactly the 404 of a name that does not
exist. A composition is visible only if it and every one of its experts are.
"""

from __future__ import annotations

from deployments.catalog.model_names import Catalog, ModelNotFound, Resolved, Resolver, Route


def _visible(owner: str | None, tenant: str | None) -> bool:
    return owner is None or owner == tenant


def _base(ref: str) -> str:
    return ref.partition("@")[0]


def visible_catalog(catalog: Catalog, tenant: str | None) -> Catalog:
    """The part of `catalog` a caller of `tenant` may list and use (None = public only)."""
    adapters = {n: e for n, e in catalog.adapters.items() if _visible(e.tenant, tenant)}
    compositions = {
        n: e
        for n, e in catalog.compositions.items()
        if _visible(e.tenant, tenant) and all(_base(a) in adapters for a in e.adapters)
    }
    return Catalog(adapters=adapters, compositions=compositions)


def visible_routes(resolver: Resolver, routes: dict[str, Route]) -> dict[str, Route]:
    """Named routes (config aliases) whose every ref resolves for this caller."""
    out = {}
    for name, route in routes.items():
        try:
            resolver.check_route(route)
        except ModelNotFound:
            continue
        out[name] = route
    return out


PRIVATE_LABEL = "private"


def metric_label(label: str, resolved: Resolved, catalog: Catalog) -> str:
    """The `adapter` label a request's metrics may carry: `label` when every name behind the
    route is public, else PRIVATE_LABEL, so the unauthenticated metrics exporter never names a
    tenant's private adapter or composition."""
    names = {_base(a) for a in resolved.placement_adapters}
    composition = getattr(resolved.route, "composition", None)
    private = any(
        (entry := catalog.adapters.get(n)) is not None and entry.tenant is not None for n in names
    )
    if composition is not None:
        entry = catalog.compositions.get(_base(composition))
        private = private or (entry is not None and entry.tenant is not None)
    return PRIVATE_LABEL if private else label


def private_names(catalog: Catalog) -> frozenset[str]:
    """Every tenant-owned adapter and composition name: what unauthenticated views must hide."""
    return frozenset(
        [n for n, e in catalog.adapters.items() if e.tenant is not None]
        + [n for n, e in catalog.compositions.items() if e.tenant is not None]
    )
