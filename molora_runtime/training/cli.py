"""`molora train adapter` and `molora train router`: argument parsing only, the work is elsewhere."""

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


def register(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser("train", help="train LoRA adapters and composition routers")
    sub = train.add_subparsers(dest="train_command", required=True)

    ad = sub.add_parser("adapter", help="LoRA-train one adapter on a domain (PEFT folder out)")
    ad.add_argument(
        "--domain", required=True, help="task domain (see molora_runtime.training.data)"
    )
    ad.add_argument("--output", required=True, help="PEFT folder to write (resumes if present)")
    _common(ad)
    ad.add_argument("--rank", type=int, default=8)
    ad.add_argument("--alpha", type=float, default=16.0)
    ad.add_argument("--target-modules", default=None, help="comma list (default: all linears)")
    ad.add_argument("--first-layer", type=int, default=0, help="adapt layers >= this one")
    ad.add_argument("--steps", type=int, default=150)
    ad.add_argument(
        "--stop-at",
        type=int,
        default=None,
        help="end (and save) after this step of the --steps schedule; resumes its checkpoint",
    )
    ad.add_argument("--batch-size", type=int, default=8)
    ad.add_argument("--lr", type=float, default=2e-3)
    ad.add_argument(
        "--init-from", default=None, help="PEFT folder to continue from (same rank and layers)"
    )
    ad.add_argument(
        "--loss-per-example",
        action="store_true",
        help="average the loss per example, then over the batch (default: over all tokens)",
    )
    ad.add_argument(
        "--mixture", default=None, help="multimodal task shares, e.g. read=0.85,mixed=0.15"
    )
    ad.add_argument(
        "--image-adapter",
        default=None,
        help="frozen PEFT folder serving image-code positions (train as the vocab route serves)",
    )
    ad.add_argument(
        "--code-dropout",
        type=float,
        default=0.0,
        help="multimodal: share of input image codes replaced by random ones (labels kept)",
    )
    ad.add_argument(
        "--text-adapter",
        default=None,
        help="frozen PEFT folder serving text positions (train `draw` as the vocab route serves)",
    )
    ad.add_argument(
        "--routed-fraction",
        type=float,
        default=1.0,
        help="share of steps trained routed with --image/--text-adapter (others alone)",
    )
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
    _common(ro)
    ro.add_argument("--top-k", type=int, default=2)
    ro.add_argument("--steps", type=int, default=100)
    ro.add_argument("--batch-size", type=int, default=8)
    ro.add_argument("--lr", type=float, default=5e-3)
    ro.add_argument("--balance-weight", type=float, default=0.01)
    ro.add_argument(
        "--single-fraction",
        type=float,
        default=0.5,
        help="share of single-domain examples in the mixed training data",
    )
    ro.add_argument(
        "--route-supervision",
        type=float,
        default=1.0,
        help="weight of the gate-vs-known-domain loss (0 = train the gates by LM loss only)",
    )
    ro.set_defaults(func=_router)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="base model alias or HF folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--checkpoint-every", type=int, default=50)


def _command_line() -> str:
    """The command as typed, with the home directory shown as `~` (no machine paths recorded)."""
    home = str(Path.home())
    return ("molora " + shlex.join(sys.argv[1:])).replace(home, "~")


def _config(
    cls: type[M], args: argparse.Namespace, skip: frozenset[str] = frozenset(), **values: Any
) -> M:
    """`cls` from the options named like its fields (less `skip`), plus the parsed `values`."""
    given = {n: getattr(args, n) for n in cls.model_fields if hasattr(args, n) and n not in skip}
    return cls(**(given | values))


def _adapter(args: argparse.Namespace) -> int:
    # Training loads transformers and peft (the `train` extra): only when a command trains.
    from molora_runtime.training.adapter import AdapterTrainConfig, public_config, train_adapter

    extra = {"target_modules": args.target_modules.split(",")} if args.target_modules else {}
    if args.mixture:
        extra["mixture"] = parse_mixture(args.mixture)
    cfg = _config(AdapterTrainConfig, args, skip=frozenset({"target_modules", "mixture"}), **extra)
    out = train_adapter(cfg)
    write_card(out, f"LoRA adapter `{cfg.domain}`", public_config(cfg), _command_line())
    print(f"adapter written to {out}")
    return 0


def _router(args: argparse.Namespace) -> int:
    # Training loads transformers and peft (the `train` extra): only when a command trains.
    from molora_runtime.training.router import RouterTrainConfig, public_config, train_router

    adapters: dict[str, str] = {}
    for item in args.adapter:
        name, sep, folder = item.partition("=")
        if not sep:
            raise SystemExit(f"--adapter {item!r} must be NAME=PEFT_FOLDER")
        adapters[name] = folder
    cfg = _config(RouterTrainConfig, args, adapters=adapters)
    out = train_router(cfg)
    write_card(out, "MoLoRA composition (learned gates)", public_config(cfg), _command_line())
    print(f"composition written to {out}")
    return 0
