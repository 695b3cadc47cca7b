"""Route identity: the prefix-cache key material saying which weights produced a KV block.

A prefix's KV depends on everything that changes a layer's output on those tokens: the base
model, every adapter the route touches (by its exact weights, not its name — two versions of one
name, or one version re-pushed with other bytes, must never share a block), the mix weights, the
vocab table, and for learned routes the composition's gates, top-k and temperature. These are
gathered as explicit typed values (`RouteKeyParts`, built from a route and per-ref metadata at
admission) and hashed canonically (`route_identity`); full KV blocks are then keyed by a hash
chain over (parent block, identity, token ids) (`chain_block_hash`).

Weights digests come from the store's manifest when there is one (sha256 over its file list,
which covers adapter_config.json's alpha as well as the safetensors bytes), otherwise from the
loaded tensors (`adapter_weights_sha256`, computed once per load and cached by
`RouteIdentityCache`). Two sources of one adapter may give different digests: that only costs a
cache miss, never a wrong hit.

Order: a mix's terms are hashed in the request's order (slot order decides the fp32 summation
order, so a reordered mix is not bit-identical); vocab ranges are hashed sorted by start (each
token picks exactly one range, so their listed order changes nothing); a composition's experts
are hashed in gate order.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from adapter_store.manifest import AdapterManifest, CompositionManifest
from adapter_store.names import parse_ref
from molora_runtime.lora.composition import Composition
from molora_runtime.lora.peft_adapter import AdapterWeights
from molora_runtime.routes import (
    BaseRoute,
    LearnedRoute,
    MixRoute,
    RouteSpec,
    SingleRoute,
    VocabRoute,
)

ROUTE_DOMAIN = b"molora-route-identity-v1\x00"
BLOCK_DOMAIN = b"molora-kv-block-v1\x00"
NO_PARENT = b"\x00" * 32


@dataclass(frozen=True)
class AdapterKey:
    """One adapter as the KV sees it: resolved name@version and the digest of its weights."""

    name: str
    version: str | None
    weights_sha256: str


@dataclass(frozen=True)
class CompositionKey:
    """A learned composition: its version, gates digest, experts in gate order and defaults."""

    name: str
    version: str | None
    gates_sha256: str
    experts: tuple[AdapterKey, ...]
    top_k: int
    temperature: float


@dataclass(frozen=True)
class MixTerm:
    adapter: AdapterKey
    weight: float


@dataclass(frozen=True)
class VocabEntry:
    start: int
    end: int
    adapter: AdapterKey | None  # None = base model for this range


@dataclass(frozen=True)
class LearnedKey:
    """A learned route with the request's overrides applied (effective top-k / temperature)."""

    composition: CompositionKey
    top_k: int
    temperature: float


