"""Model names → routes: what `/v1/models` lists and how a request's `model` is understood.

The ingress keeps a `Catalog` (adapters and compositions of the store, cached for a few
seconds) and resolves `model` against it: the base model, a named route, Ray Serve LLM's
`<base>:<adapter>`, a static mix `a:0.7+b:0.3`, a composition, or an adapter (`name` /
`name@version`). Unknown names are
`ModelNotFound` (→ 404); malformed ones `BadModelName` (→ 400).

Every adapter and composition ref of a resolved route is *pinned* to one live version
(`name` → `name@latest`) at admission, so replicas key hot-set slots, host and disk caches and
the prefix cache by an exact version: a name that moves to new weights is a new key, never a
stale slot. A yanked version is not in the catalog, so it is not found, even when named.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from pydantic import ValidationError

from adapter_store.names import plain_name
from deployments.config import ServeConfig
from molora_runtime.routes import (
    BaseRoute,
    LearnedRoute,
    RouteSpec,
    SingleRoute,
    check_ref,
    parse_mix,
)

logger = logging.getLogger("ray.serve")


NameKey = tuple[str, str]  # ("adapter" | "composition", store name)


class ModelNotFound(LookupError):
    """`model` (or a ref inside a route) names nothing the server exposes. `names`: the
    catalog names, as the caller wrote them, whose appearance in the store could change that
    (none for a malformed or hidden name)."""

    def __init__(self, message: str, names: tuple[NameKey, ...] = ()) -> None:
        super().__init__(message)
        self.names = names


class BadModelName(ValueError):
    """`model` or an explicit route is malformed."""


@dataclass(frozen=True)
class AdapterEntry:
    name: str
    versions: tuple[str, ...] = ()
    latest: str | None = None
    base_model: str | None = None
    tenant: str | None = None  # owner; None = public (see deployments/access/tenancy.py)
    rank: int | None = None  # the latest version's `r`, for placement by rank pool


@dataclass(frozen=True)
class CompositionEntry:
    name: str
    adapters: tuple[str, ...]
    versions: tuple[str, ...] = ()
    latest: str | None = None
    base_model: str | None = None
    top_k: int | None = None
    tenant: str | None = None


@dataclass(frozen=True)
class Catalog:
    adapters: dict[str, AdapterEntry] = field(default_factory=dict)
    compositions: dict[str, CompositionEntry] = field(default_factory=dict)


Route = RouteSpec  # every route kind: a new kind needs nothing here


@dataclass(frozen=True)
class Resolved:
    """A request's route (refs pinned to versions) plus the adapter set placement should
    co-locate."""

    route: Route
    placement_adapters: tuple[str, ...]

    @property
    def versions(self) -> list[str]:
        """The exact `name@version` refs that serve this request (composition first), as the
        caller names them: its own namespace (`tenant~`) is not shown."""
        route = self.route
        comp = route.gate_composition
        head = [] if comp is None else [f"composition:{comp}"]
        return [_as_caller(ref) for ref in head + list(dict.fromkeys(route.adapters()))]

    @property
    def kind(self) -> str:
        return self.route.kind


def _as_caller(ref: str) -> str:
    """`ref` (maybe `composition:`-prefixed) without its tenant namespace."""
    kind, colon, rest = ref.rpartition(":")
    return f"{kind}{colon}{plain_name(rest)}"


def _split(ref: str) -> tuple[str, str | None]:
    name, _, version = ref.partition("@")
    return name, version or None


def _either(ref: str) -> tuple[NameKey, ...]:
    """The names a plain `name[@version]` may mean, when it is a well-formed one."""
    try:
        check_ref(ref)
    except ValueError:
        return ()
    name = _split(ref)[0]
    return (("adapter", name), ("composition", name))


class Resolver:
    """Resolves names against a catalog filtered by the `expose` settings."""

    def __init__(self, config: ServeConfig, catalog: Catalog) -> None:
        self.config = config
        expose = config.expose
        self.adapters = {
            n: e
            for n, e in catalog.adapters.items()
            if expose.adapters == "all" or n in expose.adapters
        }
        self.compositions = {
            n: e
            for n, e in catalog.compositions.items()
            if expose.compositions == "all" or n in expose.compositions
        }
        self.base_name = config.base_model_name()

    # -- lookups ----------------------------------------------------------------------------

    @staticmethod
    def _pin(kind: str, ref: str, entry: AdapterEntry | CompositionEntry) -> str:
        """`ref` as `name@version` of a live version: the latest when none is named."""
        _, version = _split(ref)
        version = version or entry.latest
        if version is None or version not in entry.versions:
            raise ModelNotFound(
                f"{kind} {ref!r} has no version {version!r} (yanked or never published); "
                f"live: {list(entry.versions)}",
                ((kind, _split(ref)[0]),),
            )
        return f"{entry.name}@{version}"  # the store name: a tenant's own names are namespaced

    def adapter(self, ref: str) -> str:
        """`ref` pinned to the live version it means."""
        try:
            check_ref(ref)
        except ValueError as exc:
            raise BadModelName(str(exc)) from None
        name, _ = _split(ref)
        entry = self.adapters.get(name)
        if entry is None:
            raise ModelNotFound(f"adapter {name!r} does not exist", (("adapter", name),))
        return self._pin("adapter", ref, entry)

    def composition(self, ref: str) -> tuple[CompositionEntry, str]:
        """The composition's entry and `ref` pinned to the live version it means."""
        name, _ = _split(ref)
        entry = self.compositions.get(name)
        if entry is None:
            raise ModelNotFound(f"composition {name!r} does not exist", (("composition", name),))
        return entry, self._pin("composition", ref, entry)

    # -- resolution -------------------------------------------------------------------------

    def check_route(self, route: Route) -> Resolved:
        """Validate every ref of a route, pin it to a version, and derive its placement set."""
        comp = route.gate_composition
        if comp is not None:  # pin the composition; placement adds its catalog experts
            entry, pinned = self.composition(comp)
            experts = tuple(_split(a)[0] for a in entry.adapters)
            return Resolved(
                route.with_refs({comp: pinned}), (*experts, f"composition:{entry.name}")
            )
        route = pin_adapters(route, self.adapter)
        return Resolved(route, tuple(_split(a)[0] for a in route.adapters()))

    def resolve(self, model: str, explicit: Route | None = None) -> Resolved:
        if explicit is not None:
            self.known(model)
            return self.check_route(explicit)
        if self.config.expose.base and model == self.base_name:
            return Resolved(BaseRoute(), ())
        if model in self.config.expose.routes:
            try:
                return self.check_route(self.config.expose.routes[model])
            except ModelNotFound as exc:  # a route over hidden names is hidden
                raise self._not_found(model, exc.names) from None
        prefixed = self._base_prefixed(model)
        if prefixed is not None:
            return prefixed
        if ":" in model:
            if not self.config.expose.mixes:
                raise BadModelName("static mixes are disabled on this server")
            try:
                mix = parse_mix(model)
            except (ValueError, ValidationError) as exc:
                raise BadModelName(f"invalid mix {model!r}: {_first_error(exc)}") from None
            return self.check_route(mix)
        name, _ = _split(model)
        if name in self.compositions:
            return self.check_route(LearnedRoute(composition=model))
        if name in self.adapters:
            self.adapter(model)  # a malformed or dead version is refused before the route is built
            return self.check_route(SingleRoute(adapter=model))
        raise self._not_found(model, _either(model))

    def _base_prefixed(self, model: str) -> Resolved | None:
        """Ray Serve LLM's `<base>:<adapter>` id; None when `model` is not one (a colon
        followed by a number is a mix weight, so `<base>:0.5` stays a mix)."""
        head = f"{self.base_name}:"
        if not model.startswith(head):
            return None
        rest = model[len(head) :]
        if not rest or any(c in rest for c in ":+,"):
            raise BadModelName(
                f"model {model!r} is ambiguous: '{head}' takes one adapter or composition "
                f"('{head}NAME[@VERSION]'); write a mix without it ('a:0.7+b:0.3')"
            )
        if _is_number(rest):
            if rest in self.adapters or rest in self.compositions:
                raise BadModelName(
                    f"model {model!r} is ambiguous: adapter {rest!r} on the base model, or a "
                    f"mix weighting {self.base_name!r} by {rest}; name the adapter alone"
                )
            return None
        try:
            check_ref(rest)
        except ValueError as exc:
            raise BadModelName(f"model {model!r}: {exc}") from None
        name, _ = _split(rest)
        if name in self.compositions:
            return self.check_route(LearnedRoute(composition=rest))
        if name in self.adapters:
            return self.check_route(SingleRoute(adapter=self.adapter(rest)))
        raise self._not_found(model, _either(rest))

    @staticmethod
    def _not_found(model: str, names: tuple[NameKey, ...] = ()) -> ModelNotFound:
        return ModelNotFound(
            f"model {model!r} does not exist; see GET /v1/models for the base model, adapters, "
            "compositions and routes, or write a mix as 'a:0.7+b:0.3'",
            names,
        )

    def known(self, model: str) -> None:
        """With an explicit route, `model` only labels the request but must still be valid."""
        if model == self.base_name or model in self.config.expose.routes:
            return
        name, _ = _split(model)
        if ":" in model or name in self.adapters or name in self.compositions:
            return
        raise ModelNotFound(f"model {model!r} does not exist", _either(model))


