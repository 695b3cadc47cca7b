"""`molora models …`: prepare and locate base models."""

from __future__ import annotations

import argparse

from molora_runtime.model.model_paths import GGUF_MODELS, prepare_model, prepared_model_dir


def register(subparsers: argparse._SubParsersAction) -> None:
    models = subparsers.add_parser("models", help="prepare and list base models")
    sub = models.add_subparsers(dest="models_command", required=True)
    prep = sub.add_parser("prepare", help="dequantize a bundled model into the local cache")
    prep.add_argument("alias", nargs="?", default=None, help="model alias (default: all)")
    prep.add_argument("--force", action="store_true", help="rebuild even if present")
    prep.set_defaults(func=_prepare)
    lst = sub.add_parser("list", help="list known model aliases and where they are prepared")
    lst.set_defaults(func=_list)


def _prepare(args: argparse.Namespace) -> int:
    for alias in [args.alias] if args.alias else list(GGUF_MODELS):
        path = prepare_model(alias, force=args.force)
        print(f"{alias}: {path}")
    return 0


def _list(args: argparse.Namespace) -> int:
    for alias in GGUF_MODELS:
        folder = prepared_model_dir(alias)
        state = "prepared" if (folder / "config.json").is_file() else "not prepared"
        print(f"{alias}\t{state}\t{folder}")
    return 0
