"""What a caller may see: public names plus its own tenant's private ones.

The ingress resolves every request against the catalog *as the caller sees it*, so another
tenant's adapter or composition is simply absent: listing omits it and naming it (alone, inside
a mix, a vocab route or an explicit route) fails with exactly the 404 of a name that does not
exist. A composition is visible only if it and every one of its experts are.

A tenant's namespaced names (`tenant~name` in the store) appear to it under their plain name and
shadow a public name it would otherwise see; entries keep their store name, which is what a
resolved route pins.
"""

from __future__ import annotations

from adapter_store.names import namespace_of, namespaced, plain_name
from deployments.catalog.model_names import (
    Catalog,
    ModelNotFound,
    NameKey,
    Resolved,
    Resolver,
    Route,
)


def _visible(owner: str | None, tenant: str | None) -> bool:
    return owner is None or owner == tenant


def _base(ref: str) -> str:
    return ref.partition("@")[0]


def _view(entries: dict, tenant: str | None) -> dict:
    """Store names → entries as `tenant` names them: its namespace over plain names."""
    plain = {n: e for n, e in entries.items() if namespace_of(n) is None}
    view = {n: e for n, e in plain.items() if _visible(e.tenant, tenant)}
    if tenant is not None:
        for n, e in entries.items():
            if namespace_of(n) == tenant and e.tenant == tenant:
                view[plain_name(n)] = e
    return view


def visible_catalog(catalog: Catalog, tenant: str | None) -> Catalog:
    """The part of `catalog` a caller of `tenant` may list and use (None = public only), keyed
    by the names the caller uses."""
    adapters = _view(catalog.adapters, tenant)
    usable = {n for n, e in catalog.adapters.items() if _visible(e.tenant, tenant)}
    compositions = {
        n: e
        for n, e in _view(catalog.compositions, tenant).items()
        if all(_base(a) in usable for a in e.adapters)
    }
    return Catalog(adapters=adapters, compositions=compositions)


def store_keys(names: tuple[NameKey, ...], tenant: str | None) -> list[NameKey]:
    """The store names a caller of `tenant` may mean by `names`: its own namespaced name
    (which would shadow a public one), then the public name."""
    out: list[NameKey] = []
    for kind, name in names:
        if tenant is not None and namespace_of(name) is None:
            out.append((kind, namespaced(tenant, name)))
        out.append((kind, name))
    return out


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
