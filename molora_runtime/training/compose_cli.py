"""`molora compose add`: argument parsing and exit codes only (the work is in `compose_add`).

Exit codes follow `molora adapters/compositions`: 0 ok, 3 invalid input (duplicate expert,
base or rank mismatch, unknown domain), 4 not found, 5 version exists, 7 store unreachable.
"""

from __future__ import annotations

import argparse
import json
import sys

from pydantic import ValidationError

from adapter_store.config import load_settings, open_backend, resolve_store_url
from adapter_store.errors import StoreError
from adapter_store.versions import Registry
from molora_runtime.training.cli import command_line, config_from_args

INVALID_INPUT = 3


def register(subparsers: argparse._SubParsersAction) -> None:
    compose = subparsers.add_parser("compose", help="change a composition's experts")
    sub = compose.add_subparsers(dest="compose_command", required=True)
    add = sub.add_parser(
        "add",
        help="publish the composition's next version with one more expert (new gate rows only)",
        epilog=__doc__.split("\n\n", 1)[1] if __doc__ else "",
    )
    add.add_argument("--composition", required=True, metavar="NAME[@VERSION]")
    add.add_argument("--adapter", required=True, metavar="NAME[@VERSION]", help="in the store")
    add.add_argument("--data", help="training domain of the new expert (default: its name)")
    add.add_argument("--version", dest="version_", help="version to publish (default: next vN)")
    add.add_argument("--top-k", type=int, help="serving top-k (default: the composition's)")
    add.add_argument("--description")
    add.add_argument("--steps", type=int, default=40)
    add.add_argument("--batch-size", type=int, default=8)
    add.add_argument("--lr", type=float, default=2e-2)
    add.add_argument("--new-fraction", type=float, default=0.5, help="share with the new domain")
    add.add_argument("--stay-out", type=float, default=2.0, help="weight of the stay-out hinge")
    add.add_argument("--seed", type=int, default=0)
    add.add_argument("--device", default="auto", help="auto, cpu or cuda")
    add.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add.add_argument("--store", help="store URL or directory (default as `molora compositions`)")
    add.add_argument("--endpoint-url", help="S3 endpoint")
    add.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    add.set_defaults(func=_add)


def _add(args: argparse.Namespace) -> int:
    # Imported when a command trains: transformers and the training modules stay off the
    # start-up of every other `molora` command.
    from molora_runtime.training.compose_add import ComposeAddConfig, GrowSettings, compose_add

    try:
        grow = config_from_args(GrowSettings, args)
        cfg = config_from_args(ComposeAddConfig, args, version=args.version_, grow=grow)
        settings = load_settings()
        url = resolve_store_url(args.store, settings)
        registry = Registry(open_backend(url, args.endpoint_url or settings.endpoint_url))
        manifest, cpu_s = compose_add(registry, cfg, command_line())
    except StoreError as exc:
        return _fail(args, exc, exc.exit_code)
    except ValidationError as exc:
        return _fail(args, exc, INVALID_INPUT)
    payload = {"ok": True, "manifest": manifest.model_dump(mode="json"), "cpu_s": round(cpu_s, 1)}
    text = (
        f"published composition {manifest.ref} ({', '.join(manifest.adapters)}; "
        f"top_k={manifest.top_k}) after {cpu_s / 60:.1f} CPU-minutes of gate training"
    )
    print(json.dumps(payload, indent=2) if args.json else text)
    return 0


def _fail(args: argparse.Namespace, exc: Exception, code: int) -> int:
    if args.json:
        body = {"ok": False, "error": type(exc).__name__, "message": str(exc), "exit_code": code}
        print(json.dumps(body))
    print(f"error: {exc}", file=sys.stderr)
    return code
