"""`molora adapters …` and `molora compositions …`: push, list, show, pull, rm, copy, verify.

Exit codes (stable, for scripts): 0 ok, 1 other store error, 2 usage, 3 invalid input,
4 not found, 5 version exists, 6 checksum/integrity failure, 7 store unreachable,
8 access denied (credentials, permissions, bucket).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tqdm import tqdm

from adapter_store.backends.base import Progress
from adapter_store.config import load_settings, open_backend, resolve_store_url
from adapter_store.errors import InvalidInputError, NotFoundError, StoreError
from adapter_store.layout import AnyManifest
from adapter_store.names import Kind, check_name, parse_ref
from adapter_store.source import AdapterStoreSource
from adapter_store.validate import DEFAULT_MAX_BYTES, load_base_config
from adapter_store.versions import Registry

EPILOG = __doc__.split("\n\n", 1)[1] if __doc__ else ""


def register(subparsers: argparse._SubParsersAction) -> None:
    for kind, group in (("adapter", "adapters"), ("composition", "compositions")):
        parser = subparsers.add_parser(
            group, help=f"publish and fetch {group} in the store", epilog=EPILOG
        )
        commands = parser.add_subparsers(dest="store_command", required=True)
        _add_commands(commands, kind)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", help="s3://bucket/prefix or a directory; peft:<either> = a "
                   "read-only folder of PEFT adapters; TOP|LOWER = layers, writes to TOP "
                   "(default: $MOLORA_STORE, $MOLORA_HOME/store.json, ./deployments/default_store)")  # fmt: skip
    p.add_argument(
        "--endpoint-url", help="S3 endpoint (default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _add_commands(commands: argparse._SubParsersAction, kind: Kind) -> None:
    def add(
        name: str, fn: Callable[[argparse.Namespace, Kind], int], help_: str
    ) -> argparse.ArgumentParser:
        p = commands.add_parser(name, help=help_, epilog=EPILOG)
        _common(p)
        p.set_defaults(func=lambda args: _run(fn, args, kind))
        return p

    p = add("push", _push, f"validate and publish a {kind} folder as NAME@VERSION")
    p.add_argument("path", type=Path)
    p.add_argument("--name", required=True)
    p.add_argument("--version", required=True, dest="version_")
    p.add_argument("--description")
    p.add_argument("--tag", action="append", default=[], dest="tags")
    p.add_argument(
        "--tenant",
        help="publish private to this tenant: only its API keys see and use it (default: public)",
    )
    p.add_argument(
        "--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="size limit of the version"
    )
    if kind == "adapter":
        p.add_argument("--base-model", help="base model id (default: from adapter_config.json)")
        p.add_argument(
            "--base-config", type=Path, help="base model config.json or folder: check shapes"
        )

    p = add("list", _list, f"list {kind}s (or the versions of one)")
    p.add_argument("name", nargs="?")

    p = add("show", _show, "print one version's manifest")
    p.add_argument("ref", metavar="NAME[@VERSION]")

    p = add("pull", _pull, "download and verify into the local cache; prints the folder")
    p.add_argument("ref", metavar="NAME[@VERSION]")
    p.add_argument("--cache-dir", help="default: $MOLORA_HOME/store-cache")
    p.add_argument("--cache-bytes", type=int, help="cache byte budget (LRU eviction)")

    p = add("rm", _rm, "delete (or --yank) a version")
    p.add_argument("ref", metavar="NAME@VERSION|NAME")
    p.add_argument("--all", action="store_true", help="delete every version of NAME")
    p.add_argument("--yank", action="store_true", help="keep the files but exclude from latest")
    p.add_argument("--unyank", action="store_true", help="undo --yank")
    p.add_argument("--reason", help="why it was yanked")
    p.add_argument("--force", action="store_true", help="delete even if compositions pin it")

    p = add("copy", _copy, f"copy {kind}s as they are to another store, verified")
    p.add_argument(
        "ref", nargs="?", metavar="NAME[@VERSION]", help="default with --all: every live version"
    )
    p.add_argument("--to", required=True, help="the destination store (s3://... or a directory)")
    p.add_argument("--to-endpoint-url", help="S3 endpoint of the destination")
    p.add_argument("--all", action="store_true", help="every live version of every name")

    p = add("verify", _verify, "re-download and check the sha256 of every file")
    p.add_argument(
        "ref", nargs="?", metavar="NAME[@VERSION]", help="default: every version of every name"
    )


# ---- plumbing ----------------------------------------------------------------------------------


def _run(
    fn: Callable[[argparse.Namespace, Kind], int], args: argparse.Namespace, kind: Kind
) -> int:
    try:
        return fn(args, kind)
    except StoreError as exc:
        _fail(args, exc, exc.exit_code)
        return exc.exit_code


def _fail(args: argparse.Namespace, exc: Exception, code: int) -> None:
    if getattr(args, "json", False):
        print(
            json.dumps(
                {"ok": False, "error": type(exc).__name__, "message": str(exc), "exit_code": code}
            )
        )
    print(f"error: {exc}", file=sys.stderr)


def _registry(args: argparse.Namespace, *, create: bool = False, **kwargs: Any) -> Registry:
    settings = load_settings()
    url = resolve_store_url(args.store, settings)
    return Registry(
        open_backend(url, args.endpoint_url or settings.endpoint_url, create=create), **kwargs
    )


@contextmanager
def _progress(args: argparse.Namespace, label: str, total: int) -> Iterator[Progress | None]:
    if args.json or args.no_progress or not sys.stderr.isatty():
        yield None
        return

    with tqdm(
        total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr
    ) as bar:
        yield bar.update


def _emit(args: argparse.Namespace, payload: Any, text: str) -> None:
    print(json.dumps(payload, indent=2, default=str) if args.json else text)


def _summary(m: AnyManifest) -> str:
    size = f"{m.total_size / 1024 / 1024:.2f} MiB"
    extra = (
        f"r={m.rank} targets={','.join(m.target_modules)}"
        if m.kind == "adapter"
        else f"adapters={','.join(m.adapters)} top_k={m.top_k}"
    )  # type: ignore[union-attr]
    owner = f"  tenant={m.tenant}" if m.tenant else ""
    return f"{m.ref}  base={m.base_model}  {extra}  {size}  created={m.created:%Y-%m-%d %H:%M:%S}{owner}"


def _folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file()) if path.is_dir() else 0


# ---- commands ----------------------------------------------------------------------------------


def _push(args: argparse.Namespace, kind: Kind) -> int:
    registry = _registry(args, create=True, max_bytes=args.max_bytes)
    with _progress(args, f"push {args.name}@{args.version_}", _folder_size(args.path)) as progress:
        if kind == "adapter":
            base_config = load_base_config(args.base_config) if args.base_config else None
            manifest = registry.publish_adapter(
                args.path, args.name, args.version_, base_model=args.base_model, base_config=base_config,
                description=args.description, tags=args.tags, tenant=args.tenant,
                progress=progress,
            )  # fmt: skip
        else:
            manifest = registry.publish_composition(
                args.path, args.name, args.version_, description=args.description, tags=args.tags,
                tenant=args.tenant, progress=progress,
            )  # fmt: skip
    _emit(
        args,
        {"ok": True, "manifest": manifest.model_dump(mode="json")},
        f"published {_summary(manifest)}",
    )
    return 0


def _list(args: argparse.Namespace, kind: Kind) -> int:
    registry = _registry(args)
    if args.name:
        check_name(args.name)
        rows = []
        for info in registry.versions(kind, args.name):
            m = registry.manifest(kind, args.name, info.version)
            rows.append(
                {
                    "version": info.version,
                    "yanked": info.yanked,
                    "created": m.created,
                    "size": m.total_size,
                }
            )
        if not rows:
            raise NotFoundError(f"{kind} {args.name!r} does not exist in store {registry.url}")
        rows.sort(key=lambda r: r["created"])
        text = "\n".join(
            f"{r['version']:<20} {r['created']:%Y-%m-%d %H:%M:%S}  {r['size']:>12} B{'  (yanked)' if r['yanked'] else ''}"
            for r in rows
        )
        _emit(args, {"ok": True, "name": args.name, "versions": rows}, text)
        return 0
    latest = registry.catalog(kind)
    payload = {"ok": True, kind + "s": [m.model_dump(mode="json") for m in latest]}
    _emit(
        args, payload, "\n".join(_summary(m) for m in latest) or f"(no {kind}s in {registry.url})"
    )
    return 0


def _show(args: argparse.Namespace, kind: Kind) -> int:
    registry = _registry(args)
    manifest = registry.resolve(kind, args.ref)
    _emit(
        args,
        {"ok": True, "manifest": manifest.model_dump(mode="json")},
        manifest.model_dump_json(indent=2),
    )
    return 0


def _pull(args: argparse.Namespace, kind: Kind) -> int:
    source = AdapterStoreSource(
        registry=_registry(args),
        cache_dir=args.cache_dir,
        cache_bytes=args.cache_bytes,
        direct_local=False,
    )
    manifest = source.manifest(kind, args.ref)
    with _progress(args, f"pull {manifest.ref}", manifest.total_size) as progress:
        path = source.materialize(manifest, progress)
    _emit(args, {"ok": True, "ref": manifest.ref, "path": str(path)}, str(path))
    return 0


def _rm(args: argparse.Namespace, kind: Kind) -> int:
    registry = _registry(args)
    r = parse_ref(args.ref)
    if r.version is None and not args.all:
        raise InvalidInputError(
            f"{args.ref!r} names no version: use NAME@VERSION, or --all for every version"
        )
    if r.version is not None and args.all:
        raise InvalidInputError("--all takes a bare NAME, not NAME@VERSION")
    versions = [r.version] if r.version else [v.version for v in registry.versions(kind, r.name)]
    if not versions:
        raise NotFoundError(f"{kind} {r.name!r} does not exist in store {registry.url}")
    done = []
    for version in versions:
        if args.yank:
            m = registry.yank(kind, r.name, version, args.reason)
        elif args.unyank:
            m = registry.unyank(kind, r.name, version)
        else:
            m = registry.delete(kind, r.name, version, force=args.force)
        done.append(m.ref)
    action = "yanked" if args.yank else "unyanked" if args.unyank else "deleted"
    _emit(args, {"ok": True, action: done}, "\n".join(f"{action} {ref}" for ref in done))
    return 0


def _copy(args: argparse.Namespace, kind: Kind) -> int:
    if bool(args.ref) == bool(args.all):
        raise InvalidInputError("copy takes NAME[@VERSION] or --all (not both)")
    src = _registry(args)
    dst = Registry(open_backend(args.to, args.to_endpoint_url, create=True))
    if args.ref:
        refs = [args.ref]
    else:
        refs = [
            f"{n}@{v.version}"
            for n in src.names(kind)
            for v in src.versions(kind, n)
            if not v.yanked
        ]
    results = []
    for ref in refs:
        with _progress(args, f"copy {ref}", src.resolve(kind, ref).total_size) as progress:
            m, copied = dst.copy_from(src, kind, ref, progress)
        results.append({"ref": m.ref, "copied": copied})
    text = "\n".join(f"{'copied' if r['copied'] else 'present'} {r['ref']}" for r in results)
    _emit(args, {"ok": True, "results": results}, text or f"(no {kind}s to copy)")
    return 0


def _verify(args: argparse.Namespace, kind: Kind) -> int:
    registry = _registry(args)
    if args.ref:
        r = parse_ref(args.ref)
        manifests = [registry.resolve(kind, args.ref)] if r.version else [
            registry.manifest(kind, r.name, v.version) for v in registry.versions(kind, r.name)
        ]  # fmt: skip
        if not manifests:
            raise NotFoundError(f"{kind} {r.name!r} does not exist in store {registry.url}")
    else:
        manifests = [
            registry.manifest(kind, n, v.version)
            for n in registry.names(kind)
            for v in registry.versions(kind, n)
        ]
    results = []
    for m in manifests:
        with _progress(args, f"verify {m.ref}", m.total_size) as progress:
            problems = registry.verify(m, progress)
        results.append({"ref": m.ref, "ok": not problems, "problems": problems})
    bad = [r for r in results if not r["ok"]]
    text = "\n".join(
        f"{'ok ' if r['ok'] else 'BAD'} {r['ref']}" + "".join(f"\n    {p}" for p in r["problems"])
        for r in results
    )
    _emit(args, {"ok": not bad, "results": results}, text or f"(no {kind}s to verify)")
    return 6 if bad else 0
