"""`molora train adapter`, `molora train router` and `molora train draft`: argument parsing only,
the work is elsewhere."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from molora_runtime.config import DEFAULT_MODEL
from molora_runtime.multimodal.digits import parse_mixture
from molora_runtime.training.record import write_card

M = TypeVar("M", bound=BaseModel)


Option = tuple[str, type | None, Any, str | None]  # flag, type (None: text), default, help

_COMMON: tuple[Option, ...] = (
    ("--model", None, DEFAULT_MODEL, "base model alias or HF folder"),
    ("--seed", int, 0, None),
    ("--device", None, "auto", "auto, cpu or cuda"),
    ("--threads", int, None, "torch CPU threads"),
    ("--checkpoint-every", int, 50, None),
)
_ADAPTER: tuple[Option, ...] = (
    ("--rank", int, 8, None),
    ("--alpha", float, 16.0, None),
    ("--target-modules", None, None, "comma list (default: all linears)"),
    ("--first-layer", int, 0, "adapt layers >= this one"),
    ("--steps", int, 150, None),
    (
        "--stop-at",
        int,
        None,
        "end (and save) after this step of the --steps schedule; resumes its checkpoint",
    ),
    ("--batch-size", int, 8, None),
    ("--lr", float, 2e-3, None),
    ("--init-from", None, None, "PEFT folder to continue from (same rank and layers)"),
    ("--mixture", None, None, "multimodal task shares, e.g. read=0.85,mixed=0.15"),
    (
        "--image-adapter",
        None,
        None,
        "frozen PEFT folder serving image-code positions (train as the vocab route serves)",
    ),
    (
        "--code-dropout",
        float,
        0.0,
        "multimodal: share of input image codes replaced by random ones (labels kept)",
    ),
    (
        "--text-adapter",
        None,
        None,
        "frozen PEFT folder serving text positions (train `draw` as the vocab route serves)",
    ),
    (
        "--routed-fraction",
        float,
        1.0,
        "share of steps trained routed with --image/--text-adapter (others alone)",
    ),
)
_ROUTER: tuple[Option, ...] = (
    ("--top-k", int, 2, None),
    ("--steps", int, 100, None),
    ("--batch-size", int, 8, None),
    ("--lr", float, 5e-3, None),
    ("--balance-weight", float, 0.01, None),
    ("--single-fraction", float, 0.5, "share of single-domain examples in the mixed training data"),
    (
        "--route-supervision",
        float,
        1.0,
        "weight of the gate-vs-known-domain loss (0 = train the gates by LM loss only)",
    ),
)
_DRAFT: tuple[Option, ...] = (
    ("--sequences", int, 256, "prompts the target answers (reasoning-gym, the training split)"),
    ("--max-tokens", int, 96, "tokens generated per prompt"),
    ("--window", int, 5, "positions per training window (the roll-out it learns)"),
    ("--steps", int, 300, None),
    ("--batch-size", int, 32, None),
    ("--lr", float, 1e-3, None),
    ("--domains", None, None, "comma list of reasoning-gym domains (default: the four core ones)"),
    ("--adapter", None, None, "NAME=PEFT_FOLDER: train on that adapter's outputs"),
    ("--init-from", None, None, "a draft head folder to tune further (e.g. per adapter)"),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser("train", help="train LoRA adapters and composition routers")
    sub = train.add_subparsers(dest="train_command", required=True)

    ad = sub.add_parser("adapter", help="LoRA-train one adapter on a domain (PEFT folder out)")
    ad.add_argument(
        "--domain", required=True, help="task domain (see molora_runtime.training.data)"
    )
    ad.add_argument("--output", required=True, help="PEFT folder to write (resumes if present)")
    ad.add_argument(
        "--loss-per-example",
        action="store_true",
        help="average the loss per example, then over the batch (default: over all tokens)",
    )
    _add_options(ad, _COMMON + _ADAPTER)
    ad.set_defaults(func=_adapter)

    ro = sub.add_parser("router", help="train only the per-layer gates of a composition")
    ro.add_argument(
        "--adapter",
        action="append",
        required=True,
        metavar="NAME=PEFT_FOLDER",
        help="an expert adapter (repeat; gate order = argument order)",
    )
    ro.add_argument("--output", required=True, help="composition folder to write")
    _add_options(ro, _COMMON + _ROUTER)
    ro.set_defaults(func=_router)

    dr = sub.add_parser(
        "draft",
        help="train a learned draft head (eagle) on the base model's or an adapter's outputs",
    )
    dr.add_argument("--output", required=True, help="folder of the head to write")
    common = tuple(o for o in _COMMON if o[0] not in ("--device", "--checkpoint-every"))
    _add_options(dr, common + _DRAFT)
    dr.set_defaults(func=_draft)


def _add_options(p: argparse.ArgumentParser, options: tuple[Option, ...]) -> None:
    for flag, kind, default, text in options:
        p.add_argument(flag, type=kind, default=default, help=text)


def command_line() -> str:
    """The command as typed, with the home directory shown as `~` (no machine paths recorded)."""
    home = str(Path.home())
    return ("molora " + shlex.join(sys.argv[1:])).replace(home, "~")


def config_from_args(
    cls: type[M], args: argparse.Namespace, skip: frozenset[str] = frozenset(), **values: Any
) -> M:
    """`cls` from the options named like its fields (less `skip`), plus the parsed `values`."""
    given = {n: getattr(args, n) for n in cls.model_fields if hasattr(args, n) and n not in skip}
    return cls(**(given | values))


def _adapter(args: argparse.Namespace) -> int:
    # Imported when a command trains: transformers and the training modules stay off the
    # start-up of every other `molora` command.
    from molora_runtime.training.adapter import AdapterTrainConfig, public_config, train_adapter

    extra = {"target_modules": args.target_modules.split(",")} if args.target_modules else {}
    if args.mixture:
        extra["mixture"] = parse_mixture(args.mixture)
    cfg = config_from_args(
        AdapterTrainConfig, args, skip=frozenset({"target_modules", "mixture"}), **extra
    )
    out = train_adapter(cfg)
    write_card(out, f"LoRA adapter `{cfg.domain}`", public_config(cfg), command_line())
    print(f"adapter written to {out}")
    return 0


def _router(args: argparse.Namespace) -> int:
    # Imported when a command trains (see `_adapter`).
    from molora_runtime.training.router import RouterTrainConfig, public_config, train_router

    adapters: dict[str, str] = {}
    for item in args.adapter:
        name, sep, folder = item.partition("=")
        if not sep:
            raise SystemExit(f"--adapter {item!r} must be NAME=PEFT_FOLDER")
        adapters[name] = folder
    cfg = config_from_args(RouterTrainConfig, args, adapters=adapters)
    out = train_router(cfg)
    write_card(out, "MoLoRA composition (learned gates)", public_config(cfg), command_line())
    print(f"composition written to {out}")
    return 0


def _draft(args: argparse.Namespace) -> int:
    # Imported when a command trains (see `_adapter`).
    from molora_runtime.training.draft import DraftTrainConfig, public_config, train_draft

    extra = {"domains": args.domains.split(",")} if args.domains else {}
    try:
        cfg = config_from_args(DraftTrainConfig, args, skip=frozenset({"domains"}), **extra)
        cfg.adapter_pair()
    except ValueError as exc:
        raise SystemExit(f"molora train draft: {exc}") from None
    out = train_draft(cfg)
    write_card(out, "MoLoRA draft head (eagle)", public_config(cfg), command_line())
    print(f"draft head written to {out}")
    return 0
