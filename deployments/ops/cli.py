"""The `molora` command line: each floor registers its own sub-commands.

Sub-command modules are imported lazily by name so that `molora models prepare` does not pay
for Ray or boto3, and a missing optional extra only disables its own commands.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, what it adds); each module exposes `register(subparsers)`.
COMMAND_MODULES: tuple[str, ...] = (
    "molora_runtime.model.cli",
    "adapter_store.cli",
    "molora_runtime.training.cli",
    "molora_runtime.training.compose_cli",
    "deployments.ops.dashboards_cli",
    "deployments.ops.k8s_cli",
    "deployments.ops.keys_cli",
    "deployments.ops.serve_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="molora", description="MoLoRA Serve command line")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                continue  # that floor is not built yet / not installed
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