@dataclass(frozen=True)
class RouteKeyParts:
    """Everything a route's KV depends on, as plain typed values (one of the route fields set).

    `single` and `mix` both become `mix` terms (a single adapter is a mix of one with weight
    1.0: same computation, same key).
    """

    base_model: str
    kind: str
    mix: tuple[MixTerm, ...] = ()
    vocab: tuple[VocabEntry, ...] = ()
    vocab_default: AdapterKey | None = None
    learned: LearnedKey | None = None

    def canonical(self) -> bytes:
        """Deterministic bytes of every field (sorted-key JSON; floats by their exact repr)."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()


AdapterLookup = Callable[[str], AdapterKey]
CompositionLookup = Callable[[str], CompositionKey]


def route_key_parts(
    route: RouteSpec,
    base_model: str,
    adapter: AdapterLookup,
    composition: CompositionLookup | None = None,
) -> RouteKeyParts:
    """Build the key parts of `route` from per-ref lookups (the engine's loaded metadata)."""
    if isinstance(route, BaseRoute):
        return RouteKeyParts(base_model=base_model, kind="base")
    if isinstance(route, SingleRoute):
        return RouteKeyParts(base_model, "mix", mix=(MixTerm(adapter(route.adapter), 1.0),))
    if isinstance(route, MixRoute):
        terms = tuple(MixTerm(adapter(n), float(w)) for n, w in route.weights.items())
        return RouteKeyParts(base_model, "mix", mix=terms)
    if isinstance(route, VocabRoute):
        entries = tuple(
            VocabEntry(r.start, r.end, adapter(r.adapter) if r.adapter else None)
            for r in sorted(route.ranges, key=lambda r: r.start)
        )
        default = adapter(route.default) if route.default else None
        return RouteKeyParts(base_model, "vocab", vocab=entries, vocab_default=default)
    if isinstance(route, LearnedRoute):
        if composition is None:
            raise ValueError("a learned route needs a composition lookup")
        comp = composition(route.composition)
        learned = LearnedKey(
            comp, route.top_k or comp.top_k, float(route.temperature or comp.temperature)
        )
        return RouteKeyParts(base_model, "learned", learned=learned)
    raise TypeError(f"unknown route type {type(route).__name__}")


def route_identity(parts: RouteKeyParts) -> bytes:
    """sha256 digest (32 bytes) of the key parts; equal parts give equal identities."""
    return hashlib.sha256(ROUTE_DOMAIN + parts.canonical()).digest()


def base_route_identity(base_model: str) -> bytes:
    """The one identity every base-route request of this base model shares."""
    return route_identity(RouteKeyParts(base_model=base_model, kind="base"))


def chain_block_hash(parent: bytes | None, identity: bytes, token_ids: Sequence[int]) -> bytes:
    """Hash of one full KV block: its parent block's hash (None for the first), the route
    identity and the block's token ids — a prefix hit needs every earlier block to match."""
    h = hashlib.sha256(BLOCK_DOMAIN)
    h.update(NO_PARENT if parent is None else b"\x01" + parent)
    h.update(struct.pack("<I", len(identity)) + identity)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    return h.digest()


# ---- weights digests --------------------------------------------------------------------------


def tensors_sha256(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, dtype, shape, raw bytes) of each tensor, in the given order."""
    h = hashlib.sha256()
    for name, t in named:
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def adapter_weights_sha256(weights: AdapterWeights) -> str:
    """Digest of the loaded tensors (A and scale-folded B per module and layer, sorted)."""

    def items() -> Iterable[tuple[str, torch.Tensor]]:
        for module in sorted(weights.modules):
            for layer in sorted(weights.modules[module]):
                a, b = weights.modules[module][layer]
                yield f"{module}.{layer}.A", a
                yield f"{module}.{layer}.B", b

    return tensors_sha256(items())


def composition_gates_sha256(comp: Composition) -> str:
    """Digest of the loaded gate tensors."""
    named = [("gate.weight", comp.gate_weight)]
    if comp.gate_bias is not None:
        named.append(("gate.bias", comp.gate_bias))
    return tensors_sha256(named)


def manifest_files_sha256(manifest: AdapterManifest | CompositionManifest) -> str:
    """Digest of a stored version's file list (path, sha256, size): weights *and* config."""
    listing = sorted((f.path, f.sha256, f.size) for f in manifest.files)
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()


def adapter_key_from_manifest(manifest: AdapterManifest) -> AdapterKey:
    return AdapterKey(manifest.name, manifest.version, manifest_files_sha256(manifest))


def adapter_key_from_weights(ref: str, weights: AdapterWeights) -> AdapterKey:
    r = parse_ref(ref)
    return AdapterKey(r.name, r.version, adapter_weights_sha256(weights))


class RouteIdentityCache:
    """Per-engine memo of adapter / composition keys and route identities.

    Call `note_adapter` / `note_composition` whenever the hot-set (re)loads a ref (a bare name
    may resolve to a new latest version between loads); `identity(route)` then needs no I/O.
    """

    def __init__(self, base_model: str) -> None:
        self.base_model = base_model
        self._adapters: dict[str, AdapterKey] = {}
        self._compositions: dict[str, CompositionKey] = {}

    def note_adapter(
        self,
        ref: str,
        weights: AdapterWeights | None = None,
        manifest: AdapterManifest | None = None,
    ) -> AdapterKey:
        """Record `ref`'s key: from the manifest if given, else by hashing `weights` once."""
        if manifest is not None:
            key = adapter_key_from_manifest(manifest)
        elif weights is not None:
            key = adapter_key_from_weights(ref, weights)
        else:
            raise ValueError(f"adapter {ref!r}: need its manifest or its loaded weights")
        self._adapters[ref] = key
        return key

    def note_composition(
        self,
        ref: str,
        comp: Composition,
        expert_keys: Mapping[str, AdapterKey] | None = None,
        manifest: CompositionManifest | None = None,
    ) -> CompositionKey:
        """Record a composition's key; its experts' keys must be noted already (or passed)."""
        experts = tuple((expert_keys or {}).get(e) or self.adapter(e) for e in comp.config.adapters)
        r = parse_ref(ref)
        gates = manifest_files_sha256(manifest) if manifest else composition_gates_sha256(comp)
        key = CompositionKey(
            name=manifest.name if manifest else r.name,
            version=manifest.version if manifest else r.version,
            gates_sha256=gates,
            experts=experts,
            top_k=comp.config.top_k,
            temperature=float(comp.config.temperature),
        )
        self._compositions[ref] = key
        return key

    def forget(self, ref: str) -> None:
        self._adapters.pop(ref, None)
        self._compositions.pop(ref, None)

    def adapter(self, ref: str) -> AdapterKey:
        try:
            return self._adapters[ref]
        except KeyError:
            raise KeyError(f"no weights digest recorded for adapter {ref!r}") from None

    def composition(self, ref: str) -> CompositionKey:
        try:
            return self._compositions[ref]
        except KeyError:
            raise KeyError(f"no key recorded for composition {ref!r}") from None

    def parts(self, route: RouteSpec) -> RouteKeyParts:
        return route_key_parts(route, self.base_model, self.adapter, self.composition)

    def identity(self, route: RouteSpec) -> bytes:
        return route_identity(self.parts(route))