def pin_adapters(route: Route, pin: Callable[[str], str]) -> Route:
    """A copy of `route` with every adapter ref replaced by `pin(ref)`."""
    pinned = {ref: pin(ref) for ref in route.adapters()}
    try:
        return route.with_refs(pinned)
    except ValueError as exc:  # two refs pinned to one version (a mix would merge their weights)
        raise BadModelName(str(exc)) from None


def _is_number(text: str) -> bool:
    """Whether a mix would read `text` as a weight (the same test as `parse_mix`)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def _first_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return exc.errors()[0]["msg"]
    return str(exc)


STRETCH_FLOOR_S = 0.1  # a catalog load cheaper than this keeps the refresh period as set


class CatalogCache:
    """The router's catalog, reloaded in the background every `ttl_s` (or less often, so that
    reloading takes at most `max_share` of a core): a request reads the last good catalog and
    never waits on the store, whatever the store holds (only the first load and `refresh`
    wait). A failed reload keeps serving the last good catalog.

    A change names what it touched (deployments/catalog/epoch.py), so `apply` installs single
    names re-read on their own beside the full reloads. Each installed name remembers when the
    read that produced it began, and a read never replaces one that began later: a full reload
    that started before a change's re-read (and may have listed the name before the write)
    cannot bring the old state back when it finishes after it."""

    def __init__(
        self,
        load: Callable[[], Awaitable[Catalog]],
        ttl_s: float,
        max_share: float = 1.0,
        load_cpu_s: Callable[[], float] | None = None,
    ) -> None:
        self._load = load
        self._ttl = ttl_s
        self._max_share = max_share
        self._load_cpu_s = load_cpu_s  # the CPU seconds of the last load (else its wall time)
        self._catalog: Catalog | None = None
        self._lock = asyncio.Lock()
        self._reloader: asyncio.Task[None] | None = None
        self.load_s = 0.0  # how long the last load took
        self._base_at = float("-inf")  # when the installed full load began reading
        self._read_at: dict[NameKey, float] = {}  # names read alone since then, and when

    async def get(self) -> Catalog:
        if self._reloader is None:
            self._reloader = asyncio.get_running_loop().create_task(self._reload_forever())
        if self._catalog is not None:
            return self._catalog
        async with self._lock:
            if self._catalog is not None:
                return self._catalog
            try:
                await self._timed_load()
            except Exception:
                if self._catalog is None:
                    raise
            assert self._catalog is not None
            return self._catalog

    def reload_period(self) -> float:
        """Seconds between background reloads: `ttl_s`, or longer where the last load's CPU
        time was more than `max_share` of that (a store of 10,000 folders lists in under a
        CPU second). A load under STRETCH_FLOOR_S never stretches it, and waiting on a slow
        store costs no CPU."""
        cost = self.load_s if self._load_cpu_s is None else self._load_cpu_s()
        return self._ttl if cost < STRETCH_FLOOR_S else max(self._ttl, cost / self._max_share)

    async def _reload_forever(self) -> None:
        while True:
            await asyncio.sleep(self._ttl)
            if time.monotonic() - self._base_at < self.reload_period():
                continue  # a costly listing waits longer, judged by its latest price
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.warning(
                    "catalog reload failed; serving the last good catalog", exc_info=True
                )

    async def refresh(self) -> Catalog:
        """Reload now and raise if the store cannot be read (a change must not be acknowledged
        on a stale catalog)."""
        async with self._lock:
            return await self._timed_load()

    async def _timed_load(self) -> Catalog:
        start = time.monotonic()
        try:
            loaded = await self._load()
        finally:
            self.load_s = time.monotonic() - start
        return self._install_full(start, loaded)

    def _install_full(self, started: float, loaded: Catalog) -> Catalog:
        """`loaded` (a full read begun at `started`), except names read alone after that."""
        if self._catalog is not None and started <= self._base_at:
            return self._catalog  # a newer full load is installed already
        newer = {k: t for k, t in self._read_at.items() if t > started}
        if newer and self._catalog is not None:
            adapters, compositions = dict(loaded.adapters), dict(loaded.compositions)
            for kind, name in newer:
                _move(self._catalog, adapters, compositions, kind, name)
            loaded = Catalog(adapters=adapters, compositions=compositions)
        self._catalog, self._base_at, self._read_at = loaded, started, newer
        return loaded

    async def apply(
        self, started: float, entries: Mapping[NameKey, AdapterEntry | CompositionEntry | None]
    ) -> Catalog:
        """Install names re-read on their own (None: the name has no live version any more);
        `started` is when that read began. Before the first full load, that load runs first."""
        if self._catalog is None:
            await self.get()
        assert self._catalog is not None
        adapters = dict(self._catalog.adapters)
        compositions = dict(self._catalog.compositions)
        for key, entry in entries.items():
            if started <= self._read_at.get(key, self._base_at):
                continue  # what is installed was read later
            table: dict = adapters if key[0] == "adapter" else compositions
            if entry is None:
                table.pop(key[1], None)
            else:
                table[key[1]] = entry
            self._read_at[key] = started
        # A new object: per-catalog caches (the callers' resolvers) are rebuilt for it.
        self._catalog = Catalog(adapters=adapters, compositions=compositions)
        return self._catalog

    def close(self) -> None:
        if self._reloader is not None:
            self._reloader.cancel()


def _move(src: Catalog, adapters: dict, compositions: dict, kind: str, name: str) -> None:
    """Make `name` of `kind` in the tables what it is in `src` (present or absent)."""
    table, have = (
        (adapters, src.adapters) if kind == "adapter" else (compositions, src.compositions)
    )
    if name in have:
        table[name] = have[name]
    else:
        table.pop(name, None)
