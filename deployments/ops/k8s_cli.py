"""`molora k8s render [--check]`: regenerate the RayService manifests from the GPU Serve config."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deployments.ops import kube


def _render(args: argparse.Namespace) -> int:
    root = Path(args.root)
    if args.check:
        stale = kube.stale(root)
        for path in stale:
            print(f"stale: {path} (run `molora k8s render`)", file=sys.stderr)
        return 1 if stale else 0
    for path in kube.write(root):
        print(f"wrote {path}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("k8s", help="Kubernetes (KubeRay) manifests")
    commands = parser.add_subparsers(dest="k8s_command", required=True)
    render = commands.add_parser(
        "render", help="write k8s/base/rayservice.yaml and the dev overlay patch"
    )
    render.add_argument("--root", default=str(kube.REPO_ROOT), help="repository root")
    render.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a file is stale"
    )
    render.set_defaults(func=_render)
